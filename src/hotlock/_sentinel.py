"""Sentinel: parse ``redis+sentinel://`` URLs and ask the sentinels where the primary is.

Plain sockets and a few lines of RESP, so a backend (the native one included) can resolve
the primary at each (re)connect without importing redis-py.
"""

from __future__ import annotations

import contextlib
import socket
import ssl
import threading
import time
from collections.abc import Callable
from urllib.parse import unquote

from .errors import CacheError

__all__ = ["SCHEME", "SCHEMES", "PrimaryWatch", "parse_sentinel_netloc", "primary_address"]

SCHEME = "redis+sentinel"
# rediss+sentinel://: TLS to the sentinels and to the primary they name.
SCHEMES = (SCHEME, "rediss+sentinel")


def parse_sentinel_netloc(
    netloc: str, scheme: str = SCHEME, default_port: int = 26379
) -> tuple[str | None, str | None, tuple[tuple[str, int], ...]]:
    """``[user[:password]@]host[:port][,host[:port]...]`` -> (user, password, hosts).

    The credentials are the data nodes' (the primary and its replicas); sentinels are
    asked without them. A port defaults to 26379, Sentinel's own. redis+cluster:// URLs
    list their seed nodes the same way (``scheme`` and ``default_port`` say so).
    """
    userinfo, _, hosts = netloc.rpartition("@")
    username = password = None
    if userinfo:
        user, colon, pw = userinfo.partition(":")
        username = unquote(user) or None
        password = unquote(pw) if colon else None
    what = "sentinel" if scheme in SCHEMES else "node"
    sentinels = []
    for item in hosts.split(","):
        item = item.strip()
        if not item:
            continue
        if item.startswith("["):  # [ipv6]:port
            host, _, rest = item[1:].partition("]")
            port_text = rest.lstrip(":")
        else:
            host, _, port_text = item.partition(":")
        try:
            port = int(port_text) if port_text else default_port
        except ValueError:
            raise ValueError(f"{scheme}:// url: each {what} port must be a number") from None
        if not host or not 0 < port < 65536:
            raise ValueError(f"{scheme}:// url: each {what} needs a host and a port from 1 to 65535")
        sentinels.append((host, port))
    if not sentinels:
        example = "h1:26379,h2:26379/mymaster" if scheme in SCHEMES else "h1:7000,h2:7000"
        raise ValueError(f"{scheme}:// url needs at least one {what}, as in {scheme}://{example}")
    return username, password, tuple(sentinels)


def _command(*args: bytes) -> bytes:
    out = [b"*%d\r\n" % len(args)]
    for a in args:
        out.append(b"$%d\r\n%s\r\n" % (len(a), a))
    return b"".join(out)


def _ask(
    host: str,
    port: int,
    service: str,
    timeout: float,
    tls: ssl.SSLContext | None = None,
    password: str | None = None,
) -> tuple[str, int] | None:
    """One sentinel's answer to SENTINEL get-master-addr-by-name: an address, or None.

    Over TLS when ``tls`` (the sentinel's certificate checked against ``host``); AUTH with
    the sentinels' own ``password`` first when given (requirepass on the sentinels)."""
    with contextlib.ExitStack() as stack:
        sock: socket.socket = stack.enter_context(socket.create_connection((host, port), timeout=timeout))
        if tls is not None:
            # The TLS socket takes over the descriptor: it is the one to close.
            sock = stack.enter_context(tls.wrap_socket(sock, server_hostname=host))
        sock.settimeout(timeout)
        if password is not None:
            sock.sendall(_command(b"AUTH", password.encode()))
            line = b""
            while not line.endswith(b"\r\n"):
                chunk = sock.recv(4096)
                if not chunk:
                    raise OSError("sentinel closed the connection")
                line += chunk
            if not line.startswith(b"+OK"):
                raise OSError(f"AUTH: {line.strip()[1:].decode('utf-8', 'replace')}")
        sock.sendall(_command(b"SENTINEL", b"get-master-addr-by-name", service.encode()))
        data = b""
        # The reply is small: "*2\r\n$9\r\n127.0.0.1\r\n$4\r\n6379\r\n", or "*-1\r\n" when unknown.
        while True:
            chunk = sock.recv(4096)
            if not chunk:
                raise OSError("sentinel closed the connection")
            data += chunk
            if data.startswith((b"*-1\r\n", b"_\r\n", b"-")):
                if data.startswith(b"-"):
                    raise OSError(data.split(b"\r\n", 1)[0][1:].decode("utf-8", "replace"))
                return None
            lines = data.split(b"\r\n")
            if data.startswith(b"*2\r\n") and len(lines) >= 6:
                return lines[2].decode(), int(lines[4])


