"""The backends: the one interface every backend speaks, sync (Backend) and async
(AsyncBackend), and the backends themselves as sibling modules.

A backend knows bytes keys (already prefixed), bytes tokens and integer milliseconds,
and nothing of the public API. It raises CacheError for every Redis failure; it never
reports a failure as contention.

    memory, memory_async       the in-process fallback
    redispy, redispy_async     redis-py and redis.asyncio (and their cluster links)
    native, native_async       the extension (hotlock._native) and its asyncio side
    cluster, cluster_async     a link per primary, routed by the slot map
    wakeup, wakeup_async       the wake-up subscriber the Redis backends share
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    from .._dialect import Dialect

__all__ = ["AsyncBackend", "Backend", "Named"]


class Named(Protocol):
    """What every backend, sync or async, tells about itself."""

    name: str  # "native", "redis-py" or "memory"
    server: str  # the server as shown in logs and errors, without credentials

    # The server's dialect (_dialect), set by connect() through use_dialect: what extend
    # and release send. Read-only here: cache.server_info shows it.
    @property
    def dialect(self) -> Dialect: ...

    # connect(fences=...), set with the dialect: False makes every lock's fence 0 (Lease).
    @property
    def fenced(self) -> bool: ...


class Backend(Named, Protocol):
    # acquire/acquire_many return the fence (> 0) when acquired, and otherwise (<= 0)
    # -(the holder's remaining TTL in ms), or 0 when it is unknown: the contract of
    # _scripts.ACQUIRE. The key then holds _scripts.held_value(token, fence), which is
    # the token extend/extend_many/release/release_many are given.
    def acquire(self, key: bytes, token: bytes, ttl_ms: int) -> int: ...

    # Polls acquire with the _backoff schedule until it succeeds or wait_ms has passed.
    # Returns the last acquire result, the time.monotonic() at which that attempt was
    # sent (the lease's TTL runs from then) and the number of attempts made (>= 1), which
    # a metrics listener is told.
    def acquire_wait(self, key: bytes, token: bytes, ttl_ms: int, wait_ms: int) -> tuple[int, float, int]: ...

    def acquire_many(self, keys: list[bytes], tokens: list[bytes], ttl_ms: int) -> list[int]: ...
    def extend(self, key: bytes, token: bytes, ttl_ms: int) -> bool: ...
    def extend_many(self, keys: list[bytes], tokens: list[bytes], ttl_ms: int) -> list[bool]: ...
    def release(self, key: bytes, token: bytes) -> bool: ...
    def release_many(self, keys: list[bytes], tokens: list[bytes]) -> list[bool]: ...
    def set_nx(self, key: bytes, value: bytes, ttl_ms: int) -> bool: ...
    def incr(self, key: bytes, amount: int) -> int: ...

    # The server's INFO fields, or None when an ACL refuses INFO.
    def info(self) -> dict[str, str] | None: ...

    # COMMAND INFO DELIFEQ DELEX (_dialect.COMMAND_PROBE): the raw reply, or None when the
    # server or its ACL refuses COMMAND. Then use_dialect(the detected dialect), once.
    def command_info(self) -> list[object] | None: ...
    def use_dialect(self, dialect: Dialect) -> None: ...
    def close(self) -> None: ...


class AsyncBackend(Protocol):
    name: str  # "native", "redis-py" or "memory", as in sync
    server: str  # the server as shown in logs and errors, without credentials

    # As in sync: the server's dialect, set once by connect() through use_dialect, and
    # connect(fences=...) with it.
    @property
    def dialect(self) -> Dialect: ...
    @property
    def fenced(self) -> bool: ...

    # The ordering promise that makes cancellation safe: a release of a token takes
    # effect after every acquire of that token already called on this backend, even one
    # whose caller was cancelled while it was in flight. AsyncCache relies on it to
    # release an interrupted acquisition in the background.

    # The fence (> 0) when acquired, else -(the holder's remaining TTL in ms) or 0 when
    # unknown: _scripts.ACQUIRE, as Backend.
    # ``since`` (loop time) and ``wait_ms`` are those of the lock_wait this attempt belongs
    # to: as in sync, a lost-reply retry ends by since + max(wait, timeout) + timeout, so
    # a lock_wait ends within max(wait, one reply timeout) plus one reply timeout (None and
    # 0 for an attempt of its own). ``script`` is ACQUIRE or one of its waiting forms (ACQUIRE_WAIT, ACQUIRE_CHAIN: the
    # same contract), chosen by AsyncCache's lock_wait loop; a backend with a ``wake_slot``
    # (wakeup_async.AsyncSlot, or None) takes part in wake-ups.
    async def acquire(
        self, key: bytes, token: bytes, ttl_ms: int, since: float | None, wait_ms: int, script: Any
    ) -> int: ...
    async def acquire_many(self, keys: list[bytes], tokens: list[bytes], ttl_ms: int) -> list[int]: ...
    async def extend(self, key: bytes, token: bytes, ttl_ms: int) -> bool: ...
    async def extend_many(self, keys: list[bytes], tokens: list[bytes], ttl_ms: int) -> list[bool]: ...
    async def release(self, key: bytes, token: bytes) -> bool: ...
    async def release_many(self, keys: list[bytes], tokens: list[bytes]) -> list[bool]: ...
    async def set_nx(self, key: bytes, value: bytes, ttl_ms: int) -> bool: ...
    async def incr(self, key: bytes, amount: int) -> int: ...

    # The server's INFO fields, or None when an ACL refuses INFO.
    async def info(self) -> dict[str, str] | None: ...
    async def command_info(self) -> list[object] | None: ...
    def use_dialect(self, dialect: Dialect) -> None: ...
    async def close(self) -> None: ...
