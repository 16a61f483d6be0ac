"""What hotlock.connect() and hotlock.aio.connect() share: the argument checks, the URL,
the backend chosen and opened (the one place it is chosen), and the log lines.

The backend modules are imported here lazily, on the path that opens them: the native and
memory paths never pay for `import redis`, the sync ones never for asyncio's.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import os
from typing import TYPE_CHECKING, TypeVar

from ._config import ServerConfig, parse_url
from ._dialect import check_fences, check_scripts, detect
from ._keys import check_prefix
from .backends.native import native_aio, native_module, tls_refused
from .metrics import LISTENER_METHODS, Listener, Listeners

if TYPE_CHECKING:
    from collections.abc import Callable

    from ._dialect import Dialect
    from .backends import AsyncBackend, Backend
    from .backends.cluster import Link
    from .backends.cluster_async import AsyncLink

__all__ = [
    "BACKEND_NAMES",
    "check_listener",
    "choose",
    "connect_arguments",
    "in_process",
    "log_server",
    "open_async_backend",
    "open_async_detected",
    "open_backend",
    "open_detected",
    "with_credentials",
    "with_wakeups",
]

log = logging.getLogger("hotlock")

InProcess = TypeVar("InProcess", bound="Backend | AsyncBackend")

BACKEND_NAMES = ("native", "redis-py")
# The shortest timeout a connection takes, in seconds (see connect_config).
MIN_TIMEOUT = 0.001

# Policies under which Redis may delete a lock key before its TTL. The volatile-* ones
# evict *only* keys with a TTL: exactly the locks.
SAFE_POLICY = "noeviction"


def choose(config: ServerConfig, requested: str | None, *, aio: bool = False) -> tuple[str, str | None]:
    """The backend to open for ``config`` and, when it is not native, why.

    Native when the extension imported and HOTLOCK_PURE_PYTHON is unset; redis-py
    otherwise. The sync native client speaks rediss:// only on the TLS build (see
    native_module); the async one needs no TLS from hiredis (the event loop's transport
    does TLS), so there rediss:// stays native.
    """
    if requested == "redis-py":
        return "redis-py", "asked for by connect(backend='redis-py')"
    native, why = native_aio() if aio else native_module()
    if native is None:
        if requested == "native":
            raise ValueError(f"backend='native' is not available: {why}")
        return "redis-py", why
    if not aio and config.tls and not native.HAS_TLS:
        return "redis-py", f"{tls_refused()}, and the url is rediss://"
    return "native", None


def open_backend(config: ServerConfig, requested: str | None) -> tuple[Backend, str | None]:
    """The sync backend for ``config``, opened, and why it is not native (or None)."""
    name, why = choose(config, requested)
    native, _ = native_module()
    if config.seeds:
        # A cluster: the same transports, one link per primary, routed by backends.cluster.
        from .backends.cluster import ClusterBackend

        router = None
        if name == "native":
            assert native is not None
            opener: Callable[[ServerConfig], Link] = native.NativeBackend
            router = native.ClusterRouter  # the healthy case routed in C, over the same links
        else:
            from .backends.redispy import RedisPyLink

            opener = RedisPyLink
        return ClusterBackend(config, name, opener, router), why
    if name == "native":
        assert native is not None
        backend: Backend = native.NativeBackend(config)
    else:
        from .backends.redispy import RedisPyBackend

        backend = RedisPyBackend(config)
    return backend, why


async def open_async_backend(config: ServerConfig, requested: str | None) -> tuple[AsyncBackend, str | None]:
    """The async backend for ``config``, opened, and why it is not native (or None)."""
    name, why = choose(config, requested, aio=True)
    native, _ = native_aio()
    if config.seeds:
        from .backends.cluster_async import AsyncClusterBackend

        if name == "native":
            from .backends.native_async import NativeAsyncBackend

            assert native is not None
            protocol = native.AioProtocol

            async def opener(node: ServerConfig) -> AsyncLink:
                return await NativeAsyncBackend.open(node, protocol)

            # The node table in C: a healthy call goes straight to its node's connection.
            return await AsyncClusterBackend.open(config, name, opener, native.ClusterRouter), why
        from .backends.redispy_async import RedisAsyncLink

        return await AsyncClusterBackend.open(config, name, RedisAsyncLink.open), why
    backend: AsyncBackend
    if name == "native":
        from .backends.native_async import NativeAsyncBackend

        assert native is not None
        backend = await NativeAsyncBackend.open(config, native.AioProtocol)
    else:
        from .backends.redispy_async import RedisAsyncBackend

        backend = await RedisAsyncBackend.open(config)
    return backend, why


def open_detected(config: ServerConfig, requested: str | None, scripts: str, fences: bool) -> Backend:
    """The sync backend opened, its server's dialect detected (INFO and COMMAND, once), and
    the connect log lines written: what connect() does once the arguments are checked."""
    from ._dialect import commands_from, detect, probe_needed

    opened, why = open_backend(config, requested)
    try:
        info = opened.info()
        # The server's dialect, once: what extend and release send from now on (_dialect).
        commands = commands_from(opened.command_info()) if probe_needed(info, scripts) else None
        opened.use_dialect(detect(info, commands, scripts, fences))
        # What the backend made of it (a cluster: each primary's own).
        log_server(info, opened.dialect, opened.name, opened.server, why)
    except BaseException:
        opened.close()
        raise
    return opened


async def open_async_detected(config: ServerConfig, requested: str | None, scripts: str, fences: bool) -> AsyncBackend:
    """open_detected()'s async twin."""
    from ._dialect import commands_from, detect, probe_needed

    opened, why = await open_async_backend(config, requested)
    try:
        info = await opened.info()
        commands = commands_from(await opened.command_info()) if probe_needed(info, scripts) else None
        opened.use_dialect(detect(info, commands, scripts, fences))
        log_server(info, opened.dialect, opened.name, opened.server, why)
    except BaseException:
        await opened.close()
        raise
    return opened


