"""What a backend needs to reach a server: the parsed URL and timeouts, and its errors.

The bottom of the module graph (it imports only the errors and the Sentinel URL helpers):
the connect step (_connect) and every backend, sync and async, import it, never each other.
"""

from __future__ import annotations

import functools
import os
import socket
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any
from urllib.parse import parse_qs, unquote, urlsplit

from ._sentinel import SCHEMES as SENTINEL_SCHEMES
from ._sentinel import parse_sentinel_netloc, primary_address

__all__ = [
    "CLUSTER_SCHEMES",
    "KEEPALIVE_OPTIONS",
    "LIB_NAME",
    "SSL_CERT_REQS",
    "ServerConfig",
    "TLSOptions",
    "check_client_name",
    "keepalive",
    "lib_version",
    "naming_commands",
    "naming_optional",
    "parse_url",
    "redispy_tls_kwargs",
    "tls_context",
    "tls_files_stamp",
]

if TYPE_CHECKING:
    import ssl

    from ._credentials import CredentialProvider

# ssl_cert_reqs values, as redis-py takes them. "optional" verifies a certificate the
# server sends; a server always sends one, so for a client it is "required".
SSL_CERT_REQS = ("none", "optional", "required")


@dataclass(frozen=True)
class TLSOptions:
    """rediss:// settings, named as redis-py's URL query arguments are.

    ca_certs: a CA bundle file or directory to trust instead of the system store (without
    it, OpenSSL's default paths, which honour SSL_CERT_FILE and SSL_CERT_DIR). certfile and
    keyfile: a client certificate and its key, for servers that require one (mutual TLS).
    cert_reqs "none" turns certificate verification off, check_hostname False the host
    check alone; both are on by default. server_name: the name the server's certificate
    must carry and the one sent as SNI, in place of the host connected to (cluster nodes or
    a Sentinel primary announced by IP behind a certificate for a name).
    """

    ca_certs: str | None = None
    certfile: str | None = None
    keyfile: str | None = None
    cert_reqs: str = "required"
    check_hostname: bool = True
    server_name: str | None = None

    @property
    def verify(self) -> bool:
        return self.cert_reqs != "none"

    @property
    def check_host(self) -> bool:
        return self.verify and self.check_hostname


def tls_files_stamp(options: TLSOptions) -> tuple[tuple[int, int, int] | None, ...]:
    """What tells a rewritten ssl_ca_certs, ssl_certfile or ssl_keyfile from the one loaded
    (mtime, size and inode: a rotation by rename changes the inode, one in place the mtime):
    compared at each new connection, so a rotated certificate is picked up without a
    restart while an unchanged one is not loaded again. None for a file not given or gone."""
    stamps: list[tuple[int, int, int] | None] = []
    for path in (options.ca_certs, options.certfile, options.keyfile):
        try:
            st = os.stat(path) if path is not None else None
        except OSError:
            st = None
        stamps.append(None if st is None else (st.st_mtime_ns, st.st_size, st.st_ino))
    return tuple(stamps)


@functools.lru_cache(maxsize=16)
def _cached_tls_context(options: TLSOptions, cert_file: str | None, stamp: object) -> ssl.SSLContext:
    """tls_context(options), made once per version of its files: the sentinels are asked
    every PrimaryWatch.REFRESH_S, and loading a CA store each time costs milliseconds
    (cert_file is SSL_CERT_FILE, part of what the context trusts; stamp is tls_files_stamp)."""
    del cert_file, stamp
    return tls_context(options)


def tls_context(options: TLSOptions) -> ssl.SSLContext:
    """A Python ssl context with these settings, for what speaks TLS through the ssl module
    (the wake-up subscribers, the asyncio native client); checks as the native client does."""
    import ssl

    if options.ca_certs is not None and os.path.isdir(options.ca_certs):
        context = ssl.create_default_context(capath=options.ca_certs)
    else:
        context = ssl.create_default_context(cafile=options.ca_certs)
    if options.certfile is not None:
        context.load_cert_chain(options.certfile, options.keyfile)
    if not options.check_host:
        context.check_hostname = False
    if not options.verify:
        context.verify_mode = ssl.CERT_NONE
    return context


