"""Sentinel: parse ``redis+sentinel://`` URLs and ask the sentinels where the primary is.

Plain sockets and a few lines of RESP, so a backend (the native one included) can resolve
the primary at each (re)connect without importing redis-py.
"""

from __future__ import annotations

import socket
from urllib.parse import unquote

from .errors import CacheError

__all__ = ["SCHEME", "parse_sentinel_netloc", "primary_address"]

SCHEME = "redis+sentinel"


def parse_sentinel_netloc(netloc: str) -> tuple[str | None, str | None, tuple[tuple[str, int], ...]]:
    """``[user[:password]@]host[:port][,host[:port]...]`` -> (user, password, sentinels).

    The credentials are the data nodes' (the primary and its replicas); sentinels are
    asked without them. A port defaults to 26379, Sentinel's own.
    """
    userinfo, _, hosts = netloc.rpartition("@")
    username = password = None
    if userinfo:
        user, colon, pw = userinfo.partition(":")
        username = unquote(user) or None
        password = unquote(pw) if colon else None
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
            port = int(port_text) if port_text else 26379
        except ValueError:
            raise ValueError("redis+sentinel:// url: each sentinel port must be a number") from None
        if not host or not 0 < port < 65536:
            raise ValueError("redis+sentinel:// url: each sentinel needs a host and a port from 1 to 65535")
        sentinels.append((host, port))
    if not sentinels:
        raise ValueError(
            "redis+sentinel:// url needs at least one sentinel, as in redis+sentinel://h1:26379,h2:26379/mymaster"
        )
    return username, password, tuple(sentinels)


def _command(*args: bytes) -> bytes:
    out = [b"*%d\r\n" % len(args)]
    for a in args:
        out.append(b"$%d\r\n%s\r\n" % (len(a), a))
    return b"".join(out)


def _ask(host: str, port: int, service: str, timeout: float) -> tuple[str, int] | None:
    """One sentinel's answer to SENTINEL get-master-addr-by-name: an address, or None."""
    with socket.create_connection((host, port), timeout=timeout) as sock:
        sock.settimeout(timeout)
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
    sentinels: tuple[tuple[str, int], ...], service: str, timeout: float, display: str
) -> tuple[str, int]:
    """The primary's (host, port) for ``service``, from the first sentinel that knows it.

    Raises CacheError naming the service when no sentinel answers with an address.
    """
    errors = []
    for host, port in sentinels:
        try:
            found = _ask(host, port, service, timeout)
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
