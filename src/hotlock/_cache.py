"""The sync Cache: the calls hotlock._core checks and builds, sent to one backend."""

from __future__ import annotations

import functools
import time
from collections.abc import Callable, Iterable
from types import TracebackType
from typing import TYPE_CHECKING, ParamSpec, Protocol, TypeVar

from ._core import CacheBase, Extending, Releasing, Request
from ._decorate import Locking
from ._ident import new_token
from ._keys import stored
from ._lock import Lock
from ._renewer import Renewer
from ._scripts import permit_ask
from ._validate import DEFAULT_TTL, Seconds, auto_extend_ms, key_bytes, limit_int, ttl_ms
from .errors import LockNotAcquired, Unreplicated

if TYPE_CHECKING:
    from .backends import Backend

__all__ = ["Cache", "Decorate"]

P = ParamSpec("P")
R = TypeVar("R")


class Decorate(Protocol):
    """What Cache.locked() returns: a decorator of plain functions."""

    def __call__(self, fn: Callable[P, R], /) -> Callable[P, R]: ...


class Cache(CacheBase[Lock, Lock, Decorate]):
    """Locks, idempotency keys and counters on one backend. Make one with hotlock.connect()."""

    __slots__ = ("_renewer", "_take")
    _lock_type = Lock
    # The class of the leases it makes: Lock, or on the native backend hotlock._fastpath's
    # NativeLock, whose unlock and extend are one extension call.
    _lease_class: type[Lock] = Lock
    _shown_as = "hotlock.Cache"
    _backend: Backend

    def __init__(self, backend: Backend, prefix: bytes, reply_timeout: float = 2.0) -> None:
        super().__init__(backend, prefix, reply_timeout)
        # The one renewer of this cache's auto-extended leases, made on first use.
        self._renewer: Renewer | None = None
        # The native backend does lock()'s common case in one call (hotlock._fastpath's
        # NativeCache, ext/_lease.pxi): the key and TTL as the validators would take them
        # (anything else it hands to them), the token, the acquire and the Lock, copied
        # from this template. None elsewhere.
        taker = getattr(backend, "taker", None)
        self._take: object = None if taker is None else taker(self._lock_prefix, self._lease_class)

    def _renew(self) -> Renewer:
        if self._renewer is None:
            self._renewer = Renewer(self._backend, self._reply_timeout)
        return self._renewer

    # -- locks ------------------------------------------------------------------------

    def lock(
        self,
        key: str | bytes,
        ttl: Seconds = DEFAULT_TTL,
        *,
        auto_extend: bool = False,
        max_hold: Seconds | None = None,
        limit: int = 1,
    ) -> Lock:
        """Try once. Returns a Lock, or raises LockNotAcquired when another holder has the key.

        ``auto_extend=True`` hands the lease to the cache's renewer, which extends it about
        every ttl/3 until it is released, lost, ``max_hold`` seconds have passed, or the
        cache is closed; ``lock.lost``, ``lock.check()`` and ``lock.on_lost()`` tell the
        work when it is lost, and leaving a ``with`` block then raises LockLost.

        ``limit=N`` lets up to N holders have the key at once, each with a Lock of its own
        (a permit: its own token, TTL, fence, extend and release); LockNotAcquired when N
        hold it. A key is held either plainly (limit 1) or with a limit, never both.
        """
        name = stored(self._lock_prefix, key_bytes(key))
        ms = ttl_ms(ttl)
        hold = auto_extend_ms(auto_extend, max_hold, ms)
        n = limit_int(limit)
        token = permit_ask(new_token(), n)
        sent = time.monotonic()
        result = self._backend.acquire(name, token, ms)
        if result <= 0:
            raise self._not_acquired(key, result, None, n)
        lock = self._lease_class(self._backend, key, name, token, result, ms, sent)
        if auto_extend:
            self._renew().watch(lock, hold)
        return lock

    def _waiting(self, request: Request) -> Lock:
        got = self._wait(request)[0]
        if isinstance(got, LockNotAcquired):
            raise got
        return got

    def _wait(self, request: Request) -> tuple[Lock | LockNotAcquired, int]:
        """lock_wait()'s lock, or the LockNotAcquired it raises at the deadline; and the
        number of attempts it made (what a metrics listener is told, either way)."""
        wait_for = request.wait_ms
        assert wait_for is not None  # lock_wait() checked it
        token = permit_ask(new_token(), request.limit)
        result, sent, attempts = self._backend.acquire_wait(request.name, token, request.ttl_ms, wait_for)
        if result <= 0:
            return self._not_acquired(request.key, result, wait_for, request.limit), attempts
        lock = self._lease_class(self._backend, request.key, request.name, token, result, request.ttl_ms, sent)
        if request.auto:
            self._renew().watch(lock, request.hold_ms)
        return lock, attempts

    def with_lock(self, key: str | bytes, ttl: Seconds, fn: Callable[P, R], *args: P.args, **kwargs: P.kwargs) -> R:
        """Acquire once, run ``fn(*args, **kwargs)``, release however it ends; return its result."""
        if not callable(fn):
            raise TypeError(f"fn must be callable, not {type(fn).__name__}")
        with self.lock(key, ttl):
            return fn(*args, **kwargs)

    def _decorator(self, locking: Locking) -> Decorate:
        ttl, wait, options = locking.ttl, locking.wait, locking.options

        def decorate(fn: Callable[P, R]) -> Callable[P, R]:
            key_of = locking.keys(fn, coroutine=False)

            @functools.wraps(fn)
            def locked_call(*args: P.args, **kwargs: P.kwargs) -> R:
                key = key_of(args, kwargs)
                lock = self.lock(key, ttl, **options) if wait is None else self.lock_wait(key, ttl, wait, **options)
                with lock:
                    return fn(*args, **kwargs)

            return locked_call

        return decorate

    def lock_many(
        self,
        keys: Iterable[str | bytes],
        ttl: Seconds = DEFAULT_TTL,
        *,
        auto_extend: bool = False,
        max_hold: Seconds | None = None,
    ) -> list[Lock | None]:
        """Try each key once, in one round trip: a Lock per key, or None where held elsewhere.

        ``auto_extend`` and ``max_hold`` as for lock(), for every lock taken.
        """
        taking = self._taking(keys, ttl, auto_extend, max_hold)
        if not taking.names:
            return []
        sent = time.monotonic()
        results = self._backend.acquire_many(taking.names, taking.tokens, taking.ttl_ms)
        locks = taking.leases(results, sent, functools.partial(self._lease_class, self._backend))
        if auto_extend:
            self._renew().watch_many([lk for lk in locks if lk is not None], taking.hold_ms)
        return locks

    def extend_many(self, locks: Iterable[Lock | None], ttl: Seconds) -> list[bool]:
        """Extend each lock to ``ttl`` from now, in one round trip; False where it was lost.

        ``None`` entries (as lock_many returns) and released or inherited locks are False
        without a byte sent for them. Under wait_replicas an extend too few replicas
        confirmed is False too: its lease is lost (and its key released).
        """
        extending = Extending(self._live(locks), ttl)
        if not extending.live:
            return extending.out
        sent = time.monotonic()
        try:
            results = self._backend.extend_many(extending.names, extending.tokens, extending.ms)
        except Unreplicated as short:
            return extending.done(short.results, sent, short.why)
        return extending.done(results, sent)

    def unlock_many(self, locks: Iterable[Lock | None]) -> list[bool]:
        """Release each lock in one round trip; True where this call released it."""
        releasing = Releasing(self._live(locks))
        if not releasing.live:
            return releasing.out
        return releasing.done(self._backend.release_many(releasing.names, releasing.tokens))

    # -- idempotency keys and counters -------------------------------------------------

    def set_nx(self, key: str | bytes, value: str | bytes | int, ttl: Seconds) -> bool:
        """Set ``key`` to ``value`` for ``ttl`` unless it exists; True if this call set it."""
        return self._backend.set_nx(*self._once(key, value, ttl))

    def incr(self, key: str | bytes, amount: int = 1) -> int:
        """Add ``amount`` to a counter atomically and return the new value."""
        return self._backend.incr(*self._counter(key, amount))

    # -- lifetime ---------------------------------------------------------------------

    def close(self) -> None:
        """Stop the renewer (auto-extended leases then expire by their TTL; releases of
        leases lost in their block get one reply timeout to land) and disconnect."""
        if self._renewer is not None:
            self._renewer.close()
        self._backend.close()

    def __enter__(self) -> Cache:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()