def connect_arguments(
    *,
    url: str | None,
    prefix: object,
    connect_timeout: float,
    timeout: float,
    backend: str | None,
    wait_replicas: int,
    wait_timeout: float | None,
    scripts: str,
    fences: object,
    metrics: object,
    wakeups: object,
    lazy: object,
    credential_provider: object,
    reauth_interval: object,
) -> tuple[bytes, ServerConfig | None, Listener | None]:
    """Every argument of hotlock.connect() and hotlock.aio.connect() checked, in their
    signature's order and before any I/O: the prefix as bytes, the server (None, after its
    WARNING, for the in-process fallback) and the listener."""
    check_scripts(scripts)
    check_fences(fences)
    listener = check_listener(metrics)
    raw_prefix = prefix_bytes(prefix)
    for name, value in (("connect_timeout", connect_timeout), ("timeout", timeout)):
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise TypeError(f"{name} must be seconds (int or float), not {type(value).__name__}")
        # Below a millisecond a socket timeout rounds to 0, which the OS and hiredis take
        # as "no timeout": refused here rather than turned into a wait without end.
        if not (math.isfinite(value) and value >= MIN_TIMEOUT):
            raise ValueError(f"{name} must be at least {MIN_TIMEOUT} s (1 ms), not {value!r}")
    if isinstance(wait_replicas, bool) or not isinstance(wait_replicas, int):
        raise TypeError(f"wait_replicas must be an int, not {type(wait_replicas).__name__}")
    if wait_replicas < 0:
        raise ValueError(f"wait_replicas must not be negative, not {wait_replicas!r}")
    given = wait_timeout is not None
    if wait_timeout is None:
        wait_timeout = timeout / 2
    if isinstance(wait_timeout, bool) or not isinstance(wait_timeout, (int, float)):
        raise TypeError(f"wait_timeout must be seconds (int or float), not {type(wait_timeout).__name__}")
    # WAIT's reply comes after up to wait_timeout: it must fit in one reply timeout. WAIT
    # takes whole milliseconds and WAIT n 0 blocks for ever: at least 1 ms. (The default,
    # half the timeout, is checked only where WAIT is sent: a 1 ms timeout leaves 0.5 ms.)
    if (given or wait_replicas) and not (math.isfinite(wait_timeout) and MIN_TIMEOUT <= wait_timeout < timeout):
        raise ValueError(
            f"wait_timeout must be at least {MIN_TIMEOUT} s (1 ms) and below timeout ({timeout!r} s), "
            f"not {wait_timeout!r}"
        )
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
        config = None
    else:
        config = parse_url(
            url,
            connect_timeout=float(connect_timeout),
            timeout=float(timeout),
            wait_replicas=wait_replicas,
            wait_timeout=float(wait_timeout),
        )
    config = with_wakeups(config, wakeups)
    config = with_credentials(config, credential_provider, reauth_interval)
    if not isinstance(lazy, bool):
        raise TypeError(f"lazy must be a bool, not {type(lazy).__name__}")
    return raw_prefix, config, listener


