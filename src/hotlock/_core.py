"""What the sync Cache and hotlock.aio.AsyncCache share, without I/O: each call checked and built.

``CacheBase`` holds the cache's key layout and reporting, and the plain methods both
APIs spell alike, written once: ``lock_wait`` (the sync one waits, the async one returns
an awaitable) and ``locked`` (each API's driver wraps the call). The classes below are
one call each, checked before anything is sent: ``Request`` (lock, lock_wait),
``Taking`` (lock_many), ``Extending`` (extend_many), ``Releasing`` (unlock_many). The
drivers in hotlock._cache and hotlock.aio._cache only send what these hold and hand them
the replies; what must stay two (a def and an async def, the sync lock()'s hot path)
keeps one parameter list, the sync one's, which hotlock._twin gives the async twin (and
CacheBase.lock_wait's to the module-level lock_wait); tests/unit/test_twins.py holds them
to it.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from typing import TYPE_CHECKING, Any, Final, Generic, TypeVar

from ._decorate import Locking
from ._ident import new_tokens
from ._keys import COUNT_SPACE, LOCK_SPACE, ONCE_SPACE, stored
from ._lock import TAKEN, Lease, shown
from ._scripts import KIND_CONFLICT
from ._twin import forwards
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
from .errors import LockNotAcquired

if TYPE_CHECKING:
    from .backends import Named

__all__ = ["ONCE", "CacheBase", "Extending", "Releasing", "Request", "Taking", "lock_wait"]

L = TypeVar("L", bound=Lease)
# What lock_wait() returns: a Lock (sync), or an awaitable hotlock.aio.Acquiring.
Waited = TypeVar("Waited")
# What locked() returns: the decorator of plain functions (sync), or of coroutine functions.
Decorator = TypeVar("Decorator")

# lock()'s "wait": one attempt, so there is no wait to check.
ONCE: Final[Any] = object()


class Request:
    """One lock() or lock_wait() call's arguments, checked in the order the signature
    gives them, before anything is sent."""

    __slots__ = ("auto", "hold_ms", "key", "limit", "name", "ttl_ms", "wait_ms")

    def __init__(
        self,
        prefix: bytes,
        key: str | bytes,
        ttl: Seconds,
        wait: Seconds,
        auto_extend: bool,
        max_hold: Seconds | None,
        limit: int,
    ) -> None:
        self.key = key
        self.name = stored(prefix, key_bytes(key))
        self.ttl_ms = ms = ttl_ms(ttl)
        # None for a lock(): it tries once and waits for nothing.
        self.wait_ms: int | None = None if wait is ONCE else wait_ms(wait)
        self.hold_ms = auto_extend_ms(auto_extend, max_hold, ms)
        self.auto = auto_extend
        self.limit = limit_int(limit)


class Taking:
    """One lock_many() call: the keys checked and laid out, their tokens, and the leases
    made of the replies."""

    __slots__ = ("given", "hold_ms", "names", "tokens", "ttl_ms")

    def __init__(
        self, prefix: bytes, keys: Iterable[str | bytes], ttl: Seconds, auto_extend: bool, max_hold: Seconds | None
    ) -> None:
        self.given, raw = key_list(keys)
        self.names = [stored(prefix, k) for k in raw]
        self.ttl_ms = ms = ttl_ms(ttl)
        self.hold_ms = auto_extend_ms(auto_extend, max_hold, ms)
        self.tokens = new_tokens(len(self.names)) if self.names else []

    def leases(self, results: list[int], sent: float, lease: Callable[..., L]) -> list[L | None]:
        """A lease per key whose acquire returned a fence, else None. ``lease(key, name,
        token, fence, ttl_ms, sent)`` makes one."""
        ms = self.ttl_ms
        return [
            lease(key, name, token, result, ms, sent) if result > 0 else None
            for key, name, token, result in zip(self.given, self.names, self.tokens, results, strict=True)
        ]


class Extending(Generic[L]):
    """One extend_many() call: the TTL, the locks worth sending for, and each lock's outcome."""

    __slots__ = ("live", "ms", "names", "out", "tokens")

    def __init__(self, given: tuple[list[L | None], list[tuple[int, L]]], ttl: Seconds) -> None:
        items, self.live = given
        self.ms = ttl_ms(ttl)
        # False for every lock nothing is sent for (None, released, inherited).
        self.out = [False] * len(items)
        self.names = [lk._name for _, lk in self.live]
        self.tokens = [lk._token for _, lk in self.live]

    def done(self, results: list[bool], sent: float, why: Mapping[int, str] | None = None) -> list[bool]:
        """Record each extend's outcome on its lease (``why``: the reason, by index, a lease
        whose extend too few replicas confirmed is lost); the call's result."""
        for j, ((i, lock), ok) in enumerate(zip(self.live, results, strict=True)):
            lock._extended(ok, self.ms, sent, TAKEN if why is None else why.get(j, TAKEN))
            if lock._auto is not None:
                lock._auto.touch()
            self.out[i] = ok
        return self.out