def primary_address(
    sentinels: tuple[tuple[str, int], ...],
    service: str,
    timeout: float,
    display: str,
    tls: ssl.SSLContext | None = None,
    password: str | None = None,
) -> tuple[str, int]:
    """The primary's (host, port) for ``service``, from the first sentinel that knows it.

    Raises CacheError naming the service when no sentinel answers with an address.
    """
    errors = []
    for host, port in sentinels:
        try:
            found = _ask(host, port, service, timeout, tls, password)
        except ssl.SSLCertVerificationError as exc:
            # The same certificate would fail the same way at every sentinel's next ask.
            errors.append(f"{host}:{port}: TLS: certificate verify failed: {exc.verify_message or exc}")
            continue
        except (OSError, ValueError) as exc:
            errors.append(f"{host}:{port}: {exc or type(exc).__name__}")
            continue
        if found is not None:
            return found
        errors.append(f"{host}:{port}: no primary named {service!r}")
    raise CacheError(
        f"no sentinel gave the primary of {service!r} ({'; '.join(errors)}) (server {display})",
        server=display,
    )


class PrimaryWatch:
    """Which primary the sentinels name, asked again at most every REFRESH_S seconds.

    A connection made before a failover keeps talking to the old primary, which may go on
    accepting writes until Sentinel demotes it (it looks at a replica's INFO every 10 s):
    locks granted there are lost with it. So a backend calls ``refresh()`` before each
    call, a clock read except every REFRESH_S, when it asks the sentinels; ``epoch`` goes
    up whenever they name another primary, and a connection made in an older epoch is
    dropped and remade. That bounds how long a client keeps writing to a replaced primary
    to REFRESH_S after the sentinels switch, for one sentinel round trip per REFRESH_S
    per process.
    """

    REFRESH_S = 0.5

    def __init__(self, ask: Callable[[], tuple[str, int]]) -> None:
        self._ask = ask  # ServerConfig.primary
        self._address: tuple[str, int] | None = None
        self._asked = 0.0
        self.epoch = 0
        self._mutex = threading.Lock()

    def address(self) -> tuple[str, int]:
        """Ask the sentinels now (at each connect); raises CacheError if none answers."""
        found = self._ask()
        self._note(found)
        return found

    def due(self) -> bool:
        """Whether refresh() would ask the sentinels now (async code then runs it off the loop)."""
        return time.monotonic() - self._asked >= self.REFRESH_S

    def refresh(self) -> int:
        """The current epoch, after asking the sentinels again if REFRESH_S has passed."""
        now = time.monotonic()
        with self._mutex:
            if now - self._asked < self.REFRESH_S:
                return self.epoch
            # Whatever the outcome, not again before REFRESH_S: sentinels that do not
            # answer must not cost every call a connect timeout.
            self._asked = now
        # No answer is no news: the connection we have answers or fails on its own.
        with contextlib.suppress(CacheError):
            self._note(self._ask())
        return self.epoch

    def _note(self, found: tuple[str, int]) -> None:
        with self._mutex:
            self._asked = time.monotonic()
            if self._address is not None and found != self._address:
                self.epoch += 1
            self._address = found
