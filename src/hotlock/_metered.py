"""The metrics hooks: a Cache that reports its locks' events to a hotlock.metrics listener.

connect(metrics=listener) returns a MeteredCache instead of a Cache. It observes the public
methods from outside (their results and exceptions already say every outcome), so a cache
without a listener runs the plain Cache code with not even a check on the acquire path.
Each lock it hands out carries the cache's Meter (``Lease._meter``), which Lock.extend/unlock
call through a single ``is None`` test that is all an unmetered lock pays.
"""

from __future__ import annotations

import functools
import logging
import time
from collections.abc import Callable, Iterable, Sequence
from typing import TYPE_CHECKING, Any, Literal

from ._cache import Cache
from ._core import Request
from ._lock import Lease, Lock
from ._validate import DEFAULT_TTL, Seconds
from .errors import CacheError, LockNotAcquired
from .metrics import BaseListener, Listener, NotAcquired, Op, WaitOutcome

if TYPE_CHECKING:
    from .backends import Backend

__all__ = ["Batch", "Meter", "MeteredCache", "as_list"]

log = logging.getLogger("hotlock")

_monotonic = time.monotonic  # the clock of Lease._now, bound once for the hot path


class Meter:
    """One cache's listener, called so that it can never change a lock call's outcome; and
    the LeaseHooks of every lease that cache hands out (one object for all of them: a
    lease's hold time runs from its own ``_since``, when its acquire was sent).

    The listener's methods are looked up once, here (at connect): an event then costs
    one call of the bound method inside a try, nothing more."""

    __slots__ = (
        "_acquired",
        "_error",
        "_extended",
        "_lost",
        "_not_acquired",
        "_released",
        "_waited",
        "_warned",
        "listener",
    )

    def __init__(self, listener: Listener) -> None:
        self.listener = listener
        self._warned = False
        self._acquired = listener.acquired
        # A lock_wait's outcome: the optional waited(), else what BaseListener.waited calls.
        waited = getattr(listener, "waited", None)
        self._waited: Callable[[str | bytes, WaitOutcome, float, int], None] = (
            waited if callable(waited) else functools.partial(BaseListener.waited, listener)  # type: ignore[arg-type]
        )
        self._not_acquired = listener.not_acquired
        self._released = listener.released
        self._extended = listener.extended
        self._lost = listener.lost
        self._error = listener.error

    def raised(self) -> None:
        """The listener raised (called from its ``except``): a broken listener must not
        turn an acquired lock into an exception (the key would stay held until its TTL)
        nor fail a release; say so once per cache."""
        if not self._warned:
            self._warned = True
            log.warning("metrics listener %r raised; its events are dropped", self.listener, exc_info=True)

    def call(self, event: Callable[..., None], *args: Any) -> None:
        try:
            event(*args)
        except Exception:
            self.raised()

    def took(self, lease: Lease, wait_s: float, attempts: int) -> None:
        """A lock was acquired: it reports to this meter from now on."""
        lease._meter = self
        try:
            self._acquired(lease.key, wait_s, attempts)
        except Exception:
            self.raised()

    def waited(self, lease: Lease, wait_s: float, attempts: int) -> None:
        """A lock_wait acquired its lock after ``attempts`` attempts."""
        lease._meter = self
        try:
            self._waited(lease.key, "acquired", wait_s, attempts)
        except Exception:
            self.raised()

    def timed_out(self, key: str | bytes, wait_s: float, attempts: int) -> None:
        """A lock_wait's deadline passed after ``attempts`` attempts."""
        self.call(self._waited, key, "timeout", wait_s, attempts)

    def took_many(self, keys: list[str | bytes], leases: Sequence[Lease | None], wait_s: float) -> None:
        """A lock_many's outcomes, key by key."""
        for key, lease in zip(keys, leases, strict=True):
            if lease is None:
                self.not_acquired(key, "held", wait_s)
            else:
                self.took(lease, wait_s, 1)

    def not_acquired(self, key: str | bytes, outcome: NotAcquired, wait_s: float) -> None:
        self.call(self._not_acquired, key, outcome, wait_s)

    def error(self, key: str | bytes, op: Op, error: CacheError) -> None:
        self.call(self._error, key, op, error)

    # -- LeaseHooks: what a lease reports (Lock.extend/unlock, the renewer) ----------------

    def extended(self, lease: Lease, ok: bool) -> None:
        self.call(self._extended, lease.key, ok)
        if not ok:
            self.lost(lease)

    def released(self, lease: Lease, ok: bool) -> None:
        if not ok:
            self.lost(lease)  # the release found another token or none: lost already
        elif not lease._loss_counted:  # a lease ends once: released, or lost
            try:
                self._released(lease.key, lease._now() - lease._since)
            except Exception:
                self.raised()

    def lost(self, lease: Lease) -> None:
        """The lease is lost (taken over, expired, past max_hold): counted once per lease,
        whichever finds it first (an extend, the renewer, the release, a block's end)."""
        if not lease._loss_counted:
            lease._loss_counted = True
            self.call(self._lost, lease.key, lease._now() - lease._since)

    def failed(self, lease: Lease, op: Op, error: CacheError) -> None:
        self.call(self._error, lease.key, op, error)


