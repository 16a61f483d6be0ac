"""The one interface every backend speaks, and the one place a backend is chosen.

A backend knows bytes keys (already prefixed), bytes tokens and integer milliseconds,
and nothing of the public API. It raises CacheError for every Redis failure; it never
reports a failure as contention.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol
from urllib.parse import parse_qs, unquote, urlsplit

from ._sentinel import SCHEME as SENTINEL_SCHEME
from ._sentinel import parse_sentinel_netloc
from .errors import CacheError

if TYPE_CHECKING:
    from types import ModuleType

__all__ = [
    "Backend",
    "Named",
    "ServerConfig",
    "cache_error",
    "native_module",
    "parse_url",
]


class Named(Protocol):
    """What every backend, sync or async, tells about itself."""

    name: str  # "native", "redis-py" or "memory"
    server: str  # the server as shown in logs and errors, without credentials


class Backend(Named, Protocol):
    # acquire/acquire_many return 0 for "acquired" and otherwise the holder's remaining
    # TTL in ms (> 0), or -1 when it is unknown: the contract of _scripts.ACQUIRE.
    def acquire(self, key: bytes, token: bytes, ttl_ms: int) -> int: ...

    # Polls acquire with the _backoff schedule until it succeeds or wait_ms has passed.
    # Returns the last acquire result and the time.monotonic() at which that attempt was
    # sent (the lease's TTL runs from then).
    def acquire_wait(self, key: bytes, token: bytes, ttl_ms: int, wait_ms: int) -> tuple[int, float]: ...

    def acquire_many(self, keys: list[bytes], tokens: list[bytes], ttl_ms: int) -> list[int]: ...
    def extend(self, key: bytes, token: bytes, ttl_ms: int) -> bool: ...
    def extend_many(self, keys: list[bytes], tokens: list[bytes], ttl_ms: int) -> list[bool]: ...
    def release(self, key: bytes, token: bytes) -> bool: ...
    def release_many(self, keys: list[bytes], tokens: list[bytes]) -> list[bool]: ...
    def set_nx(self, key: bytes, value: bytes, ttl_ms: int) -> bool: ...
    def incr(self, key: bytes, amount: int) -> int: ...

    # The server's INFO fields, or None when an ACL refuses INFO.
    def info(self) -> dict[str, str] | None: ...
    def close(self) -> None: ...


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
    # connect(wait_replicas=N): WAIT for N replicas after each acquire, up to wait_timeout s.
    wait_replicas: int = 0
    wait_timeout: float = 0.5

    def primary(self) -> tuple[str, int]:
        """The (host, port) to connect to now: under Sentinel, whatever the sentinels name
        as the primary at this moment (a backend asks at each connect and reconnect, so it
        follows a failover); otherwise the URL's own host and port."""
        if not self.sentinels:
            return self.host, self.port
        from ._sentinel import primary_address

        assert self.service is not None
        return primary_address(self.sentinels, self.service, self.connect_timeout, self.display)

    @property
    def display(self) -> str:
        """The server without credentials: safe for logs, errors and repr."""
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
    ``redis+sentinel://[user:pass@]host[:port][,host[:port]…]/service[/db]``."""
    if not isinstance(url, str):
        raise TypeError(f"url must be str, not {type(url).__name__}")
    parts = urlsplit(url)
    # Never echo the URL itself: it may carry a password.
    if parts.scheme not in ("redis", "rediss", "unix", SENTINEL_SCHEME):
        raise ValueError(
            f"url scheme must be redis://, rediss://, unix:// or {SENTINEL_SCHEME}://, not {parts.scheme or '(none)'}://"
        )
    waiting = {"wait_replicas": wait_replicas, "wait_timeout": wait_timeout}
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


_native: ModuleType | None = None
_native_error: str | None = None
_native_checked = False


def native_module() -> tuple[ModuleType | None, str | None]:
    """The native extension and None, or None and why it is not live (the ImportError text kept)."""
    global _native, _native_error, _native_checked
    if not _native_checked:
        _native_checked = True
        if os.environ.get("HOTLOCK_PURE_PYTHON"):
            _native_error = "HOTLOCK_PURE_PYTHON is set"
        else:
            try:
                from . import _native as mod
            except ImportError as exc:
                _native_error = f"the extension did not import: {exc}"
            else:
                _native = mod
    return _native, _native_error


BACKEND_NAMES = ("native", "redis-py")


def choose(config: ServerConfig, requested: str | None) -> tuple[str, str | None]:
    """The backend to open for ``config`` and, when it is not native, why.

    Native when the extension imported and HOTLOCK_PURE_PYTHON is unset; redis-py
    otherwise, and for TLS when the linked hiredis has none.
    """
    native, why = native_module()
    if requested == "redis-py":
        return "redis-py", "asked for by connect(backend='redis-py')"
    if native is None:
        if requested == "native":
            raise ValueError(f"backend='native' is not available: {why}")
        return "redis-py", why
    if config.tls and not native.HAS_TLS:
        return "redis-py", f"the linked hiredis {native.HIREDIS_VERSION} has no TLS, and the url is rediss://"
    return "native", None


def open_backend(config: ServerConfig, requested: str | None) -> tuple[Backend, str | None]:
    name, why = choose(config, requested)
    if name == "native":
        native, _ = native_module()
        assert native is not None
        backend: Backend = native.NativeBackend(config)
    else:
        from ._redispy import RedisPyBackend  # lazily: the native path never pays for `import redis`

        backend = RedisPyBackend(config)
    return backend, why