def in_process(backend: InProcess, scripts: str, fences: bool) -> InProcess:
    """The in-process fallback (no URL), given the dialect connect()'s arguments ask for."""
    backend.use_dialect(detect(None, None, scripts, fences))
    return backend


def check_listener(metrics: object) -> Listener | None:
    """connect()'s check of ``metrics``, before any I/O: None, an object with every
    Listener method (a missing one would otherwise surface as an AttributeError, logged
    and swallowed, on the first event), or a list or tuple of such (made one Listeners)."""
    if metrics is None:
        return None
    if isinstance(metrics, (list, tuple)):
        listeners = [_one_listener(m, f"metrics[{i}]") for i, m in enumerate(metrics)]
        if not listeners:
            return None
        return listeners[0] if len(listeners) == 1 else Listeners(*listeners)
    return _one_listener(metrics, "metrics")


def _one_listener(metrics: object, name: str) -> Listener:
    missing = [m for m in LISTENER_METHODS if not callable(getattr(metrics, m, None))]
    if missing:
        raise TypeError(
            f"{name} must be a hotlock.metrics.Listener; {type(metrics).__name__} lacks {', '.join(missing)}"
        )
    return metrics  # type: ignore[return-value]


def prefix_bytes(prefix: object) -> bytes:
    if isinstance(prefix, str):
        prefix = prefix.encode("utf-8")
    if not isinstance(prefix, bytes):
        raise TypeError(f"prefix must be str or bytes, not {type(prefix).__name__}")
    if not prefix or len(prefix) > 256:
        raise ValueError("prefix must be 1 to 256 bytes long")
    return check_prefix(prefix)


def with_wakeups(config: ServerConfig | None, wakeups: object) -> ServerConfig | None:
    """connect()'s ``wakeups`` checked and put in the config (said once when off)."""
    if not isinstance(wakeups, bool):
        raise TypeError(f"wakeups must be a bool, not {type(wakeups).__name__}")
    if config is None or wakeups:
        return config
    log.info("wake-ups off (connect(wakeups=False)): lock_wait polls with backoff")
    return dataclasses.replace(config, wakeups=False)


def with_credentials(
    config: ServerConfig | None, credential_provider: object, reauth_interval: object
) -> ServerConfig | None:
    """connect()'s ``credential_provider`` and ``reauth_interval`` checked (before any I/O)
    and put in the config (hotlock._credentials asks the provider at each new connection)."""
    from ._credentials import check_credentials

    username, password = (config.username, config.password) if config is not None else (None, None)
    provider, interval = check_credentials(credential_provider, reauth_interval, username, password)
    if provider is None:
        return config
    if config is None:
        raise ValueError("credential_provider needs a url or CACHE_URL")
    return dataclasses.replace(config, credential_provider=provider, reauth_interval=interval)


def log_server(info: dict[str, str] | None, dialect: Dialect, backend: str, server: str, why: str | None) -> None:
    reason = f" ({why})" if why else ""
    shards = info.get("cluster_primaries") if info else None
    topology = f"Redis Cluster of {shards} shards, " if shards else ""
    log.info("connected to %s (%s%s) with the %s backend%s", server, topology, dialect.describe(), backend, reason)
    if info is None:
        log.info("INFO is refused by the server's ACL: the server's version and maxmemory-policy go unchecked")
        return
    # On a cluster the backend names each primary with an evicting policy (maxmemory_policy@host:port).
    policies = [(server, info.get("maxmemory_policy", SAFE_POLICY))]
    policies += [(k.partition("@")[2], v) for k, v in info.items() if k.startswith("maxmemory_policy@")]
    for where, policy in policies:
        if policy != SAFE_POLICY:
            log.warning(
                "%s has maxmemory-policy %s: Redis may evict lock keys before their TTL and grant them twice; "
                "set maxmemory-policy noeviction",
                where,
                policy,
            )
