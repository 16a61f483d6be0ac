"""hotlock: fast Redis locks that survive a crashed holder.

cache = hotlock.connect()                      # CACHE_URL, else in-process
with cache.lock("settle:invoice-1", ttl=60):   # try once; LockNotAcquired if held
    ...
"""

from __future__ import annotations

import dataclasses
import logging
import math
import os
from collections.abc import Callable
from typing import TYPE_CHECKING, ParamSpec, TypeVar

from ._backend import BACKEND_NAMES, Backend, native_module, open_backend, tls_refused
from ._cache import Cache
from ._config import ServerConfig, parse_url
from ._dialect import Dialect, check_scripts, commands_from, detect, probe_needed
from ._keys import check_prefix
from ._lock import Lock
from ._memory import MemoryBackend
from ._metered import MeteredCache, check_listener
from ._validate import DEFAULT_TTL, Seconds
from .errors import CacheError, HotlockError, LockLost, LockNotAcquired

if TYPE_CHECKING:
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

# Policies under which Redis may delete a lock key before its TTL. The volatile-* ones
# evict *only* keys with a TTL: exactly the locks.
_SAFE_POLICY = "noeviction"


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
    metrics: Listener | None = None,
    wakeups: bool = True,
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
    if fewer confirm, the acquire is undone and raises CacheError. It narrows, not closes,
    the two-holder window of a failover.

    ``scripts="auto"`` sends extend and release without Lua where the server compares and
    sets itself (Valkey 9: ``SET … IFEQ``, ``DELIFEQ``; Redis 8.4+: ``SET … IFEQ``,
    ``DELEX … IFEQ``), detected once here; ``scripts="always"`` keeps them on the scripts.
    ``cache.server_info`` tells which server was found and which path is in use.

    ``metrics`` takes a listener (see hotlock.metrics, e.g. hotlock.metrics.PrometheusMetrics())
    told of every acquisition, release, extension, loss and error; without one, nothing is paid.

    ``wakeups=True`` lets a release wake the lock_wait callers waiting for its key (a
    PUBLISH on ``<prefix>wake:{key}``, sent only when someone waits; one subscriber
    connection per cache); ``wakeups=False`` keeps lock_wait on its backoff polling alone.
    """
    check_scripts(scripts)
    listener = check_listener(metrics)
    raw_prefix, config = _connect_config(url, prefix, connect_timeout, timeout, backend, wait_replicas, wait_timeout)
    config = _with_wakeups(config, wakeups)
    if config is None:
        return _cache(MemoryBackend(), raw_prefix, listener, timeout)
    opened, why = open_backend(config, backend)
    try:
        info = opened.info()
        # The server's dialect, once: what extend and release send from now on (_dialect).
        commands = commands_from(opened.command_info()) if probe_needed(info, scripts) else None
        dialect = detect(info, commands, scripts)
        opened.use_dialect(dialect)
        _log_server(info, dialect, opened.name, opened.server, why)
    except BaseException:
        opened.close()
        raise
    return _cache(opened, raw_prefix, listener, config.timeout)


def _with_wakeups(config: ServerConfig | None, wakeups: object) -> ServerConfig | None:
    """connect()'s ``wakeups`` checked and put in the config (said once when off)."""
    if not isinstance(wakeups, bool):
        raise TypeError(f"wakeups must be a bool, not {type(wakeups).__name__}")
    if config is None or wakeups:
        return config
    log.info("wake-ups off (connect(wakeups=False)): lock_wait polls with backoff")
    return dataclasses.replace(config, wakeups=False)


def _cache(backend: Backend, prefix: bytes, listener: Listener | None, timeout: float) -> Cache:
    # A plain Cache without a listener: the metered one only exists when asked for.
    if listener is None:
        return Cache(backend, prefix, timeout)
    return MeteredCache(backend, prefix, listener, timeout)


