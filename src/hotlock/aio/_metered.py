"""The async twin of hotlock._metered: an AsyncCache that reports to a metrics listener."""

from __future__ import annotations

import asyncio
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

from .._core import Request
from .._metered import Batch, Meter, as_list
from ..errors import CacheError, LockNotAcquired
from ._cache import AsyncCache
from ._lock import AsyncLock

if TYPE_CHECKING:
    from ..backends import AsyncBackend
    from ..metrics import Listener

__all__ = ["MeteredAsyncCache"]


class MeteredAsyncCache(AsyncCache):
    """An AsyncCache that reports to a listener (see hotlock.metrics). Times are on the
    event loop's clock, as the lease's deadline is."""

    __slots__ = ("_meter",)

    def __init__(self, backend: AsyncBackend, prefix: bytes, listener: Listener, reply_timeout: float = 2.0) -> None:
        super().__init__(backend, prefix, reply_timeout)
        self._meter = Meter(listener)

    async def _acquire(self, request: Request, tries: list[int] | None = None) -> AsyncLock:
        # lock() and lock_wait() both end here; wait_ms is None for a try-once acquire.
        # The signature is the parent's own, so mypy flags this override if that one changes.
        meter = self._meter
        loop = asyncio.get_running_loop()
        # A lock_wait's attempts are counted in the parent's loop (no list for a lock()).
        key, waits = request.key, request.wait_ms is not None
        counted: list[int] | None = [] if waits else None
        started = loop.time()
        try:
            lock = await super()._acquire(request, counted)
        except LockNotAcquired:
            if counted:
                meter.timed_out(key, loop.time() - started, counted[0])
            else:
                meter.not_acquired(key, "timeout" if waits else "held", loop.time() - started)
            raise
        except CacheError as error:
            meter.error(key, "acquire", error)
            raise
        if counted is None:
            meter.took(lock, loop.time() - started, 1)
        else:
            meter.waited(lock, loop.time() - started, counted[0])
        return lock

    async def lock_many(self, keys: Iterable[str | bytes], *args: Any, **kwargs: Any) -> list[AsyncLock | None]:
        meter = self._meter
        given = as_list(keys)
        loop = asyncio.get_running_loop()
        started = loop.time()
        try:
            locks = await super().lock_many(given, *args, **kwargs)
        except CacheError as error:
            for key in given:
                meter.error(key, "acquire", error)
            raise
        meter.took_many(given, locks, loop.time() - started)
        return locks

    async def extend_many(self, locks: Iterable[AsyncLock | None], *args: Any, **kwargs: Any) -> list[bool]:
        batch = Batch(locks, "extend")
        try:
            results = await super().extend_many(batch.items, *args, **kwargs)
        except CacheError as error:
            batch.failed(error)
            raise
        batch.done(results)
        return results

    async def unlock_many(self, locks: Iterable[AsyncLock | None]) -> list[bool]:
        batch = Batch(locks, "release")
        try:
            results = await super().unlock_many(batch.items)
        except CacheError as error:
            batch.failed(error)
            raise
        batch.done(results)
        return results
