"""The metrics hooks: a Cache that reports its locks' events to a hotlock.metrics listener.

connect(metrics=listener) returns a MeteredCache instead of a Cache. It observes the public
methods from outside (their results and exceptions already say every outcome), so a cache
without a listener runs the plain Cache code with not even a check on the acquire path.
Each lock it hands out carries a LeaseMeter (``Lease._meter``), which Lock.extend/unlock
call through a single ``is None`` test that is all an unmetered lock pays.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any

from ._cache import Cache
from ._lock import Lease, Lock
from .errors import CacheError, LockNotAcquired
from .metrics import LISTENER_METHODS, Listener, NotAcquired, Op

if TYPE_CHECKING:
    from ._backend import Backend

__all__ = ["LeaseMeter", "Meter", "MeteredCache", "as_list", "check_listener", "sendable"]

log = logging.getLogger("hotlock")

_monotonic = time.monotonic  # the clock of Lease._now, bound once for the hot path
_plain_lock = Cache.lock


def check_listener(metrics: object) -> Listener | None:
    """connect()'s check of ``metrics``, before any I/O: None, or an object with every
    Listener method (a missing one would otherwise surface as an AttributeError, logged
    and swallowed, on the first event)."""
    if metrics is None:
        return None
    missing = [m for m in LISTENER_METHODS if not callable(getattr(metrics, m, None))]
    if missing:
        raise TypeError(
            f"metrics must be a hotlock.metrics.Listener; {type(metrics).__name__} lacks {', '.join(missing)}"
        )
    return metrics  # type: ignore[return-value]


class Meter:
    """One cache's listener, called so that it can never change a lock call's outcome.

    The listener's methods are looked up once, here (at connect): an event then costs
    one call of the bound method inside a try, nothing more."""

    __slots__ = ("_acquired", "_error", "_extended", "_lost", "_not_acquired", "_released", "_warned", "listener")

    def __init__(self, listener: Listener) -> None:
        self.listener = listener
        self._warned = False
        self._acquired = listener.acquired
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

    def attach(self, lease: Lease) -> None:
        """Give a just-acquired lease its LeaseMeter. The hold time runs from when its
        acquire was sent, as its TTL does (the deadline is that moment plus the TTL)."""
        lease._meter = LeaseMeter(self, lease._deadline - lease._ttl_ms / 1000.0)

    def acquired(self, key: str | bytes, started: float, now: float, attempts: int | None) -> None:
        try:
            self._acquired(key, now - started, attempts)
        except Exception:
            self.raised()

    def took(self, lease: Lease, started: float, now: float, attempts: int | None) -> None:
        """attach() and acquired() in one: the try-once acquire's path."""
        lease._meter = LeaseMeter(self, lease._deadline - lease._ttl_ms / 1000.0)
        try:
            self._acquired(lease.key, now - started, attempts)
        except Exception:
            self.raised()

    def not_acquired(self, key: str | bytes, outcome: NotAcquired, started: float, now: float) -> None:
        self.call(self._not_acquired, key, outcome, now - started)

    def error(self, key: str | bytes, op: Op, error: CacheError) -> None:
        self.call(self._error, key, op, error)


class LeaseMeter:
    """What one metered lease reports: extend and release outcomes, losses, hold time."""

    __slots__ = ("meter", "taken_at")

    def __init__(self, meter: Meter, taken_at: float) -> None:
        self.meter = meter
        self.taken_at = taken_at  # on the lease's own clock (Lease._now)

    def extended(self, lease: Lease, ok: bool) -> None:
        meter = self.meter
        meter.call(meter._extended, lease.key, ok)
        if not ok:
            meter.call(meter._lost, lease.key, lease._now() - self.taken_at)

    def released(self, lease: Lease, ok: bool) -> None:
        meter = self.meter
        try:
            if ok:
                meter._released(lease.key, lease._now() - self.taken_at)
            else:
                # The release found another token or none: the lease had been lost already.
                meter._lost(lease.key, lease._now() - self.taken_at)
        except Exception:
            meter.raised()

    def failed(self, lease: Lease, op: Op, error: CacheError) -> None:
        self.meter.call(self.meter._error, lease.key, op, error)


