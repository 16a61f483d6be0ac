"""What the command line talks to: the server(s) behind a URL, through redis-py, and the
key layout read back (user key, fence) from what the library wrote.

The CLI inspects with plain redis-py clients (INFO, CONFIG, SCAN, CLUSTER SHARDS are no
part of the lock backends); URLs go through the library's own parse_url, so a bad URL gets
the same message here as from hotlock.connect().
"""

from __future__ import annotations

import inspect
import re
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

from .. import _keys
from .._config import ServerConfig, parse_url
from .._ident import TOKEN_BYTES  # a lock's value starts with its token
from .._scripts import WAITED
from .._validate import MAX_KEY_BYTES
from ..errors import CacheError

__all__ = [
    "CliError",
    "Node",
    "Target",
    "Unreachable",
    "fence_of",
    "glob_matcher",
    "lock_name",
    "lock_pattern",
    "open_target",
    "shown_key",
    "user_key",
]

# The exit codes (docs/cli.md).
OK, FAILED, USAGE, UNREACHABLE = 0, 1, 2, 3


class CliError(Exception):
    """A failure the command reports in one line and turns into its exit code."""

    code = FAILED


class UsageError(CliError):
    code = USAGE


class Unreachable(CliError):
    code = UNREACHABLE


# -- the key layout, read back ---------------------------------------------------------
#
# hotlock._keys writes it (a lock on user key K lives at <prefix>lock:{K}); everything here
# that names or reads a lock key goes through these three functions.


def lock_name(prefix: bytes, key: bytes) -> bytes:
    """The Redis key of the lock on user key ``key``."""
    return _keys.stored(prefix + _keys.LOCK_SPACE, key)


def lock_pattern(prefix: bytes) -> bytes:
    """A SCAN MATCH pattern for every lock under ``prefix`` (its glob characters escaped)."""
    return glob_escape(prefix + _keys.LOCK_SPACE) + b"*"


def user_key(prefix: bytes, name: bytes) -> bytes | None:
    """The user key of the lock stored at ``name``, or None if ``name`` is not a lock key."""
    return _keys.user_key(prefix + _keys.LOCK_SPACE, name)


def fence_of(length: int, tail: bytes) -> int | None:
    """The fence of a lock value of ``length`` bytes whose bytes after the token are ``tail``.

    The value is the 16-byte token alone: the fence of a plain lock is not stored (the
    acquire takes a free key without Lua: hotlock._acquire), so there is none to read (None).
    Earlier releases stored the fence in decimal after the token, and such a lock's fence is
    read. Only the tail is ever read from Redis (GETRANGE key 16 -1), so the token never
    leaves the server. A trailing ``+`` marks a lock a waiter asked to be woken from
    (hotlock._scripts.WAITED): not part of the fence.
    """
    tail = tail.removesuffix(WAITED)
    if length <= TOKEN_BYTES or not tail.isdigit():
        return None
    return int(tail)


def shown_key(key: bytes) -> str:
    """A user key as output shows it (the library's own rule, hotlock._lock.shown)."""
    return key.decode("utf-8", "backslashreplace")


def key_arg(text: str) -> bytes:
    """A KEY argument as bytes: the bytes the shell passed (os.fsencode's rule), checked as
    the library checks keys."""
    raw = text.encode("utf-8", "surrogateescape")
    if not raw:
        raise UsageError("KEY must not be empty")
    if len(raw) > MAX_KEY_BYTES:
        raise UsageError(f"KEY is {len(raw)} bytes; at most {MAX_KEY_BYTES} are allowed")
    return raw


def glob_escape(raw: bytes) -> bytes:
    return re.sub(rb"([*?\[\]\\])", rb"\\\1", raw)


