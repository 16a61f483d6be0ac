"""connect(lazy=True): a backend that opens the real one on its first call.

A framework imports its settings (and so makes its cache) before the network may be up,
and a pre-forking server imports in the parent: a lazy cache sends nothing until the first
call that needs the server. That call opens the backend exactly as connect() would (the
dialect detected, the log lines written); a failure is the CacheError that call raises,
and the next call tries again. After that every call goes straight to the opened backend
(its bound methods replace the forwarding ones on the instance).
"""

from __future__ import annotations

import asyncio
import threading
from typing import TYPE_CHECKING, Any, Generic, TypeVar

from ._connect import choose, open_async_detected, open_detected
from ._dialect import UNDETECTED, Dialect

if TYPE_CHECKING:
    from ._config import ServerConfig
    from .backends import AsyncBackend, Backend, Named

__all__ = ["AsyncLazyBackend", "LazyBackend", "Unopened"]

B = TypeVar("B", bound="Named")

# The operations that need the server: forwarded until the backend is open, then replaced
# by the opened backend's own bound methods.
_SYNC_OPS = (
    "acquire",
    "acquire_wait",
    "acquire_many",
    "extend",
    "extend_many",
    "release",
    "release_many",
    "set_nx",
    "incr",
    "info",
    "command_info",
)


def _retrieved(future: asyncio.Future[Any]) -> None:
    if not future.cancelled():
        future.exception()


class Unopened(Generic[B]):
    """What LazyBackend and AsyncLazyBackend share: connect()'s arguments kept for the open,
    and what the backend tells about itself before it is open."""

    _aio = False

    def __init__(self, config: ServerConfig, requested: str | None, scripts: str, fences: bool) -> None:
        self._config = config
        self._requested = requested
        self._scripts = scripts
        self._fences = fences
        # What the opened backend will be: choose() reads no network, only what was built.
        self.name, _ = choose(config, requested, aio=self._aio)
        self.server = config.display
        self._opened: B | None = None

    @property
    def dialect(self) -> Dialect:
        return UNDETECTED if self._opened is None else self._opened.dialect

    @property
    def fenced(self) -> bool:
        return self._fences


class LazyBackend(Unopened["Backend"]):
    """A Backend that is opened by its first call (see the module's docstring)."""

    def __init__(self, config: ServerConfig, requested: str | None, scripts: str, fences: bool) -> None:
        super().__init__(config, requested, scripts, fences)
        self._opening = threading.Lock()
        self._closed = False

    def _open(self) -> Backend:
        with self._opening:  # one connect for the threads that arrive together
            if self._opened is None:
                opened = open_detected(self._config, self._requested, self._scripts, self._fences)
                for op in _SYNC_OPS:
                    setattr(self, op, getattr(opened, op))
                self._opened = opened
            return self._opened

    def acquire(self, key: bytes, token: bytes, ttl_ms: int) -> int:
        return self._open().acquire(key, token, ttl_ms)

    def acquire_wait(self, key: bytes, token: bytes, ttl_ms: int, wait_ms: int) -> tuple[int, float, int]:
        return self._open().acquire_wait(key, token, ttl_ms, wait_ms)

    def acquire_many(self, keys: list[bytes], tokens: list[bytes], ttl_ms: int) -> list[int]:
        return self._open().acquire_many(keys, tokens, ttl_ms)

    def extend(self, key: bytes, token: bytes, ttl_ms: int) -> bool:
        return self._open().extend(key, token, ttl_ms)

    def extend_many(self, keys: list[bytes], tokens: list[bytes], ttl_ms: int) -> list[bool]:
        return self._open().extend_many(keys, tokens, ttl_ms)

    def release(self, key: bytes, token: bytes) -> bool:
        return self._open().release(key, token)

    def release_many(self, keys: list[bytes], tokens: list[bytes]) -> list[bool]:
        return self._open().release_many(keys, tokens)

    def set_nx(self, key: bytes, value: bytes, ttl_ms: int) -> bool:
        return self._open().set_nx(key, value, ttl_ms)

    def incr(self, key: bytes, amount: int) -> int:
        return self._open().incr(key, amount)

    def info(self) -> dict[str, str] | None:
        return self._open().info()

    def command_info(self) -> list[object] | None:
        return self._open().command_info()

    def use_dialect(self, dialect: Dialect) -> None:
        self._open().use_dialect(dialect)

    def close(self) -> None:
        # Closing a cache that never connected sends nothing; a later call reconnects, as
        # every backend does after close().
        with self._opening:
            opened, self._opened = self._opened, None
            for op in _SYNC_OPS:
                self.__dict__.pop(op, None)
        if opened is not None:
            opened.close()

    def __repr__(self) -> str:
        state = "open" if self._opened is not None else "not connected yet"
        return f"<hotlock lazy {self.name} backend server={self.server} ({state})>"


