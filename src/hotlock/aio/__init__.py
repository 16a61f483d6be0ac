"""hotlock.aio: the asyncio API, the sync API's twin with coroutines.

    cache = await hotlock.aio.connect()                        # CACHE_URL, else in-process
    async with cache.lock("settle:invoice-1", ttl=60):         # try once; LockNotAcquired if held
        ...
    lock = await cache.lock_wait("import:tenant-1", ttl=60, wait=2.0)
    await lock.unlock()

Runs on asyncio and on uvloop alike. A cache belongs to the event loop it was connected in.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any, ParamSpec, TypeVar

from .. import connect as sync_connect
from .._connect import connect_arguments, in_process, open_async_detected
from .._core import lock_wait
from .._lazy import AsyncLazyBackend
from .._twin import takes
from .._validate import Seconds
from ..backends.memory_async import AsyncMemoryBackend
from ..backends.native import native_aio
from ._cache import Acquiring, AsyncCache
from ._lock import AsyncLock
from ._metered import MeteredAsyncCache

if TYPE_CHECKING:
    from ..backends import AsyncBackend
    from ..metrics import Listener

__all__ = ["Acquiring", "AsyncCache", "AsyncLock", "backend_info", "connect", "lock_wait", "with_lock"]

P = ParamSpec("P")
R = TypeVar("R")


@takes(sync_connect)
async def connect(**given: Any) -> AsyncCache:
    """Connect to Redis at ``url`` (else ``CACHE_URL``), or fall back to an in-process cache.

    hotlock.connect()'s arguments, checks and log lines (see its docstring). ``backend``
    forces "native" (the Cython asyncio protocol) or "redis-py" (redis.asyncio); ``scripts``
    chooses between the Lua-free extend/release, where the server has them, and the scripts;
    ``fences=False`` makes every lock's fence 0 and takes a free key with ``SET NX PX`` alone.
    ``metrics`` takes the same listener as hotlock.connect() (see hotlock.metrics).
    ``credential_provider`` and ``reauth_interval`` as there; a provider with its own
    ``get_credentials_async()`` (redis-entraid's) is awaited instead.

    ``lazy=True`` sends nothing here: the first awaited call connects, in the event loop it
    runs in (the cache then belongs to that loop), so a module can make its cache at import,
    before any loop runs (``await`` it there anyway; it returns at once). A failure to connect
    is that call's CacheError; the next call tries again.
    """
    # Checked in one place for both APIs.
    raw_prefix, config, listener = connect_arguments(**given)
    backend, scripts, fences = given["backend"], given["scripts"], given["fences"]
    if config is None:
        return _cache(in_process(AsyncMemoryBackend(), scripts, fences), raw_prefix, listener, given["timeout"])
    if given["lazy"]:
        return _cache(AsyncLazyBackend(config, backend, scripts, fences), raw_prefix, listener, config.timeout)
    return _cache(await open_async_detected(config, backend, scripts, fences), raw_prefix, listener, config.timeout)


def _cache(backend: AsyncBackend, prefix: bytes, listener: Listener | None, timeout: float) -> AsyncCache:
    # A plain AsyncCache without a listener: the metered one only exists when asked for.
    if listener is None:
        return AsyncCache(backend, prefix, timeout)
    return MeteredAsyncCache(backend, prefix, listener, timeout)


def backend_info() -> dict[str, str | None]:
    """Which backend hotlock.aio.connect() would use for a redis:// url, and why, when it is
    not native; the same for a rediss:// url; and the hiredis and OpenSSL the native client
    runs on. The keys of hotlock.backend_info():

    ``{"backend": "native" | "redis-py", "reason": None | str, "hiredis": version | None,
    "tls": "native" | "redis-py", "tls_reason": None | str, "openssl": version | None}``
    """
    import ssl  # here: importing hotlock.aio must not load OpenSSL

    native, why = native_aio()
    backend = "redis-py" if native is None else "native"
    return {
        "backend": backend,
        "reason": why,
        "hiredis": None if native is None else native.HIREDIS_VERSION,
        # rediss:// urls: the event loop's transport does TLS (Python's ssl module), so they
        # run on the same backend as redis:// urls, the native one included.
        "tls": backend,
        "tls_reason": why,
        "openssl": None if native is None else ssl.OPENSSL_VERSION,
    }


async def with_lock(
    cache: AsyncCache, key: str | bytes, ttl: Seconds, fn: Callable[P, Awaitable[R]], *args: P.args, **kwargs: P.kwargs
) -> R:
    """``await cache.with_lock(key, ttl, fn, *args, **kwargs)``."""
    return await cache.with_lock(key, ttl, fn, *args, **kwargs)