def glob_matcher(pattern: bytes) -> re.Pattern[bytes]:
    """Redis's glob (SCAN MATCH, KEYS) as a regex: ``*``, ``?``, ``[abc]``, ``[^a-z]``, ``\\x``.

    Applied to the user key, so a pattern means the same whatever the layout around it.
    """
    out = []
    i, n = 0, len(pattern)
    while i < n:
        c = pattern[i : i + 1]
        if c == b"*":
            out.append(b".*")
        elif c == b"?":
            out.append(b".")
        elif c == b"\\" and i + 1 < n:
            i += 1
            out.append(re.escape(pattern[i : i + 1]))
        elif c == b"[":
            end = pattern.find(b"]", i + 2 if pattern[i + 1 : i + 2] in (b"^", b"]") else i + 1)
            if end < 0:
                out.append(re.escape(c))
            else:
                body = pattern[i + 1 : end]
                negate = body.startswith(b"^")
                if negate:
                    body = body[1:]
                parts = []
                j = 0
                while j < len(body):
                    ch = body[j : j + 1]
                    if ch == b"\\" and j + 1 < len(body):
                        j += 1
                        ch = body[j : j + 1]
                    if body[j + 1 : j + 2] == b"-" and j + 2 < len(body):
                        hi = body[j + 2 : j + 3]
                        parts.append(re.escape(ch) + b"-" + re.escape(hi))
                        j += 3
                        continue
                    parts.append(re.escape(ch))
                    j += 1
                out.append(b"[" + (b"^" if negate else b"") + b"".join(parts) + b"]")
                i = end
        else:
            out.append(re.escape(c))
        i += 1
    return re.compile(b"".join(out), re.DOTALL)


# -- connections ----------------------------------------------------------------------


@dataclass
class Node:
    """One server the CLI talks to: a primary (or the only server)."""

    address: str  # host:port, or the socket path
    client: Any  # redis.Redis (Any: redis-py's command methods are loosely typed)


@dataclass
class Target:
    """The server(s) behind one URL."""

    display: str  # the URL without credentials
    kind: str  # "standalone", "sentinel" or "cluster"
    prefix: bytes
    timeout: float
    config: ServerConfig  # a cluster URL's seeds in config.seeds
    nodes: list[Node] = field(default_factory=list)  # the primaries
    cluster: Any = None  # redis.cluster.RedisCluster
    sentinel_info: dict[str, Any] = field(default_factory=dict)

    def client_for(self, name: bytes) -> Any:
        """The client of the primary that owns key ``name``."""
        if self.cluster is not None:
            return self.cluster.get_node_from_key(name).redis_connection
        return self.nodes[0].client

    def close(self) -> None:
        for node in self.nodes:
            node.client.close()
        if self.cluster is not None:
            self.cluster.close()


def _client_kwargs(username: str | None, password: str | None, timeout: float) -> dict[str, Any]:
    kwargs: dict[str, Any] = {
        "username": username,
        "password": password,
        "socket_timeout": timeout,
        "socket_connect_timeout": timeout,
        # One try per command, as the library does: a blackholed server costs one timeout.
        "retry": Retry(NoBackoff(), 0),
        "protocol": 2,
    }
    # No CLIENT SETINFO round trip (nor its ACL permission) on connect; see hotlock.backends.redispy.
    if "driver_info" in inspect.signature(redis.Redis.__init__).parameters:
        kwargs["driver_info"] = None
    else:
        kwargs["lib_name"] = kwargs["lib_version"] = None
    return kwargs


def parse_target_url(url: str, timeout: float) -> ServerConfig:
    """The library's own parse of ``url`` (a cluster URL's seeds in ``ServerConfig.seeds``).
    Raises UsageError with parse_url's message."""
    try:
        return parse_url(url, connect_timeout=timeout, timeout=timeout)
    except (TypeError, ValueError) as exc:
        raise UsageError(f"--url: {exc}") from None


def _unreachable(display: str, exc: BaseException) -> Unreachable:
    if isinstance(exc, redis.AuthenticationError):
        why = f"authentication failed: {exc}"
    elif isinstance(exc, redis.TimeoutError):
        why = "no reply within the timeout"
    else:
        why = str(exc) or type(exc).__name__
    return Unreachable(f"cannot connect to {display}: {why}")


