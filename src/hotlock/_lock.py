"""The lease object: one acquisition, owned by whoever holds the object."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from types import TracebackType
from typing import TYPE_CHECKING, Literal, Protocol

from . import _ident
from ._scripts import held_value
from ._validate import Seconds, ttl_ms
from .errors import CacheError, LockLost, Unreplicated

if TYPE_CHECKING:
    from .backends import Backend, Named

__all__ = ["Lease", "LeaseHooks", "Lock", "Watch", "past_max_hold", "shown"]

log = logging.getLogger("hotlock")

# Why a lease is lost, as LockLost and the log say it.
TAKEN = "is no longer held: it expired or was taken over"
UNCONFIRMED = "was not confirmed by an extend before its TTL ran out (Redis unreachable or too slow)"


def past_max_hold(max_hold: float | None) -> str:
    return f"was held past its max_hold of {max_hold:g} s, so it is no longer extended"


class Watch(Protocol):
    """What an auto-extended lease asks of the renewer holding it (hotlock._renewer.Held)."""

    def forget(self) -> None: ...  # released: never extend it again
    def let_go(self, token: bytes) -> None: ...  # lost: never extend it; release ``token`` in the background
    def touch(self) -> None: ...  # extended or lost by hand: look at it again now
    def on_lost(self, callback: Callable[[Lease], object]) -> None: ...
    def capped(self, ms: int, now: float) -> int: ...  # the TTL an extend sent now may ask (max_hold)
    def expired(self) -> str: ...  # why the lease is lost once its deadline has passed

    max_hold: float | None  # seconds, as given to lock()


def shown(key: str | bytes) -> str:
    """A key as errors and logs show it."""
    return key if isinstance(key, str) else key.decode("utf-8", "backslashreplace")


class LeaseHooks(Protocol):
    """What a lease taken on a cache made with connect(metrics=...) reports to
    (hotlock._metered.Meter, shared by the cache's leases); a plain lease has none."""

    def extended(self, lease: Lease, ok: bool) -> None: ...
    def released(self, lease: Lease, ok: bool) -> None: ...
    def lost(self, lease: Lease) -> None: ...
    def failed(self, lease: Lease, op: Literal["extend", "release"], error: CacheError) -> None: ...


class Lease:
    """What a sync Lock and an async hotlock.aio.AsyncLock share: the lease's state.

    A held lock: its key, its fence, a hidden token, the pid that took it and a local
    deadline. ``fence`` is an int larger than the fence of every earlier acquisition of
    this key (docs/fencing.md); extend keeps it. The token lives here and nowhere
    else (never in a thread-local, a contextvar or on the cache), so whoever holds the
    object may extend or release it and two acquisitions never share state. The token is a
    bearer secret: it is in no repr, log line or message.
    """

    __slots__ = (
        "_auto",
        "_backend",
        "_deadline",
        "_loss",
        "_loss_counted",
        "_meter",
        "_name",
        "_pid",
        "_since",
        "_token",
        "_ttl_ms",
        "fence",
        "key",
    )
    _shown_as = "hotlock.Lease"

    key: str | bytes
    """The key as the caller gave it (str or bytes), without the prefix."""
    fence: int
    """The fencing token: an int larger than the fence of every earlier acquisition of
    this key; 0 under connect(fences=False)."""

    def __init__(
        self, backend: Named, key: str | bytes, name: bytes, token: bytes, fence: int, ttl: int, sent_at: float
    ) -> None:
        self._fill(backend, key, name, held_value(token, fence), fence, ttl, sent_at)

    def _fill(
        self, backend: Named, key: str | bytes, name: bytes, held: bytes, fence: int, ttl: int, sent_at: float
    ) -> None:
        """Every field of a new lease, set here and nowhere else: by __init__, and by the
        native backend's one-call lock() and lock_many() (ext/_lease.pxi), which call it on
        ``object.__new__(cls)`` with the held value formatted in C. ``held`` is
        held_value(token, fence)."""
        self._backend = backend
        self.key = key
        self.fence = fence if backend.fenced else 0
        self._name = name  # the Redis key, prefix included
        # What the key holds (token + fence) and extend/release compare; b"" once
        # released: nothing more is sent for this lock.
        self._token = held
        self._ttl_ms = ttl
        self._pid = _ident.pid
        # When the acquire was sent: the TTL runs from then, not from when its reply came
        # back (so does max_hold, and the hold time metrics report).
        self._since = sent_at
        self._deadline = sent_at + ttl / 1000.0
        # connect(metrics=...): set by the metered cache that took it; None costs one test.
        self._meter: LeaseHooks | None = None
        # Why it is known lost (an extend found another token or none, ...), or None.
        self._loss: str | None = None
        # Whether the meter has counted its loss: once per lease, however it is found.
        self._loss_counted = False
        # The renewer's record when taken with auto_extend=True (hotlock._renewer).
        self._auto: Watch | None = None

    # The clock the deadline is on (AsyncLock's is its loop's): the builtin itself, so a
    # reading costs no Python frame.
    _now: Callable[[], float] = staticmethod(time.monotonic)

    @property
    def ttl(self) -> float:
        """The TTL in seconds this lock was taken or last extended with."""
        return self._ttl_ms / 1000.0

    def valid_for(self) -> float:
        """Seconds this lock is known to be ours; 0.0 once the TTL may have run out."""
        if not self._sendable():
            return 0.0
        # Never more than the TTL: uvloop's clock is cached per loop turn, so "now" can be
        # the very instant the acquire was sent, and (sent + ttl) - sent rounds above ttl.
        return max(0.0, min(self._deadline - self._now(), self._ttl_ms / 1000.0))

    def _extend_ms(self, ttl: Seconds | None, now: float) -> int:
        """extend()'s checks before anything is sent: the TTL in ms (cut so that the key
        expires by max_hold), or LockLost."""
        ms = self._ttl_ms if ttl is None else ttl_ms(ttl)
        if self._pid != _ident.pid:
            raise self._lost(f"was taken by process {self._pid}; a forked child cannot extend it")
        if not self._token:
            raise self._lost("was already released")
        why = self._loss_at(now)
        if why is not None and (self._auto is not None or why is not UNCONFIRMED):
            # Lost for good: the work has been told (or the key is gone: taken over, or
            # released after too few replicas confirmed an extend), so an extend that
            # happened to find the key still ours must not make it held again.
            raise self._lost(why)
        if self._auto is not None:
            ms = self._auto.capped(ms, now)
            if ms == 0:
                raise self._lost(past_max_hold(self._auto.max_hold))
        return ms

    def _loss_at(self, now: float) -> str | None:
        """Why this lease is lost at ``now`` (on its own clock), or None while it is held.

        An auto-extended lease past its deadline is recorded lost for good: a late extend
        reply never makes it held again. A plain lease past its deadline is lost until an
        extend() succeeds (its TTL may have run out; nobody was told).
        """
        if self._loss is None and self._token and now >= self._deadline:
            if self._auto is None:
                return UNCONFIRMED
            self._loss = self._auto.expired()
        return self._loss

    @property
    def lost(self) -> bool:
        """True once the lease is known lost: an extend found another token or none, its
        TTL ran out before an extend was confirmed, or (auto_extend) max_hold passed.

        False for a released lock (released is not lost) and in the process that took it
        until one of those happens; a forked child does not hold its parent's lock.
        """
        if self._pid != _ident.pid:
            return bool(self._token)
        return self._loss_at(self._now()) is not None

    def check(self) -> None:
        """Raise LockLost unless the lock is still known to be ours: not lost, not
        released, not inherited by a forked child. Cheap: no round trip."""
        if self._pid != _ident.pid:
            raise self._lost(f"was taken by process {self._pid}; a forked child does not hold it")
        if not self._token:
            raise self._lost("was already released")
        why = self._loss_at(self._now())
        if why is not None:
            raise self._lost(why)

    def on_lost(self, callback: Callable[[Lease], object]) -> None:
        """Call ``callback(lock)`` once, from the renewer, when the lease is lost.

        Only for locks taken with auto_extend=True (the renewer is what notices). A
        callback given after the loss was told is called at once, here. It runs on the
        renewer's thread (sync) or loop (async) with no hotlock lock held, so it may call
        unlock() or take other locks; keep it short, since the renewer waits for it. An
        exception from it is logged and ignored.
        """
        if not callable(callback):
            raise TypeError(f"callback must be callable, not {type(callback).__name__}")
        if self._auto is None:
            raise ValueError("on_lost needs a lock taken with auto_extend=True: only the renewer notices a loss")
        self._auto.on_lost(callback)

    def _lost(self, why: str) -> LockLost:
        key = shown(self.key)
        return LockLost(f"lock {key!r} {why} (server {self._backend.server})", key=key, server=self._backend.server)

    def _extended(self, ok: bool, ms: int, sent: float, why: str = TAKEN) -> bool:
        """Record an extend's outcome: a new deadline, or none left (lost for ``why``)."""
        if ok:
            self._ttl_ms = ms
            self._deadline = sent + ms / 1000.0
        else:
            self._deadline = sent
            self._loss = why
        return ok

    def _unreplicated(self, short: Unreplicated, sent: float) -> LockLost:
        """An extend() too few replicas confirmed (wait_replicas; the backend released the
        key): recorded and counted as an extend that lost the lease; the LockLost to raise."""
        why = short.why.get(0, TAKEN)
        if self._meter is not None:  # metrics hook
            self._meter.extended(self, False)
        self._extended(False, 0, sent, why)
        if self._auto is not None:
            self._auto.touch()  # a loss to tell
        return self._lost(why)

    def _extend_replied(self, ok: bool, ms: int, sent: float) -> None:
        """extend()'s reply (True: the key still held the token): reported, recorded and
        told the renewer; LockLost when the key was lost."""
        if self._meter is not None:  # metrics hook
            self._meter.extended(self, ok)
        self._extended(ok, ms, sent)
        if self._auto is not None:
            self._auto.touch()  # a new deadline to renew by, or a loss to tell
        if not ok:
            raise self._lost(TAKEN)

    def _failed(self, op: Literal["extend", "release"], error: CacheError) -> None:
        """An extend or release Redis could not answer: reported (the lease is unchanged)."""
        if self._meter is not None:  # metrics hook
            self._meter.failed(self, op, error)

    def _released(self, released: bool) -> bool:
        """unlock()'s reply: nothing more is sent for this lease; reported; the result."""
        self._token = b""
        if self._meter is not None:  # metrics hook
            self._meter.released(self, released)
        return released

    def _sendable(self) -> bool:
        """Not yet released, and taken by this process (a forked child sends nothing)."""
        return bool(self._token) and self._pid == _ident.pid

    def _let_go(self) -> None:
        """Leaving a block whose auto-extended lease is known lost: unlock() without
        waiting on the network, since a known loss is raised at once. The renewer never
        extends it again and sends its release in the background (after a deadline or
        max_hold loss the key may still hold the token, on a server that was slow or
        unreachable); the loss is counted once."""
        token, self._token = self._token, b""
        if self._pid != _ident.pid:
            return  # a forked child sends and counts nothing for its parent's lease
        if self._meter is not None:  # metrics hook
            self._meter.lost(self)
        if self._auto is not None:
            self._auto.let_go(token)

    def __repr__(self) -> str:
        key, server = shown(self.key), self._backend.server
        return f"<{self._shown_as} key={key!r} valid_for={self.valid_for():.3f}s server={server}>"


class Lock(Lease):
    """A held lock (see Lease); released however a ``with`` block ends."""

    __slots__ = ()
    _shown_as = "hotlock.Lock"
    _backend: Backend

    def extend(self, ttl: Seconds | None = None) -> None:
        """Set the TTL to ``ttl`` seconds from now (default: the TTL it was taken with).

        Raises LockLost when the key no longer holds this lock's token, and CacheError
        when Redis cannot answer (a hiccup the caller may retry until valid_for() is 0).
        """
        sent = time.monotonic()
        ms = self._extend_ms(ttl, sent)
        try:
            ok = self._backend.extend(self._name, self._token, ms)
        except Unreplicated as short:
            raise self._unreplicated(short, sent) from None
        except CacheError as error:
            self._failed("extend", error)
            raise
        self._extend_replied(ok, ms, sent)

    def unlock(self) -> bool:
        """Release the lock; True if this call released it, False if it was no longer ours.

        Idempotent, and never raises LockLost. A CacheError (Redis down) keeps the token,
        so a later call can still release it; otherwise the key expires by its TTL.
        """
        if not self._token or self._pid != _ident.pid:  # self._sendable(), inline: the hot path
            return False
        if self._auto is not None:
            # Before the release is sent: a renewal racing it then finds no key (extends
            # never create one) and its reply is ignored, so no loss is told for it.
            self._auto.forget()
        try:
            released = self._backend.release(self._name, self._token)
        except CacheError as error:
            self._failed("release", error)
            raise
        # Lease._released, inline: the hot path.
        self._token = b""
        if self._meter is not None:  # metrics hook
            self._meter.released(self, released)
        return released

    def __enter__(self) -> Lock:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        # Only an auto-extended lease promises the block that it stayed held; a plain one
        # leaves that to valid_for().
        why = None if self._auto is None else self._loss_at(self._now())
        if why is not None:
            self._let_go()
            if exc_type is None:
                # The work was not protected all along, and the caller must know.
                raise self._lost(why)
            return
        try:
            self.unlock()
        except Exception as error:
            # Never let the release hide the body's own exception or fail a body that
            # succeeded: the key expires by its TTL.
            log.warning("release of lock %r failed; it expires by its TTL: %s", shown(self.key), error)