def redispy_tls_kwargs(options: TLSOptions) -> dict[str, object]:
    """redis-py's SSLConnection arguments for these settings (sync and asyncio alike); with
    server_name, ssl_server_name, which only hotlock's own connection classes take."""
    kwargs: dict[str, object] = {
        "ssl_cert_reqs": options.cert_reqs,
        "ssl_check_hostname": options.check_host,
        "ssl_certfile": options.certfile,
        "ssl_keyfile": options.keyfile,
    }
    if options.ca_certs is not None and os.path.isdir(options.ca_certs):
        kwargs["ssl_ca_path"] = options.ca_certs
    else:
        kwargs["ssl_ca_certs"] = options.ca_certs
    if options.server_name is not None:
        kwargs["ssl_server_name"] = options.server_name
    return kwargs


TLS_QUERY_NAMES = (
    "ssl_ca_certs",
    "ssl_certfile",
    "ssl_keyfile",
    "ssl_cert_reqs",
    "ssl_check_hostname",
    "ssl_server_name",
)


def _tls_options(query: dict[str, list[str]], scheme: str, tls: bool) -> TLSOptions:
    """The ssl_* query arguments of a URL, checked before any I/O."""
    given = {name: values[-1] for name, values in query.items() if name.startswith("ssl_")}
    if not given:
        return TLSOptions()
    if not tls:
        raise ValueError(f"{scheme}:// url: {', '.join(sorted(given))} need a TLS url (rediss://...)")
    unknown = sorted(set(given) - set(TLS_QUERY_NAMES))
    if unknown:
        raise ValueError(f"{scheme}:// url: unknown TLS setting {unknown[0]}")
    for name in ("ssl_ca_certs", "ssl_certfile", "ssl_keyfile"):
        path = given.get(name)
        if path is not None and not os.path.exists(path):
            raise ValueError(f"{scheme}:// url: {name} names no file: {path}")
    if "ssl_keyfile" in given and "ssl_certfile" not in given:
        raise ValueError(f"{scheme}:// url: ssl_keyfile needs ssl_certfile")
    reqs = given.get("ssl_cert_reqs", "required").lower()
    if reqs not in SSL_CERT_REQS:
        raise ValueError(f"{scheme}:// url: ssl_cert_reqs must be one of {', '.join(SSL_CERT_REQS)}, not {reqs!r}")
    check = given.get("ssl_check_hostname", "true").lower()
    if check not in ("true", "false", "1", "0", "yes", "no"):
        raise ValueError(f"{scheme}:// url: ssl_check_hostname must be true or false, not {check!r}")
    server_name = given.get("ssl_server_name")
    if server_name is not None and not (
        len(server_name) <= 253 and all(ch.isascii() and (ch.isalnum() or ch in "-._:") for ch in server_name)
    ):
        raise ValueError(f"{scheme}:// url: ssl_server_name must be a DNS name (or an IP address), not {server_name!r}")
    return TLSOptions(
        ca_certs=given.get("ssl_ca_certs"),
        certfile=given.get("ssl_certfile"),
        keyfile=given.get("ssl_keyfile"),
        cert_reqs="required" if reqs == "optional" else reqs,
        check_hostname=check in ("true", "1", "yes"),
        server_name=server_name,
    )


# -- naming the connection -----------------------------------------------------------------
# Every connection says what opened it (CLIENT SETINFO, shown by CLIENT LIST and in the
# server's slowlog) and, with ?client_name=, the application's own name (CLIENT SETNAME).

LIB_NAME = "hotlock"