def as_list(items: Any) -> Any:
    """A *_many call's iterable as a list (it is read twice: by the call and for the report),
    or as given when the call itself will refuse it, so its TypeError reads as without metrics."""
    if isinstance(items, (str, bytes)) or not isinstance(items, Iterable):
        return items
    return list(items)


class Batch:
    """The locks given to an extend_many or unlock_many, and the report of its outcome for
    those it sends for (sync and async alike)."""

    __slots__ = ("items", "op", "sent")

    def __init__(self, locks: Any, op: Literal["extend", "release"]) -> None:
        self.items = as_list(locks)
        self.op = op
        # The locks the call will send for, by id(): the others have nothing to report.
        self.sent: dict[int, Lease] = (
            {id(lk): lk for lk in self.items if isinstance(lk, Lease) and lk._sendable()}
            if isinstance(self.items, list)
            else {}  # refused by the call itself
        )

    def failed(self, error: CacheError) -> None:
        for lease in self.sent.values():
            if lease._meter is not None:
                lease._meter.failed(lease, self.op, error)

    def done(self, results: list[bool]) -> None:
        for item, ok in zip(self.items, results, strict=True):
            lease = self.sent.get(id(item))
            if lease is not None and lease._meter is not None:
                if self.op == "extend":
                    lease._meter.extended(lease, ok)
                else:
                    lease._meter.released(lease, ok)


class MeteredCache(Cache):
    """A Cache that reports to a listener (see hotlock.metrics). Signatures pass through,
    so it follows whatever the plain Cache's methods accept."""

    __slots__ = ("_meter",)
    # The lock() this one measures: the plain Cache's (hotlock._fastpath's metered native
    # cache gives the one-call lock instead).
    _plain_lock = staticmethod(Cache.lock)

    def __init__(self, backend: Backend, prefix: bytes, listener: Listener, reply_timeout: float = 2.0) -> None:
        self._meter = Meter(listener)
        super().__init__(backend, prefix, reply_timeout)

    def lock(self, key: str | bytes, ttl: Seconds = DEFAULT_TTL, **options: Any) -> Lock:
        # The hot path, written out (no super(), no Meter.took, ttl passed
        # on by position): metrics cost little here (bench/results.md "Metrics: what the
        # listener costs").
        meter = self._meter
        started = _monotonic()
        try:
            lock = self._plain_lock(self, key, ttl, **options) if options else self._plain_lock(self, key, ttl)
        except LockNotAcquired:
            meter.not_acquired(key, "held", _monotonic() - started)
            raise
        except CacheError as error:
            meter.error(key, "acquire", error)
            raise
        lock._meter = meter  # every lease is made without one (Lease._fill)
        try:
            meter._acquired(key, _monotonic() - started, 1)
        except Exception:
            meter.raised()
        return lock

    def _waiting(self, request: Request) -> Lock:
        meter = self._meter
        started = _monotonic()
        try:
            got, attempts = self._wait(request)
        except CacheError as error:
            meter.error(request.key, "acquire", error)
            raise
        if isinstance(got, LockNotAcquired):
            meter.timed_out(request.key, _monotonic() - started, attempts)
            raise got
        meter.waited(got, _monotonic() - started, attempts)
        return got

    def lock_many(self, keys: Iterable[str | bytes], *args: Any, **kwargs: Any) -> list[Lock | None]:
        meter = self._meter
        given = as_list(keys)
        started = _monotonic()
        try:
            locks = super().lock_many(given, *args, **kwargs)
        except CacheError as error:
            for key in given:
                meter.error(key, "acquire", error)
            raise
        meter.took_many(given, locks, _monotonic() - started)
        return locks

    def extend_many(self, locks: Iterable[Lock | None], *args: Any, **kwargs: Any) -> list[bool]:
        batch = Batch(locks, "extend")
        try:
            results = super().extend_many(batch.items, *args, **kwargs)
        except CacheError as error:
            batch.failed(error)
            raise
        batch.done(results)
        return results

    def unlock_many(self, locks: Iterable[Lock | None]) -> list[bool]:
        batch = Batch(locks, "release")
        try:
            results = super().unlock_many(batch.items)
        except CacheError as error:
            batch.failed(error)
            raise
        batch.done(results)
        return results
