"""What a backend needs to reach a server: the parsed URL and timeouts, and its errors.

The bottom of the module graph (it imports only the errors and the Sentinel URL helpers):
the chooser in _backend and every backend, sync and async, import it, never each other.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from urllib.parse import parse_qs, unquote, urlsplit

from ._sentinel import SCHEME as SENTINEL_SCHEME
from ._sentinel import parse_sentinel_netloc, primary_address
from .errors import CacheError

__all__ = ["CLUSTER_SCHEMES", "ServerConfig", "cache_error", "parse_url"]

# redis+cluster://seed[,seed...] and its TLS twin: the seeds are any nodes of the cluster.
CLUSTER_SCHEMES = ("redis+cluster", "rediss+cluster")


@dataclass(frozen=True)
class ServerConfig:
    """A parsed Redis URL plus the timeouts: what any backend needs to connect."""

    url: str
    host: str = "127.0.0.1"
    port: int = 6379
    unix_path: str | None = None
    tls: bool = False
    username: str | None = None
    password: str | None = None
    db: int = 0
    connect_timeout: float = 2.0
    timeout: float = 2.0
    # redis+sentinel://: the sentinels to ask and the name they know the primary by.
    sentinels: tuple[tuple[str, int], ...] = ()
    service: str | None = None
    # redis+cluster://: the seed nodes asked for the slot map (any subset of the cluster).
    seeds: tuple[tuple[str, int], ...] = ()
    # connect(wait_replicas=N): WAIT for N replicas after each acquire, up to wait_timeout s.
    wait_replicas: int = 0
    wait_timeout: float = 0.5
    # connect(wakeups=False): lock_wait polls only, no subscriber connection (_wakeup).
    wakeups: bool = True

    def primary(self) -> tuple[str, int]:
        """The (host, port) to connect to now: under Sentinel, whatever the sentinels name
        as the primary at this moment (a backend asks at each connect and reconnect, so it
        follows a failover); otherwise the URL's own host and port."""
        if not self.sentinels:
            return self.host, self.port
        assert self.service is not None
        return primary_address(self.sentinels, self.service, self.connect_timeout, self.display)

    def node(self, host: str, port: int) -> ServerConfig:
        """This cluster's settings (credentials, TLS, timeouts) for one of its nodes."""
        return replace(self, url=f"{'rediss' if self.tls else 'redis'}://{host}:{port}", host=host, port=port, seeds=())

    @property
    def display(self) -> str:
        """The server without credentials: safe for logs, errors and repr."""
        if self.seeds:
            hosts = ",".join(f"[{h}]:{p}" if ":" in h else f"{h}:{p}" for h, p in self.seeds)
            return f"{CLUSTER_SCHEMES[self.tls]}://{hosts}"
        if self.sentinels:
            hosts = ",".join(f"[{h}]:{p}" if ":" in h else f"{h}:{p}" for h, p in self.sentinels)
            return f"redis+sentinel://{hosts}/{self.service}/{self.db}"
        if self.unix_path is not None:
            return f"unix://{self.unix_path}?db={self.db}"
        scheme = "rediss" if self.tls else "redis"
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"{scheme}://{host}:{self.port}/{self.db}"

    def __repr__(self) -> str:
        return f"ServerConfig({self.display!r})"


def parse_url(
    url: str, *, connect_timeout: float, timeout: float, wait_replicas: int = 0, wait_timeout: float = 0.5
) -> ServerConfig:
    """``redis://[user:pass@]host[:port][/db]``, ``rediss://…``, ``unix:///path[?db=N]``,
    ``redis+sentinel://[user:pass@]host[:port][,host[:port]…]/service[/db]``,
    ``redis+cluster://[user:pass@]host[:port][,host[:port]…][/]`` and ``rediss+cluster://…``."""
    if not isinstance(url, str):
        raise TypeError(f"url must be str, not {type(url).__name__}")
    parts = urlsplit(url)
    # Never echo the URL itself: it may carry a password.
    if parts.scheme not in ("redis", "rediss", "unix", SENTINEL_SCHEME, *CLUSTER_SCHEMES):
        raise ValueError(
            f"url scheme must be redis://, rediss://, unix://, {SENTINEL_SCHEME}:// or "
            f"{'://, '.join(CLUSTER_SCHEMES)}://, not {parts.scheme or '(none)'}://"
        )
    waiting = {"wait_replicas": wait_replicas, "wait_timeout": wait_timeout}
    if parts.scheme in CLUSTER_SCHEMES:
        if parts.query or parts.fragment:
            raise ValueError(f"{parts.scheme}:// url takes no ?query or #fragment")
        username, password, seeds = parse_sentinel_netloc(parts.netloc, parts.scheme, 6379)
        # A cluster has database 0 only; "/" and "/0" are accepted as the plain URL's habit.
        if _db_number(parts.path.strip("/")) != 0:
            raise ValueError(f"{parts.scheme}:// url: a cluster has database 0 only")
        return ServerConfig(
            url=url,
            host=seeds[0][0],
            port=seeds[0][1],
            tls=parts.scheme == CLUSTER_SCHEMES[1],
            username=username,
            password=password,
            connect_timeout=connect_timeout,
            timeout=timeout,
            seeds=seeds,
            **waiting,  # type: ignore[arg-type]
        )
    if parts.scheme == SENTINEL_SCHEME:
        username, password, sentinels = parse_sentinel_netloc(parts.netloc)
        service, _, db_text = parts.path.strip("/").partition("/")
        if not service:
            raise ValueError(
                f"{SENTINEL_SCHEME}:// url needs the primary's name, as in {SENTINEL_SCHEME}://h1,h2/mymaster"
            )
        return ServerConfig(
            url=url,
            host=sentinels[0][0],
            port=sentinels[0][1],
            username=username,
            password=password,
            db=_db_number(db_text),
            connect_timeout=connect_timeout,
            timeout=timeout,
            sentinels=sentinels,
            service=unquote(service),
            **waiting,  # type: ignore[arg-type]
        )
    query = parse_qs(parts.query)
    username = unquote(parts.username) if parts.username else None
    password = unquote(parts.password) if parts.password is not None else None
    db_text = query.get("db", [""])[0]
    if parts.scheme != "unix" and parts.path not in ("", "/"):
        db_text = parts.path.lstrip("/")
    common = {
        "url": url,
        "username": username,
        "password": password,
        "db": _db_number(db_text),
        "connect_timeout": connect_timeout,
        "timeout": timeout,
        **waiting,
    }
    if parts.scheme == "unix":
        if not parts.path:
            raise ValueError("unix:// url needs a socket path, as in unix:///run/redis.sock")
        return ServerConfig(unix_path=parts.path, **common)  # type: ignore[arg-type]
    try:
        port = parts.port or 6379
    except ValueError:
        raise ValueError("url port must be a number from 1 to 65535") from None
    return ServerConfig(
        host=parts.hostname or "127.0.0.1",
        port=port,
        tls=parts.scheme == "rediss",
        **common,  # type: ignore[arg-type]
    )


def _db_number(text: str) -> int:
    try:
        db = int(text) if text else 0
    except ValueError:
        raise ValueError("url database number must be an integer") from None
    if db < 0:
        raise ValueError("url database number must not be negative")
    return db


def cache_error(what: str, server: str, key: bytes | None = None) -> CacheError:
    """A CacheError naming the operation, the key (as stored, prefix included) and the server."""
    shown = None if key is None else key.decode("utf-8", "backslashreplace")
    where = f" on key {shown!r}" if shown is not None else ""
    return CacheError(f"{what}{where} (server {server})", key=shown, server=server)