def open_target(url: str, prefix: bytes, timeout: float) -> Target:
    """Connect to the server(s) behind ``url`` and check each answers (PING).

    Raises UsageError for a bad URL (before any I/O) and Unreachable when no server answers.
    """
    config = parse_target_url(url, timeout)
    if config.seeds:
        return _open_cluster(config, prefix, timeout)
    kwargs = _client_kwargs(config.username, config.password, timeout)
    kwargs["db"] = config.db
    target = Target(
        display=config.display,
        kind="sentinel" if config.sentinels else "standalone",
        prefix=prefix,
        timeout=timeout,
        config=config,
    )
    try:
        if config.sentinels:
            target.sentinel_info = _ask_sentinels(config, timeout)
            host, port = config.primary()
        else:
            host, port = config.host, config.port
        if config.unix_path is not None:
            client = redis.Redis(unix_socket_path=config.unix_path, **kwargs)
            address = config.unix_path
        else:
            if config.tls:
                # The library's own TLS connection (a TLS 1.3 session ticket must not make the
                # pool drop a fresh connection), the certificate and hostname verified as there.
                from ..backends.redispy import TLSConnection

                pool = redis.ConnectionPool(
                    connection_class=TLSConnection,
                    host=host,
                    port=port,
                    ssl_cert_reqs="required",
                    ssl_check_hostname=True,
                    **kwargs,
                )
                client = redis.Redis(connection_pool=pool)
            else:
                client = redis.Redis(host=host, port=port, **kwargs)
            address = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
        target.nodes.append(Node(address, client))
        client.ping()
    except (redis.ConnectionError, redis.TimeoutError, OSError) as exc:
        target.close()
        raise _unreachable(config.display, exc) from None
    except redis.ResponseError as exc:
        # A refused PING (ACL) still means we reached it: the commands decide what works.
        if not isinstance(exc, redis.exceptions.NoPermissionError):
            target.close()
            raise _unreachable(config.display, exc) from None
    except CacheError as exc:  # from the sentinels: none named a primary
        target.close()
        raise Unreachable(str(exc)) from None
    return target


def _ask_sentinels(config: ServerConfig, timeout: float) -> dict[str, Any]:
    """What the first answering sentinel says of the service: its primary, replicas and
    the sentinels' quorum (for doctor's topology line)."""
    assert config.service is not None
    errors = []
    for host, port in config.sentinels:
        client: Any = redis.Redis(host=host, port=port, **_client_kwargs(None, None, timeout))
        try:
            master = client.execute_command("SENTINEL", "MASTER", config.service)
            replicas = client.execute_command("SENTINEL", "REPLICAS", config.service)
        except redis.RedisError as exc:
            errors.append(f"{host}:{port}: {exc}")
            continue
        finally:
            client.close()
        return {
            "sentinel": f"{host}:{port}",
            "master": _pairs(master),
            "replicas": [_pairs(r) for r in replicas],
            "asked": len(config.sentinels),
            "errors": errors,
        }
    return {"errors": errors, "asked": len(config.sentinels)}


def _pairs(flat: Any) -> dict[str, str]:
    """SENTINEL MASTER's flat [field, value, ...] reply (or RESP3 map) as a dict of str."""
    if isinstance(flat, dict):
        items: Iterator[tuple[Any, Any]] = iter(flat.items())
    else:
        it = iter(flat)
        items = zip(it, it, strict=False)
    return {_text(k): _text(v) for k, v in items}


def _text(value: Any) -> str:
    return value.decode("utf-8", "replace") if isinstance(value, bytes) else str(value)


def _open_cluster(config: ServerConfig, prefix: bytes, timeout: float) -> Target:
    from redis.cluster import ClusterNode, RedisCluster

    nodes: Any = [ClusterNode(h, p) for h, p in config.seeds]  # type: ignore[no-untyped-call]
    display = config.display
    kwargs = _client_kwargs(config.username, config.password, timeout)
    try:
        cluster: Any = RedisCluster(
            startup_nodes=nodes,
            ssl=config.tls,
            require_full_coverage=False,  # doctor reports uncovered slots itself
            cluster_error_retry_attempts=1,
            **kwargs,
        )
    except (redis.RedisError, OSError) as exc:
        raise _unreachable(display, exc) from None
    target = Target(display=display, kind="cluster", prefix=prefix, timeout=timeout, config=config, cluster=cluster)
    for node in cluster.get_primaries():
        target.nodes.append(Node(f"{node.host}:{node.port}", node.redis_connection))
    return target
