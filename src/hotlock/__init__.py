"""hotlock: fast Redis locks that survive a crashed holder.

cache = hotlock.connect()                      # CACHE_URL, else in-process
with cache.lock("settle:invoice-1", ttl=60):   # try once; LockNotAcquired if held
    ...
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, ParamSpec, TypeVar

from ._cache import Cache
from ._connect import connect_arguments, in_process, open_detected
from ._core import lock_wait
from ._fastpath import MeteredNativeCache, NativeCache
from ._lazy import LazyBackend
from ._lock import Lock
from ._metered import MeteredCache
from ._validate import Seconds
from .backends.memory import MemoryBackend
from .backends.native import backend_info
from .errors import CacheError, HotlockError, LockLost, LockNotAcquired

if TYPE_CHECKING:
    from ._credentials import CredentialProvider
    from .backends import Backend
    from .metrics import Listener

__all__ = [
    "Cache",
    "CacheError",
    "HotlockError",
    "Lock",
    "LockLost",
    "LockNotAcquired",
    "backend_info",
    "connect",
    "lock_wait",
    "with_lock",
]


if TYPE_CHECKING:
    __version__: str
else:

    def __getattr__(name: str) -> str:
        # The version is written once, in pyproject.toml, and read back from the installed
        # metadata on first use: importlib.metadata would cost `import hotlock` about as much
        # as hotlock itself. (Hidden from type checkers, which would otherwise take every
        # misspelt hotlock.name for a str.)
        if name == "__version__":
            from importlib.metadata import PackageNotFoundError, version

            try:
                return version("hotlock")
            except PackageNotFoundError:
                raise AttributeError("hotlock.__version__: hotlock is not installed (pip install -e .)") from None
        raise AttributeError(f"module 'hotlock' has no attribute {name!r}")


P = ParamSpec("P")
R = TypeVar("R")

log = logging.getLogger("hotlock")


def connect(
    url: str | None = None,
    *,
    prefix: str | bytes = "hotlock:",
    connect_timeout: float = 2.0,
    timeout: float = 2.0,
    backend: str | None = None,
    wait_replicas: int = 0,
    wait_timeout: float | None = None,
    scripts: str = "auto",
    fences: bool = True,
    metrics: Listener | Sequence[Listener] | None = None,
    wakeups: bool = True,
    lazy: bool = False,
    credential_provider: CredentialProvider | None = None,
    reauth_interval: float | None = None,
) -> Cache:
    """Connect to Redis at ``url`` (else ``CACHE_URL``), or fall back to an in-process cache.

    ``timeout`` bounds every reply, ``connect_timeout`` every connect, in seconds.
    ``backend`` forces "native" or "redis-py"; by default the native extension is used
    whenever it is built. A configured but unreachable server raises CacheError: the
    in-process fallback is chosen only when no URL is configured at all.

    ``url`` may name a Sentinel-managed primary, ``redis+sentinel://h1:26379,h2:26379/mymaster[/db]``:
    the primary is looked up at each (re)connect, so the cache follows a failover.
    ``wait_replicas=N`` makes each acquire wait (``WAIT``, in the same round trip) until N
    replicas have the lock, up to ``wait_timeout`` seconds (default: half of ``timeout``);
    if fewer confirm, the acquire is undone and raises CacheError. Every extend (by hand or
    by the renewer) waits the same way; one that fewer replicas confirm is a lost lease (LockLost,
    ``lock.lost``), its key released. It narrows, not closes, the two-holder window of a
    failover.

    ``scripts="auto"`` takes a free key without Lua (``SET NX PX`` and ``TIME`` in one
    ``MULTI``/``EXEC``) and sends extend and release without Lua where the server compares
    and sets itself (Valkey 9: ``SET … IFEQ``, ``DELIFEQ``; Redis 8.4+: ``SET … IFEQ``,
    ``DELEX … IFEQ``), detected once here; ``scripts="always"`` keeps them all on the scripts.
    ``cache.server_info`` tells which server was found and which path is in use.

    ``fences=False`` gives every lock the fence 0 and takes a free key with ``SET NX PX``
    alone (no ``MULTI``, ``TIME``, ``EXEC``): for locks whose work no store checks by fence,
    at the server's lowest cost (docs/fencing.md).

    ``metrics`` takes a listener (see hotlock.metrics, e.g. hotlock.metrics.PrometheusMetrics())
    told of every acquisition, release, extension, loss and error, or a list of listeners
    (each told of every event, e.g. Prometheus and hotlock.otel); without one, nothing is paid.

    ``wakeups=True`` lets a release wake the lock_wait callers waiting for its key (a
    PUBLISH on ``<prefix>wake:{key}``, sent only when someone waits; one subscriber
    connection per cache); ``wakeups=False`` keeps lock_wait on its backoff polling alone.

    ``lazy=True`` checks the arguments and the URL but sends nothing: the first call that
    needs the server connects (and a failure then is a CacheError, as any later one is;
    the next call tries again). For a framework that imports its settings before the
    network is up, or a process that forks workers after import. A lazy cache uses the
    plain Python lock path (not the native one-call fast path) and logs its connect line
    at the first call; ``cache.server_info`` reads "not detected" until then.

    ``credential_provider`` takes an object whose ``get_credentials()`` returns
    ``(username, password)`` or ``(password,)`` (redis-py's ``CredentialProvider``; its
    providers and redis-entraid's work as they are), asked at every new connection instead
    of the url's credentials, so rotating tokens (cloud IAM, Entra ID) need no restart.
    ``reauth_interval=S`` also re-sends AUTH on live connections every S seconds, for tokens
    that end a connection when they expire. A NOAUTH or WRONGPASS reply asks the provider
    again and retries once; the provider's own failure is a CacheError naming it. See
    docs/managed.md.
    """
    # Its arguments by name, before any other local exists: checked in one place for both APIs.
    raw_prefix, config, listener = connect_arguments(**locals())
    if config is None:
        return _cache(in_process(MemoryBackend(), scripts, fences), raw_prefix, listener, timeout)
    if lazy:
        # No I/O now: the first call opens the backend (LazyBackend). The plain classes, not
        # the native one-call fast paths, which need the opened backend at construction.
        lazy_backend = LazyBackend(config, backend, scripts, fences)
        if listener is None:
            return Cache(lazy_backend, raw_prefix, config.timeout)
        return MeteredCache(lazy_backend, raw_prefix, listener, config.timeout)
    return _cache(open_detected(config, backend, scripts, fences), raw_prefix, listener, config.timeout)


def _cache(backend: Backend, prefix: bytes, listener: Listener | None, timeout: float) -> Cache:
    # A plain Cache without a listener: the metered one only exists when asked for. On the
    # native backend, the classes whose lock, unlock and extend are one extension call.
    native = backend.name == "native"
    if listener is None:
        return (NativeCache if native else Cache)(backend, prefix, timeout)
    return (MeteredNativeCache if native else MeteredCache)(backend, prefix, listener, timeout)


def with_lock(cache: Cache, key: str | bytes, ttl: Seconds, fn: Callable[P, R], *args: P.args, **kwargs: P.kwargs) -> R:
    """``cache.with_lock(key, ttl, fn, *args, **kwargs)``."""
    return cache.with_lock(key, ttl, fn, *args, **kwargs)