class Releasing(Generic[L]):
    """One unlock_many() call: the locks worth sending for, each told it is released."""

    __slots__ = ("live", "names", "out", "tokens")

    def __init__(self, given: tuple[list[L | None], list[tuple[int, L]]]) -> None:
        items, self.live = given
        self.out = [False] * len(items)
        for _, lock in self.live:
            if lock._auto is not None:
                lock._auto.forget()  # before the release, as in Lock.unlock
        self.names = [lk._name for _, lk in self.live]
        self.tokens = [lk._token for _, lk in self.live]

    def gone(self) -> None:
        """Nothing more is sent for these leases (the release was sent, or handed on)."""
        for _, lock in self.live:
            lock._token = b""

    def done(self, results: list[bool]) -> list[bool]:
        for (i, lock), ok in zip(self.live, results, strict=True):
            lock._token = b""
            self.out[i] = ok
        return self.out


class CacheBase(Generic[L, Waited, Decorator]):
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

    def lock_wait(
        self,
        key: str | bytes,
        ttl: Seconds = DEFAULT_TTL,
        wait: Seconds = 10.0,
        *,
        auto_extend: bool = False,
        max_hold: Seconds | None = None,
        limit: int = 1,
    ) -> Waited:
        """Poll with jittered backoff until acquired; LockNotAcquired once ``wait`` has passed.

        Never sleeps past the deadline nor past the holder's remaining TTL; ``wait=0`` is
        exactly one attempt. ``auto_extend``, ``max_hold`` and ``limit`` as for lock(); a
        release of a permit wakes a waiter as a plain lock's release does.

        A hotlock.Cache returns the Lock; a hotlock.aio.AsyncCache returns an Acquiring at
        once, as its lock() does: await it for the AsyncLock, or use it with ``async with``.
        """
        return self._waiting(Request(self._lock_prefix, key, ttl, wait, auto_extend, max_hold, limit))

    def _waiting(self, request: Request) -> Waited:
        """lock_wait()'s driver: the sync Cache's waits, the async one's returns an awaitable."""
        raise NotImplementedError

    def locked(
        self,
        template: str,
        ttl: Seconds = DEFAULT_TTL,
        *,
        wait: Seconds | None = None,
        limit: int = 1,
        auto_extend: bool = False,
        max_hold: Seconds | None = None,
    ) -> Decorator:
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

        A hotlock.aio.AsyncCache decorates coroutine functions (``async def export``): each
        call holds the lock while it is awaited; a cancelled call releases the lock and
        re-raises CancelledError; with ``auto_extend=True`` a loss cancels the call and
        raises LockLost.

        Everything but the key is checked here, before any call: a template field that
        names no parameter, a positional field (``{}``, ``{0}``), a generator or async
        generator function, a function of the other kind (a coroutine function on a Cache:
        use hotlock.aio.AsyncCache.locked; a plain one on an AsyncCache: use
        hotlock.Cache.locked), a bad ttl, wait, limit, auto_extend or max_hold raise
        TypeError/ValueError. Put ``@staticmethod`` or ``@classmethod`` above it (``cls`` is
        then an argument). The wrapper keeps the function's name, docstring and signature
        (functools.wraps).
        """
        return self._decorator(Locking(template, ttl, wait, limit, auto_extend, max_hold))

    def _decorator(self, locking: Locking) -> Decorator:
        """locked()'s driver: the decorator that takes the lock around each call."""
        raise NotImplementedError

    def _taking(self, keys: Iterable[str | bytes], ttl: Seconds, auto_extend: bool, max_hold: Seconds | None) -> Taking:
        return Taking(self._lock_prefix, keys, ttl, auto_extend, max_hold)

    def _once(self, key: str | bytes, value: str | bytes | int, ttl: Seconds) -> tuple[bytes, bytes, int]:
        """set_nx()'s arguments checked: the stored key, the value and the TTL in ms."""
        return stored(self._once_prefix, key_bytes(key)), value_bytes(value), ttl_ms(ttl)

    def _counter(self, key: str | bytes, amount: int) -> tuple[bytes, int]:
        """incr()'s arguments checked: the stored key and the amount."""
        return stored(self._count_prefix, key_bytes(key)), amount_int(amount)

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


@forwards(CacheBase.lock_wait)
def lock_wait(cache: CacheBase[Any, Waited, Any], **given: Any) -> Waited:
    """``cache.lock_wait(key, ttl, wait, auto_extend=..., max_hold=..., limit=...)``, for a
    hotlock.Cache (the Lock) or a hotlock.aio.AsyncCache (an Acquiring: await it, or use it
    with ``async with``)."""
    return cache.lock_wait(**given)
