"""hotlock.aio: the asyncio API, the sync API's twin with coroutines.

    cache = await hotlock.aio.connect()                        # CACHE_URL, else in-process
    async with cache.lock("settle:invoice-1", ttl=60):         # try once; LockNotAcquired if held
        ...
    lock = await cache.lock_wait("import:tenant-1", ttl=60, wait=2.0)
    await lock.unlock()

Runs on asyncio and on uvloop alike. A cache belongs to the event loop it was connected in.
"""

from __future__ import annotations

import math
import os
from collections.abc import Awaitable, Callable
from typing import ParamSpec, TypeVar

from .. import _log_server, _prefix_bytes, log
from .._backend import BACKEND_NAMES, parse_url
from .._validate import DEFAULT_TTL, Seconds
from ._backend import native_aio, open_backend
from ._cache import Acquiring, AsyncCache
from ._lock import AsyncLock
from ._memory import AsyncMemoryBackend

__all__ = ["Acquiring", "AsyncCache", "AsyncLock", "backend_info", "connect", "lock_wait", "with_lock"]

P = ParamSpec("P")
R = TypeVar("R")


async def connect(
    url: str | None = None,
    *,
    prefix: str | bytes = "hotlock:",
    connect_timeout: float = 2.0,
    timeout: float = 2.0,
    backend: str | None = None,
) -> AsyncCache:
    """Connect to Redis at ``url`` (else ``CACHE_URL``), or fall back to an in-process cache.

    The arguments, their checks and the log lines are hotlock.connect()'s. ``backend``
    forces "native" (the Cython asyncio protocol) or "redis-py" (redis.asyncio).
    """
    raw_prefix = _prefix_bytes(prefix)
    # hotlock.connect()'s checks, in its order and words (they live inline there).
    for name, value in (("connect_timeout", connect_timeout), ("timeout", timeout)):
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise TypeError(f"{name} must be seconds (int or float), not {type(value).__name__}")
        if not (math.isfinite(value) and value > 0):
            raise ValueError(f"{name} must be a positive number of seconds, not {value!r}")
    if backend is not None and backend not in BACKEND_NAMES:
        raise ValueError(f"backend must be one of {', '.join(BACKEND_NAMES)} or None, not {backend!r}")
    if url is None:
        url = os.environ.get("CACHE_URL") or None
    if url is None:
        if backend is not None:
            raise ValueError(f"backend={backend!r} needs a url or CACHE_URL")
        log.warning("no cache configured: locks exclude nothing outside this process")
        return AsyncCache(AsyncMemoryBackend(), raw_prefix)
    config = parse_url(url, connect_timeout=float(connect_timeout), timeout=float(timeout))
    opened, why = await open_backend(config, backend)
    try:
        _log_server(await opened.info(), opened.name, opened.server, why)
    except BaseException:
        await opened.close()
        raise
    return AsyncCache(opened, raw_prefix)


def backend_info() -> dict[str, str | None]:
    """Which backend hotlock.aio.connect() would use for a redis:// url, and why, when it is
    not native: ``{"backend": "native" | "redis-py", "reason": None | str, "hiredis": version | None}``.
    """
    native, why = native_aio()
    return {
        "backend": "redis-py" if native is None else "native",
        "reason": why,
        "hiredis": None if native is None else native.HIREDIS_VERSION,
    }


async def with_lock(
    cache: AsyncCache, key: str | bytes, ttl: Seconds, fn: Callable[P, Awaitable[R]], *args: P.args, **kwargs: P.kwargs
) -> R:
    """``await cache.with_lock(key, ttl, fn, *args, **kwargs)``."""
    return await cache.with_lock(key, ttl, fn, *args, **kwargs)


def lock_wait(cache: AsyncCache, key: str | bytes, ttl: Seconds = DEFAULT_TTL, wait: Seconds = 10.0) -> Acquiring:
    """``cache.lock_wait(key, ttl, wait)``: await it, or use it with ``async with``."""
    return cache.lock_wait(key, ttl, wait)