def as_list(items: Any) -> Any:
    """A *_many call's iterable as a list (it is read twice: by the call and for the report),
    or as given when the call itself will refuse it, so its TypeError reads as without metrics."""
    if isinstance(items, (str, bytes)) or not isinstance(items, Iterable):
        return items
    return list(items)


def sendable(locks: Any) -> dict[int, Lease]:
    """The locks of a *_many call that it will send for (and so report on), by id()."""
    if not isinstance(locks, list):
        return {}  # refused by the call itself
    return {id(lk): lk for lk in locks if isinstance(lk, Lease) and lk._sendable()}


class MeteredCache(Cache):
    """A Cache that reports to a listener (see hotlock.metrics). Signatures pass through,
    so it follows whatever the plain Cache's methods accept."""

    __slots__ = ("_meter",)

    def __init__(self, backend: Backend, prefix: bytes, listener: Listener) -> None:
        super().__init__(backend, prefix)
        self._meter = Meter(listener)

    def lock(self, key: str | bytes, *args: Any, **kwargs: Any) -> Lock:
        # The hot path, written out (no _observe, no super()): metrics cost little here.
        started = _monotonic()
        try:
            lock = _plain_lock(self, key, *args, **kwargs)
        except LockNotAcquired:
            self._meter.not_acquired(key, "held", started, _monotonic())
            raise
        except CacheError as error:
            self._meter.error(key, "acquire", error)
            raise
        self._meter.took(lock, started, _monotonic(), 1)
        return lock

    def lock_wait(self, key: str | bytes, *args: Any, **kwargs: Any) -> Lock:
        return self._observe(super().lock_wait, "timeout", key, args, kwargs, attempts=None)

    def _observe(
        self,
        acquire: Callable[..., Lock],
        conflict: NotAcquired,
        key: str | bytes,
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
        attempts: int | None = 1,
    ) -> Lock:
        meter = self._meter
        started = time.monotonic()
        try:
            lock = acquire(key, *args, **kwargs)
        except LockNotAcquired:
            meter.not_acquired(key, conflict, started, time.monotonic())
            raise
        except CacheError as error:
            meter.error(key, "acquire", error)
            raise
        meter.took(lock, started, time.monotonic(), attempts)
        return lock

    def lock_many(self, keys: Iterable[str | bytes], *args: Any, **kwargs: Any) -> list[Lock | None]:
        meter = self._meter
        given = as_list(keys)
        started = time.monotonic()
        try:
            locks = super().lock_many(given, *args, **kwargs)
        except CacheError as error:
            for key in given:
                meter.error(key, "acquire", error)
            raise
        now = time.monotonic()
        for key, lock in zip(given, locks, strict=True):
            if lock is None:
                meter.not_acquired(key, "held", started, now)
            else:
                meter.attach(lock)
                meter.acquired(key, started, now, 1)
        return locks

    def extend_many(self, locks: Iterable[Lock | None], *args: Any, **kwargs: Any) -> list[bool]:
        items = as_list(locks)
        sent = sendable(items)
        try:
            results = super().extend_many(items, *args, **kwargs)
        except CacheError as error:
            for held in sent.values():
                if held._meter is not None:
                    held._meter.failed(held, "extend", error)
            raise
        for item, ok in zip(items, results, strict=True):
            lease = sent.get(id(item))
            if lease is not None and lease._meter is not None:
                lease._meter.extended(lease, ok)
        return results

    def unlock_many(self, locks: Iterable[Lock | None]) -> list[bool]:
        items = as_list(locks)
        sent = sendable(items)
        try:
            results = super().unlock_many(items)
        except CacheError as error:
            for held in sent.values():
                if held._meter is not None:
                    held._meter.failed(held, "release", error)
            raise
        for item, ok in zip(items, results, strict=True):
            lease = sent.get(id(item))
            if lease is not None and lease._meter is not None:
                lease._meter.released(lease, ok)
        return results