@functools.cache
def lib_version() -> str | None:
    """hotlock's version as the installed metadata says it, or None (not installed): read
    at the first connect, never at import (importlib.metadata costs an import of its own)."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        found = version(LIB_NAME)
    except PackageNotFoundError:
        return None
    # The server refuses a lib-ver with a space or a control character.
    return found if all("!" <= ch <= "~" for ch in found) else None


def check_client_name(name: str, scheme: str) -> str:
    """?client_name=, checked before any I/O as the server checks CLIENT SETNAME (printable
    ASCII, no space: the name is one field of CLIENT LIST's space-separated lines)."""
    if not name or len(name) > 256 or not all("!" <= ch <= "~" for ch in name):
        raise ValueError(
            f"{scheme}:// url: client_name must be 1 to 256 printable ASCII characters without spaces or newlines"
        )
    return name


def naming_commands(config: ServerConfig) -> list[tuple[bytes, ...]]:
    """What every new connection sends after AUTH: CLIENT SETNAME (with ?client_name=),
    then CLIENT SETINFO lib-name and lib-ver, in the same write as the rest of the handshake.
    A refused CLIENT SETINFO (a server before 7.2, an ACL without it) is ignored
    (naming_optional); a refused CLIENT SETNAME fails the connect, as in redis-py."""
    commands: list[tuple[bytes, ...]] = []
    if config.client_name is not None:
        commands.append((b"CLIENT", b"SETNAME", config.client_name.encode()))
    commands.append((b"CLIENT", b"SETINFO", b"LIB-NAME", LIB_NAME.encode()))
    version = lib_version()
    if version is not None:
        commands.append((b"CLIENT", b"SETINFO", b"LIB-VER", version.encode()))
    return commands


def _keepalive_options() -> dict[int, int]:
    # libhiredis's settings (redisEnableKeepAlive), so every path notices a dead peer alike:
    # probes after 15 s idle, every 5 s, the connection given up after 3 unanswered (about
    # 30 s), where the system default waits two hours before its first probe.
    options = {}
    for name, value in (("TCP_KEEPIDLE", 15), ("TCP_KEEPINTVL", 5), ("TCP_KEEPCNT", 3)):
        if hasattr(socket, name):
            options[getattr(socket, name)] = value
    if not options and hasattr(socket, "TCP_KEEPALIVE"):  # macOS: the idle time alone
        options[socket.TCP_KEEPALIVE] = 15
    return options


# socket option -> value under IPPROTO_TCP, for the platform's names (redis-py's socket_keepalive_options).
KEEPALIVE_OPTIONS = _keepalive_options()


def keepalive(sock: Any) -> None:
    """TCP keepalive on a connection's socket (a socket.socket, or what an event loop's
    transport hands out as its "socket"): a peer that vanished without a FIN (a dead host,
    a NAT or load balancer that dropped the flow) is noticed on a connection idle between
    locks, or on a subscriber that only listens (KEEPALIVE_OPTIONS)."""
    if sock is None:
        return
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
    for option, value in KEEPALIVE_OPTIONS.items():
        sock.setsockopt(socket.IPPROTO_TCP, option, value)


def naming_optional(command: tuple[bytes | int, ...]) -> bool:
    """Whether an error reply to this handshake command is ignored (CLIENT SETINFO)."""
    return command[:2] == (b"CLIENT", b"SETINFO")


def command_name(command: tuple[bytes | int, ...]) -> str:
    """How an error names a handshake command: AUTH, SELECT, CLIENT SETNAME, ..."""
    words = command[:2] if command[0] == b"CLIENT" else command[:1]
    return " ".join(w.decode() if isinstance(w, bytes) else str(w) for w in words)


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
    # redis+sentinel://: the sentinels to ask and the name they know the primary by, and
    # the sentinels' own password (?sentinel_password=), when they have one.
    sentinels: tuple[tuple[str, int], ...] = ()
    service: str | None = None
    sentinel_password: str | None = field(default=None, repr=False)
    # redis+cluster://: the seed nodes asked for the slot map (any subset of the cluster).
    seeds: tuple[tuple[str, int], ...] = ()
    # connect(wait_replicas=N): WAIT for N replicas after each acquire and extend, up to wait_timeout s.
    wait_replicas: int = 0
    wait_timeout: float = 0.5
    # connect(wakeups=False): lock_wait polls only, no subscriber connection (_wakeup).
    wakeups: bool = True
    # rediss://: how the server's certificate is checked, and the client's certificate.
    ssl: TLSOptions = field(default_factory=TLSOptions)
    # ?client_name=: CLIENT SETNAME on every connection (naming_commands).
    client_name: str | None = None
    # connect(credential_provider=...): asked for (username, password) at every new
    # connection, instead of the url's; with reauth_interval (seconds, 0: never) AUTH is
    # also re-sent on live connections that often (hotlock._credentials).
    credential_provider: CredentialProvider | None = field(default=None, repr=False, compare=False)
    reauth_interval: float = 0.0

    def primary(self) -> tuple[str, int]:
        """The (host, port) to connect to now: under Sentinel, whatever the sentinels name
        as the primary at this moment (a backend asks at each connect and reconnect, so it
        follows a failover); otherwise the URL's own host and port."""
        if not self.sentinels:
            return self.host, self.port
        assert self.service is not None
        return primary_address(
            self.sentinels,
            self.service,
            self.connect_timeout,
            self.display,
            _cached_tls_context(self.ssl, os.environ.get("SSL_CERT_FILE"), tls_files_stamp(self.ssl))
            if self.tls
            else None,
            self.sentinel_password,
        )

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
            return f"{SENTINEL_SCHEMES[self.tls]}://{hosts}/{self.service}/{self.db}"
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
    if parts.scheme not in ("redis", "rediss", "unix", *SENTINEL_SCHEMES, *CLUSTER_SCHEMES):
        raise ValueError(
            f"url scheme must be redis://, rediss://, unix://, {'://, '.join(SENTINEL_SCHEMES)}:// or "
            f"{'://, '.join(CLUSTER_SCHEMES)}://, not {parts.scheme or '(none)'}://"
        )
    waiting = {"wait_replicas": wait_replicas, "wait_timeout": wait_timeout}
    if parts.scheme in CLUSTER_SCHEMES:
        query = parse_qs(parts.query)
        if parts.fragment or set(query) - {"client_name", *TLS_QUERY_NAMES}:
            raise ValueError(
                f"{parts.scheme}:// url takes no #fragment and no ?query but client_name and the ssl_* settings"
            )
        username, password, seeds = parse_sentinel_netloc(parts.netloc, parts.scheme, 6379)
        # A cluster has database 0 only; "/" and "/0" are accepted as the plain URL's habit.
        if _db_number(parts.path.strip("/")) != 0:
            raise ValueError(f"{parts.scheme}:// url: a cluster has database 0 only")
        return ServerConfig(
            url=url,
            host=seeds[0][0],
            port=seeds[0][1],
            tls=parts.scheme == CLUSTER_SCHEMES[1],
            ssl=_tls_options(query, parts.scheme, parts.scheme == CLUSTER_SCHEMES[1]),
            username=username,
            password=password,
            connect_timeout=connect_timeout,
            timeout=timeout,
            seeds=seeds,
            client_name=_client_name(query, parts.scheme),
            **waiting,  # type: ignore[arg-type]
        )
    if parts.scheme in SENTINEL_SCHEMES:
        tls = parts.scheme == SENTINEL_SCHEMES[1]
        query = parse_qs(parts.query)
        unknown = sorted(set(query) - {"sentinel_password", "client_name", *TLS_QUERY_NAMES})
        if unknown:
            raise ValueError(f"{parts.scheme}:// url: unknown setting {unknown[0]}")
        username, password, sentinels = parse_sentinel_netloc(parts.netloc, parts.scheme)
        service, _, db_text = parts.path.strip("/").partition("/")
        if not service:
            raise ValueError(f"{parts.scheme}:// url needs the primary's name, as in {parts.scheme}://h1,h2/mymaster")
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
            tls=tls,
            ssl=_tls_options(query, parts.scheme, tls),
            sentinel_password=query["sentinel_password"][-1] if "sentinel_password" in query else None,
            client_name=_client_name(query, parts.scheme),
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
        "client_name": _client_name(query, parts.scheme),
        **waiting,
    }
    if parts.scheme == "unix":
        _tls_options(query, parts.scheme, False)  # refuses ssl_* on a unix socket
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
        ssl=_tls_options(query, parts.scheme, parts.scheme == "rediss"),
        **common,  # type: ignore[arg-type]
    )


def _client_name(query: dict[str, list[str]], scheme: str) -> str | None:
    names = query.get("client_name")
    return None if names is None else check_client_name(names[-1], scheme)


def _db_number(text: str) -> int:
    try:
        db = int(text) if text else 0
    except ValueError:
        raise ValueError("url database number must be an integer") from None
    if db < 0:
        raise ValueError("url database number must not be negative")
    return db
