"""The sync Cache: validation, key layout and errors around one backend."""

from __future__ import annotations

import functools
import time
from collections.abc import Callable, Iterable, Mapping
from types import TracebackType
from typing import TYPE_CHECKING, Generic, ParamSpec, TypeVar

from ._decorate import Locking
from ._ident import new_token, new_tokens
from ._keys import COUNT_SPACE, LOCK_SPACE, ONCE_SPACE, stored
from ._lock import TAKEN, Lease, Lock, shown
from ._renewer import Renewer
from ._scripts import KIND_CONFLICT, permit_ask
from ._validate import (
    DEFAULT_TTL,
    Seconds,
    amount_int,
    auto_extend_ms,
    key_bytes,
    key_list,
    limit_int,
    ttl_ms,
    value_bytes,
    wait_ms,
)
from .errors import LockNotAcquired, Unreplicated

if TYPE_CHECKING:
    from .backends import Backend, Named

__all__ = ["Cache", "CacheBase"]

P = ParamSpec("P")
R = TypeVar("R")
L = TypeVar("L", bound=Lease)


class CacheBase(Generic[L]):
    """What the sync Cache and hotlock.aio.AsyncCache share: key layout, reporting, checks."""

    __slots__ = ("_backend", "_count_prefix", "_lock_prefix", "_once_prefix", "_reply_timeout", "prefix")
    _lock_type: type[L]
    _shown_as = "hotlock.CacheBase"

    def __init__(self, backend: Named, prefix: bytes, reply_timeout: float = 2.0) -> None:
        self._backend = backend
        self.prefix = prefix
        """The prefix every key of this cache is stored under (``connect(prefix=...)``), as bytes."""
        # connect(timeout=...): how long close() waits for the releases sent in the background.
        self._reply_timeout = reply_timeout
        self._lock_prefix = prefix + LOCK_SPACE
        self._once_prefix = prefix + ONCE_SPACE
        self._count_prefix = prefix + COUNT_SPACE

    @property
    def enabled(self) -> bool:
        """False for the in-process fallback, whose locks exclude nothing outside this process."""
        return self._backend.name != "memory"

    @property
    def backend(self) -> str:
        """The backend in use: "native", "redis-py" or "memory"."""
        return self._backend.name

    @property
    def server(self) -> str:
        """The server, without credentials."""
        return self._backend.server

    @property
    def server_info(self) -> Mapping[str, object]:
        """What connect() found, read-only: ``kind`` ("redis", "valkey", "unknown" when INFO
        is refused, "memory"), ``version``, ``lua_free`` (extend/release sent without
        scripts), ``extend`` and ``release`` (what each sends) and ``reason``."""
        return self._backend.dialect.mapping()

    def __repr__(self) -> str:
        return f"<{self._shown_as} backend={self.backend} server={self.server} prefix={self.prefix!r}>"

    def _not_acquired(self, key: str | bytes, result: int, waited_ms: int | None, limit: int = 1) -> LockNotAcquired:
        """``result`` is the acquire's (<= 0): -(the holder's remaining TTL in ms), 0 if
        unknown, or KIND_CONFLICT when the key is held as the other kind."""
        if result == KIND_CONFLICT:
            held = (
                f"held as a plain lock, and a key is never also held with a limit (limit={limit})"
                if limit > 1
                else "held with a concurrency limit (as permits), and a key is never also held as a plain lock"
            )
        elif limit > 1:
            held = f"held by {limit} holders already (limit={limit}); a place frees in up to {-result / 1000:.3f} s"
        elif result == 0:
            held = "held elsewhere"
        else:
            held = f"held elsewhere for up to {-result / 1000:.3f} s more"
        after = "" if waited_ms is None else f" after waiting {waited_ms / 1000:.3f} s"
        # The acquire's own reply carries the holder's PTTL: no extra round trip for it.
        retry_after = -result / 1000 if result < 0 and result != KIND_CONFLICT else None
        return LockNotAcquired(
            f"lock {shown(key)!r} is {held}{after} (server {self.server})",
            key=shown(key),
            server=self.server,
            retry_after=retry_after,
        )

    def _live(self, locks: Iterable[L | None]) -> tuple[list[L | None], list[tuple[int, L]]]:
        """Check the locks given to a *_many call; return them and the (index, lock) pairs
        worth sending (None, released and inherited locks are not)."""
        kind = self._lock_type.__name__
        if isinstance(locks, (str, bytes)) or not isinstance(locks, Iterable):
            raise TypeError(f"locks must be an iterable of {kind} or None, not {type(locks).__name__}")
        items = list(locks)
        live = []
        for i, lock in enumerate(items):
            if lock is None:
                continue
            if not isinstance(lock, self._lock_type):
                raise TypeError(f"locks[{i}] must be a {kind} or None, not {type(lock).__name__}")
            if lock._backend is not self._backend:
                raise ValueError(f"locks[{i}] was taken on another cache")
            if lock._sendable():
                live.append((i, lock))
        return items, live