class AsyncLazyBackend(Unopened["AsyncBackend"]):
    """LazyBackend's async twin: the first awaited call opens the backend, in the event loop
    it runs in (an async cache belongs to one loop, as a connected one does)."""

    _aio = True

    def __init__(self, config: ServerConfig, requested: str | None, scripts: str, fences: bool) -> None:
        super().__init__(config, requested, scripts, fences)
        # The open in progress: callers that arrive while it runs await the same one.
        self._opening: asyncio.Future[AsyncBackend] | None = None

    @property
    def wake_slot(self) -> Any:
        # The wake-up subscriber is the opened backend's; before the first call a lock_wait
        # polls with backoff alone, as with wakeups=False.
        return None if self._opened is None else getattr(self._opened, "wake_slot", None)

    async def _open(self) -> AsyncBackend:
        if self._opened is not None:
            return self._opened
        if self._opening is None:
            self._opening = asyncio.ensure_future(
                open_async_detected(self._config, self._requested, self._scripts, self._fences)
            )
            # Its failure is read by whoever awaits it; if all of them were cancelled, here,
            # so asyncio never logs it as "never retrieved".
            self._opening.add_done_callback(_retrieved)
        opening = self._opening
        try:
            # shield: a caller cancelled while the connect runs must not cancel it for the
            # others awaiting the same one.
            opened = await asyncio.shield(opening)
        except BaseException:
            if opening.done() and self._opening is opening:
                self._opening = None  # failed: the next call tries again
            raise
        self._opened = opened
        return opened

    async def acquire(self, key: bytes, token: bytes, ttl_ms: int, *args: Any) -> int:
        return await (await self._open()).acquire(key, token, ttl_ms, *args)

    async def acquire_many(self, keys: list[bytes], tokens: list[bytes], ttl_ms: int) -> list[int]:
        return await (await self._open()).acquire_many(keys, tokens, ttl_ms)

    async def extend(self, key: bytes, token: bytes, ttl_ms: int) -> bool:
        return await (await self._open()).extend(key, token, ttl_ms)

    async def extend_many(self, keys: list[bytes], tokens: list[bytes], ttl_ms: int) -> list[bool]:
        return await (await self._open()).extend_many(keys, tokens, ttl_ms)

    async def release(self, key: bytes, token: bytes) -> bool:
        return await (await self._open()).release(key, token)

    async def release_many(self, keys: list[bytes], tokens: list[bytes]) -> list[bool]:
        return await (await self._open()).release_many(keys, tokens)

    async def set_nx(self, key: bytes, value: bytes, ttl_ms: int) -> bool:
        return await (await self._open()).set_nx(key, value, ttl_ms)

    async def incr(self, key: bytes, amount: int) -> int:
        return await (await self._open()).incr(key, amount)

    async def info(self) -> dict[str, str] | None:
        return await (await self._open()).info()

    async def command_info(self) -> list[object] | None:
        return await (await self._open()).command_info()

    def use_dialect(self, dialect: Dialect) -> None:
        if self._opened is not None:
            self._opened.use_dialect(dialect)

    async def close(self) -> None:
        opened, self._opened = self._opened, None
        opening, self._opening = self._opening, None
        if opened is None and opening is not None:
            opening.cancel()  # and waited for, as NativeAsyncBackend.close does its connect
            await asyncio.wait({opening})
        if opened is not None:
            await opened.close()

    def __repr__(self) -> str:
        state = "open" if self._opened is not None else "not connected yet"
        return f"<hotlock lazy {self.name} async backend server={self.server} ({state})>"
