"""The interface every async backend speaks, and the one place an async backend is chosen.

The async twin of ``hotlock._backend.Backend``: bytes keys (already prefixed), bytes
tokens, integer milliseconds, CacheError for every Redis failure. There is no
``acquire_wait``: the polling loop lives once, in AsyncCache, sleeping with asyncio.sleep.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from types import ModuleType
from typing import Any, Protocol

from .._backend import native_module
from .._config import ServerConfig
from .._dialect import Dialect

__all__ = ["AsyncBackend", "choose", "native_aio", "open_backend"]


class AsyncBackend(Protocol):
    name: str  # "native", "redis-py" or "memory", as in sync
    server: str  # the server as shown in logs and errors, without credentials

    # As in sync: the server's dialect, set once by connect() through use_dialect.
    @property
    def dialect(self) -> Dialect: ...

    # The ordering promise that makes cancellation safe: a release of a token takes
    # effect after every acquire of that token already called on this backend, even one
    # whose caller was cancelled while it was in flight. AsyncCache relies on it to
    # release an interrupted acquisition in the background.

    # The fence (> 0) when acquired, else -(the holder's remaining TTL in ms) or 0 when
    # unknown: _scripts.ACQUIRE, as hotlock._backend.Backend.
    # ``since`` (loop time) and ``wait_ms`` are those of the lock_wait this attempt belongs
    # to: as in sync, a lost-reply retry ends by since + max(wait, timeout) + timeout, so
    # a lock_wait ends within max(wait, one reply timeout) plus one reply timeout.
    # ``script`` is ACQUIRE or one of its waiting forms (ACQUIRE_WAIT, ACQUIRE_CHAIN: the
    # same contract), chosen by AsyncCache's lock_wait loop; a backend with a ``wake_slot``
    # (hotlock.aio._wakeup.AsyncSlot, or None) takes part in wake-ups.
    async def acquire(
        self, key: bytes, token: bytes, ttl_ms: int, since: float | None = None, wait_ms: int = 0, script: Any = ...
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


def native_aio() -> tuple[ModuleType | None, str | None]:
    """The extension when it carries the asyncio protocol, else None and why not."""
    native, why = native_module()
    if native is None:
        return None, why
    if not hasattr(native, "AioProtocol"):
        return None, "the extension was built without its asyncio protocol (ext/_aio.pxi)"
    return native, None


def choose(config: ServerConfig, requested: str | None) -> tuple[str, str | None]:
    """The async backend to open for ``config`` and, when it is not native, why.

    Unlike the sync native client, the async one needs no TLS from hiredis: the event
    loop's transport does TLS, so rediss:// stays native.
    """
    if requested == "redis-py":
        return "redis-py", "asked for by connect(backend='redis-py')"
    native, why = native_aio()
    if native is None:
        if requested == "native":
            raise ValueError(f"backend='native' is not available: {why}")
        return "redis-py", why
    return "native", None


async def open_backend(config: ServerConfig, requested: str | None) -> tuple[AsyncBackend, str | None]:
    name, why = choose(config, requested)
    backend: AsyncBackend
    if config.seeds:
        # A cluster: the same transports, one link per primary, routed by hotlock._cluster.
        from ._cluster import AsyncClusterBackend, AsyncLink

        opener: Callable[[ServerConfig], Awaitable[AsyncLink]]
        if name == "native":
            from ._native import NativeAsyncBackend

            native, _ = native_aio()
            assert native is not None
            protocol = native.AioProtocol

            async def opener(node: ServerConfig) -> AsyncLink:
                return await NativeAsyncBackend.open(node, protocol)

            # The node table in C: a healthy call goes straight to its node's connection.
            return await AsyncClusterBackend.open(config, name, opener, native.ClusterRouter), why
        from ._redispy import RedisAsyncLink

        return await AsyncClusterBackend.open(config, name, RedisAsyncLink.open), why
    if name == "native":
        from ._native import NativeAsyncBackend

        native, _ = native_aio()
        assert native is not None
        backend = await NativeAsyncBackend.open(config, native.AioProtocol)
    else:
        from ._redispy import RedisAsyncBackend  # lazily: the native path never pays for `import redis`

        backend = await RedisAsyncBackend.open(config)
    return backend, why