class Cache(CacheBase[Lock]):
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
        self._take: object = None if taker is None else taker(self._lock_prefix, self._lease_template())

    def _lease_template(self) -> Lock:
        """What the native one-call lock() copies its leases' other slots from (_meter, ...)."""
        return self._lease_class(self._backend, "", b"", b"", 1, 1, 0.0)

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

    def lock_wait(
        self,
        key: str | bytes,
        ttl: Seconds = DEFAULT_TTL,
        wait: Seconds = 10.0,
        *,
        auto_extend: bool = False,
        max_hold: Seconds | None = None,
        limit: int = 1,
    ) -> Lock:
        """Poll with jittered backoff until acquired; LockNotAcquired once ``wait`` has passed.

        Never sleeps past the deadline nor past the holder's remaining TTL; ``wait=0`` is
        exactly one attempt. ``auto_extend``, ``max_hold`` and ``limit`` as for lock(); a
        release of a permit wakes a waiter as a plain lock's release does.
        """
        got = self._lock_wait(key, ttl, wait, auto_extend=auto_extend, max_hold=max_hold, limit=limit)[0]
        if isinstance(got, LockNotAcquired):
            raise got
        return got

    def _lock_wait(
        self,
        key: str | bytes,
        ttl: Seconds = DEFAULT_TTL,
        wait: Seconds = 10.0,
        *,
        auto_extend: bool = False,
        max_hold: Seconds | None = None,
        limit: int = 1,
    ) -> tuple[Lock | LockNotAcquired, int]:
        """lock_wait()'s lock, or the LockNotAcquired it raises at the deadline; and the
        number of attempts it made (what a metrics listener is told, either way)."""
        name = stored(self._lock_prefix, key_bytes(key))
        ms = ttl_ms(ttl)
        wait_for = wait_ms(wait)
        hold = auto_extend_ms(auto_extend, max_hold, ms)
        n = limit_int(limit)
        token = permit_ask(new_token(), n)
        result, sent, attempts = self._backend.acquire_wait(name, token, ms, wait_for)
        if result <= 0:
            return self._not_acquired(key, result, wait_for, n), attempts
        lock = self._lease_class(self._backend, key, name, token, result, ms, sent)
        if auto_extend:
            self._renew().watch(lock, hold)
        return lock, attempts

    def with_lock(self, key: str | bytes, ttl: Seconds, fn: Callable[P, R], *args: P.args, **kwargs: P.kwargs) -> R:
        """Acquire once, run ``fn(*args, **kwargs)``, release however it ends; return its result."""
        if not callable(fn):
            raise TypeError(f"fn must be callable, not {type(fn).__name__}")
        with self.lock(key, ttl):
            return fn(*args, **kwargs)

    def locked(
        self,
        template: str,
        ttl: Seconds = DEFAULT_TTL,
        *,
        wait: Seconds | None = None,
        limit: int = 1,
        auto_extend: bool = False,
        max_hold: Seconds | None = None,
    ) -> Callable[[Callable[P, R]], Callable[P, R]]:
        """A decorator: each call of the function holds the lock on
        ``template.format(**arguments)``, released however the call ends.

        ```python
        @cache.locked("export:{tenant.id}", ttl=120, wait=5)
        def export(tenant, full=False): ...
        ```

        The arguments are the call's, bound to the function's signature with the defaults
        applied, so ``{tenant.id}`` and ``{ids[0]}`` work as in ``str.format``; on an
        instance method ``self`` is one (``"{self.id}"``). With ``wait=None`` the call tries
        once (lock()) and raises LockNotAcquired when the key is held elsewhere; with
        ``wait=S`` it waits up to S seconds (lock_wait()). ``limit``, ``auto_extend`` and
        ``max_hold`` are lock()'s; with ``auto_extend=True`` a lease lost during the call
        raises LockLost as the call returns, as a ``with`` block does (an exception of the
        function's own propagates instead).

        Everything but the key is checked here, before any call: a template field that
        names no parameter, a positional field (``{}``, ``{0}``), a generator function, a
        coroutine function (use hotlock.aio.AsyncCache.locked), a bad ttl, wait, limit,
        auto_extend or max_hold raise TypeError/ValueError. Put ``@staticmethod`` or
        ``@classmethod`` above it (``cls`` is then an argument). The wrapper keeps the
        function's name, docstring and signature (functools.wraps).
        """
        locking = Locking(template, ttl, wait, limit, auto_extend, max_hold)
        options = locking.options

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
        given, raw = key_list(keys)
        names = [stored(self._lock_prefix, k) for k in raw]
        ms = ttl_ms(ttl)
        hold = auto_extend_ms(auto_extend, max_hold, ms)
        if not names:
            return []
        tokens = new_tokens(len(names))
        sent = time.monotonic()
        results = self._backend.acquire_many(names, tokens, ms)
        locks = [
            self._lease_class(self._backend, key, name, token, result, ms, sent) if result > 0 else None
            for key, name, token, result in zip(given, names, tokens, results, strict=True)
        ]
        if auto_extend:
            self._renew().watch_many([lk for lk in locks if lk is not None], hold)
        return locks

    def extend_many(self, locks: Iterable[Lock | None], ttl: Seconds) -> list[bool]:
        """Extend each lock to ``ttl`` from now, in one round trip; False where it was lost.

        ``None`` entries (as lock_many returns) and released or inherited locks are False
        without a byte sent for them. Under wait_replicas an extend too few replicas
        confirmed is False too: its lease is lost (and its key released).
        """
        items, live = self._live(locks)
        ms = ttl_ms(ttl)
        out = [False] * len(items)
        if live:
            sent = time.monotonic()
            why: dict[int, str] = {}
            try:
                results = self._backend.extend_many([lk._name for _, lk in live], [lk._token for _, lk in live], ms)
            except Unreplicated as short:
                results, why = short.results, short.why
            for j, ((i, lock), ok) in enumerate(zip(live, results, strict=True)):
                lock._extended(ok, ms, sent, why.get(j, TAKEN))
                if lock._auto is not None:
                    lock._auto.touch()
                out[i] = ok
        return out

    def unlock_many(self, locks: Iterable[Lock | None]) -> list[bool]:
        """Release each lock in one round trip; True where this call released it."""
        items, live = self._live(locks)
        out = [False] * len(items)
        if live:
            for _, lock in live:
                if lock._auto is not None:
                    lock._auto.forget()  # before the release, as in Lock.unlock
            results = self._backend.release_many([lk._name for _, lk in live], [lk._token for _, lk in live])
            for (i, lock), ok in zip(live, results, strict=True):
                lock._token = b""
                out[i] = ok
        return out

    # -- idempotency keys and counters -------------------------------------------------

    def set_nx(self, key: str | bytes, value: str | bytes | int, ttl: Seconds) -> bool:
        """Set ``key`` to ``value`` for ``ttl`` unless it exists; True if this call set it."""
        name = stored(self._once_prefix, key_bytes(key))
        return self._backend.set_nx(name, value_bytes(value), ttl_ms(ttl))

    def incr(self, key: str | bytes, amount: int = 1) -> int:
        """Add ``amount`` to a counter atomically and return the new value."""
        name = stored(self._count_prefix, key_bytes(key))
        return self._backend.incr(name, amount_int(amount))

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