def _connect_config(
    url: str | None,
    prefix: object,
    connect_timeout: float,
    timeout: float,
    backend: str | None,
    wait_replicas: int,
    wait_timeout: float | None,
) -> tuple[bytes, ServerConfig | None]:
    """connect()'s argument checks and URL, shared with hotlock.aio.connect(): the prefix as
    bytes and the server, or None (after its WARNING) for the in-process fallback."""
    raw_prefix = _prefix_bytes(prefix)
    for name, value in (("connect_timeout", connect_timeout), ("timeout", timeout)):
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise TypeError(f"{name} must be seconds (int or float), not {type(value).__name__}")
        if not (math.isfinite(value) and value > 0):
            raise ValueError(f"{name} must be a positive number of seconds, not {value!r}")
    if isinstance(wait_replicas, bool) or not isinstance(wait_replicas, int):
        raise TypeError(f"wait_replicas must be an int, not {type(wait_replicas).__name__}")
    if wait_replicas < 0:
        raise ValueError(f"wait_replicas must not be negative, not {wait_replicas!r}")
    if wait_timeout is None:
        wait_timeout = timeout / 2
    if isinstance(wait_timeout, bool) or not isinstance(wait_timeout, (int, float)):
        raise TypeError(f"wait_timeout must be seconds (int or float), not {type(wait_timeout).__name__}")
    # WAIT's reply comes after up to wait_timeout: it must fit in one reply timeout.
    if not (math.isfinite(wait_timeout) and 0 < wait_timeout < timeout):
        raise ValueError(f"wait_timeout must be positive and below timeout ({timeout!r} s), not {wait_timeout!r}")
    if backend is not None and backend not in BACKEND_NAMES:
        raise ValueError(f"backend must be one of {', '.join(BACKEND_NAMES)} or None, not {backend!r}")
    if url is None:
        url = os.environ.get("CACHE_URL") or None
    if url is None:
        if backend is not None:
            raise ValueError(f"backend={backend!r} needs a url or CACHE_URL")
        if wait_replicas:
            # There are no replicas to wait for in-process: saying nothing would be a lie.
            raise ValueError(f"wait_replicas={wait_replicas!r} needs a url or CACHE_URL")
        log.warning("no cache configured: locks exclude nothing outside this process")
        return raw_prefix, None
    return raw_prefix, parse_url(
        url,
        connect_timeout=float(connect_timeout),
        timeout=float(timeout),
        wait_replicas=wait_replicas,
        wait_timeout=float(wait_timeout),
    )


def _prefix_bytes(prefix: object) -> bytes:
    if isinstance(prefix, str):
        prefix = prefix.encode("utf-8")
    if not isinstance(prefix, bytes):
        raise TypeError(f"prefix must be str or bytes, not {type(prefix).__name__}")
    if not prefix or len(prefix) > 256:
        raise ValueError("prefix must be 1 to 256 bytes long")
    return check_prefix(prefix)


def _log_server(info: dict[str, str] | None, dialect: Dialect, backend: str, server: str, why: str | None) -> None:
    reason = f" ({why})" if why else ""
    shards = info.get("cluster_primaries") if info else None
    topology = f"Redis Cluster of {shards} shards, " if shards else ""
    log.info("connected to %s (%s%s) with the %s backend%s", server, topology, dialect.describe(), backend, reason)
    if info is None:
        log.info("INFO is refused by the server's ACL: the server's version and maxmemory-policy go unchecked")
        return
    # On a cluster the backend names each primary with an evicting policy (maxmemory_policy@host:port).
    policies = [(server, info.get("maxmemory_policy", _SAFE_POLICY))]
    policies += [(k.partition("@")[2], v) for k, v in info.items() if k.startswith("maxmemory_policy@")]
    for where, policy in policies:
        if policy != _SAFE_POLICY:
            log.warning(
                "%s has maxmemory-policy %s: Redis may evict lock keys before their TTL and grant them twice; "
                "set maxmemory-policy noeviction",
                where,
                policy,
            )


def backend_info() -> dict[str, str | None]:
    """Which backend connect() would use for a redis:// url, and why, when it is not native;
    the same for a rediss:// url; and the hiredis and OpenSSL the native client runs on.

    ``{"backend": "native" | "redis-py", "reason": None | str, "hiredis": version | None,
    "tls": "native" | "redis-py", "tls_reason": None | str, "openssl": version | None}``
    """
    native, why = native_module()
    tls_why = tls_refused()
    return {
        "backend": "redis-py" if native is None else "native",
        "reason": why,
        "hiredis": None if native is None else native.HIREDIS_VERSION,
        # rediss:// urls: native when the TLS build is loaded (it runs on the libssl of
        # Python's own ssl module, whose version is in "openssl"), else redis-py and why.
        "tls": "native" if native is not None and tls_why is None else "redis-py",
        "tls_reason": why if native is None else tls_why,
        "openssl": (native.OPENSSL_VERSION or None) if native is not None else None,
    }


def with_lock(cache: Cache, key: str | bytes, ttl: Seconds, fn: Callable[P, R], *args: P.args, **kwargs: P.kwargs) -> R:
    """``cache.with_lock(key, ttl, fn, *args, **kwargs)``."""
    return cache.with_lock(key, ttl, fn, *args, **kwargs)


def lock_wait(
    cache: Cache,
    key: str | bytes,
    ttl: Seconds = DEFAULT_TTL,
    wait: Seconds = 10.0,
    *,
    auto_extend: bool = False,
    max_hold: Seconds | None = None,
) -> Lock:
    """``cache.lock_wait(key, ttl, wait, auto_extend=..., max_hold=...)``."""
    return cache.lock_wait(key, ttl, wait, auto_extend=auto_extend, max_hold=max_hold)
