"""Bad input: TypeError/ValueError naming the argument, before any byte is sent, on every backend.

"Nothing sent" is checked against the server itself: INFO commandstats before and after.
"""

from __future__ import annotations

import math
import socket
import time
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import pytest
import redis

import hotlock
from hotlock import Cache

from .conftest import RedisServer, native_for_module

BAD_KEYS: list[tuple[Any, type[Exception], str]] = [
    (None, TypeError, "key must be str or bytes"),
    (42, TypeError, "key must be str or bytes"),
    ("", ValueError, "key must not be empty"),
    (b"", ValueError, "key must not be empty"),
    ("x" * 1025, ValueError, "1025 bytes"),
    ("\ud800", ValueError, "key cannot be encoded"),
]

BAD_TTLS: list[tuple[Any, type[Exception], str]] = [
    (0, ValueError, "ttl must be at least 1 ms"),
    (-1, ValueError, "ttl must be at least 1 ms"),
    (0.0001, ValueError, "ttl must be at least 1 ms"),
    (math.nan, ValueError, "ttl must be finite"),
    (math.inf, ValueError, "ttl must be finite"),
    (True, TypeError, "ttl must be seconds"),
    ("30", TypeError, "ttl must be seconds"),
    (None, TypeError, "ttl must be seconds"),
    (7 * 86400 + 1, ValueError, "7-day maximum"),
    (timedelta(days=8), ValueError, "7-day maximum"),
    (timedelta(0), ValueError, "ttl must be at least 1 ms"),
]

BAD_WAITS: list[tuple[Any, type[Exception], str]] = [
    (-0.5, ValueError, "wait must not be negative"),
    (math.nan, ValueError, "wait must be finite"),
    (False, TypeError, "wait must be seconds"),
    ("1", TypeError, "wait must be seconds"),
]


def commands_sent(client: redis.Redis) -> int:
    """Every command the server has run, except the INFO calls we look with."""
    stats = client.info("commandstats")
    return sum(v["calls"] for k, v in stats.items() if k not in ("cmdstat_info",))


def calls(cache: Cache) -> list[tuple[str, Callable[..., Any], dict[str, Any]]]:
    """Each public call with good arguments; a test swaps one for a bad value."""
    held = cache.lock("held", ttl=5)
    return [
        ("lock", cache.lock, {"key": "k", "ttl": 5}),
        ("lock_wait", cache.lock_wait, {"key": "k", "ttl": 5, "wait": 0}),
        ("with_lock", cache.with_lock, {"key": "k", "ttl": 5, "fn": lambda: None}),
        ("set_nx", cache.set_nx, {"key": "k", "value": "v", "ttl": 5}),
        ("incr", cache.incr, {"key": "k", "amount": 1}),
        ("extend", held.extend, {"ttl": 5}),
    ]


def check_nothing_sent(
    server: RedisServer, backend: str, fn: Callable[[], Any], exc: type[Exception], text: str
) -> None:
    before = commands_sent(server.client()) if backend != "memory" else 0
    with pytest.raises(exc, match=text):
        fn()
    if backend != "memory":
        assert commands_sent(server.client()) == before, "a bad argument must be refused before any I/O"


@pytest.mark.parametrize(("bad", "exc", "text"), BAD_KEYS, ids=[repr(b[0])[:12] for b in BAD_KEYS])
def test_bad_key(
    cache: Cache, backend: str, redis_server: RedisServer, bad: Any, exc: type[Exception], text: str
) -> None:
    for _name, fn, kwargs in calls(cache):
        if "key" in kwargs:
            check_nothing_sent(redis_server, backend, lambda fn=fn, kw=kwargs: fn(**{**kw, "key": bad}), exc, text)
    check_nothing_sent(
        redis_server, backend, lambda: cache.lock_many(["ok", bad]), exc, text.replace("key", r"keys\[1\]")
    )


@pytest.mark.parametrize(("bad", "exc", "text"), BAD_TTLS, ids=[repr(b[0])[:12] for b in BAD_TTLS])
def test_bad_ttl(
    cache: Cache, backend: str, redis_server: RedisServer, bad: Any, exc: type[Exception], text: str
) -> None:
    for name, fn, kwargs in calls(cache):
        if "ttl" in kwargs and not (name == "extend" and bad is None):  # extend(None): the lock's own TTL
            check_nothing_sent(redis_server, backend, lambda fn=fn, kw=kwargs: fn(**{**kw, "ttl": bad}), exc, text)
    locks = cache.lock_many(["a", "b"])
    check_nothing_sent(redis_server, backend, lambda: cache.lock_many(["c"], ttl=bad), exc, text)
    check_nothing_sent(redis_server, backend, lambda: cache.extend_many(locks, ttl=bad), exc, text)


@pytest.mark.parametrize(("bad", "exc", "text"), BAD_WAITS, ids=[repr(b[0])[:12] for b in BAD_WAITS])
def test_bad_wait(
    cache: Cache, backend: str, redis_server: RedisServer, bad: Any, exc: type[Exception], text: str
) -> None:
    check_nothing_sent(redis_server, backend, lambda: cache.lock_wait("k", ttl=5, wait=bad), exc, text)


def test_bad_values_and_amounts(cache: Cache, backend: str, redis_server: RedisServer) -> None:
    check_nothing_sent(redis_server, backend, lambda: cache.set_nx("k", None, ttl=5), TypeError, "value must be")  # type: ignore[arg-type]
    check_nothing_sent(redis_server, backend, lambda: cache.set_nx("k", 1.5, ttl=5), TypeError, "value must be")  # type: ignore[arg-type]
    check_nothing_sent(redis_server, backend, lambda: cache.incr("k", 1.0), TypeError, "amount must be an int")  # type: ignore[arg-type]
    check_nothing_sent(redis_server, backend, lambda: cache.incr("k", True), TypeError, "amount must be an int")
    check_nothing_sent(redis_server, backend, lambda: cache.incr("k", 2**63), ValueError, "64-bit")
    check_nothing_sent(
        redis_server, backend, lambda: cache.with_lock("k", 5, "not callable"), TypeError, "fn must be callable"
    )  # type: ignore[arg-type]


def test_bad_key_lists(cache: Cache, backend: str, redis_server: RedisServer) -> None:
    check_nothing_sent(redis_server, backend, lambda: cache.lock_many("abc"), TypeError, "keys must be an iterable")
    check_nothing_sent(redis_server, backend, lambda: cache.lock_many(None), TypeError, "keys must be an iterable")  # type: ignore[arg-type]
    check_nothing_sent(redis_server, backend, lambda: cache.lock_many(["a", "a"]), ValueError, "same key twice")
    check_nothing_sent(redis_server, backend, lambda: cache.unlock_many(["a"]), TypeError, r"locks\[0\] must be a Lock")  # type: ignore[list-item]
    check_nothing_sent(
        redis_server, backend, lambda: cache.extend_many(5, ttl=1), TypeError, "locks must be an iterable"
    )  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("kwargs", "exc", "text"),
    [
        ({"url": "http://x"}, ValueError, "scheme must be"),
        ({"url": "redis://h:99999"}, ValueError, "port must be"),
        ({"url": "redis://h/abc"}, ValueError, "database number"),
        ({"url": 5}, TypeError, "url must be str"),
        ({"url": "unix://"}, ValueError, "socket path"),
        ({"prefix": ""}, ValueError, "prefix must be"),
        ({"prefix": 3}, TypeError, "prefix must be"),
        ({"prefix": "app{1}:"}, ValueError, "must not contain"),
        ({"timeout": 0}, ValueError, "timeout must be"),
        ({"connect_timeout": math.inf}, ValueError, "connect_timeout must be"),
        ({"timeout": "1"}, TypeError, "timeout must be"),
        # Below 1 ms a socket timeout rounds to 0, "no timeout": a call would never end.
        ({"timeout": 4e-7}, ValueError, "timeout must be at least 0.001 s"),
        ({"connect_timeout": 0.0009}, ValueError, "connect_timeout must be at least 0.001 s"),
        ({"wait_replicas": 1, "wait_timeout": 0.0004}, ValueError, "wait_timeout must be at least 0.001 s"),
        ({"backend": "fast"}, ValueError, "backend must be"),
        ({"url": "redis+cluster://"}, ValueError, "at least one node"),
        ({"url": "redis+cluster://app:s3cret@"}, ValueError, "at least one node"),
        ({"url": "rediss+cluster://:7000"}, ValueError, "needs a host"),
        ({"url": "redis+cluster://h1:7000,h2:x"}, ValueError, "port must be a number"),
        ({"url": "redis+cluster://h1:70000"}, ValueError, "port from 1 to 65535"),
        ({"url": "redis+cluster://h1:7000/1"}, ValueError, "database 0 only"),
        ({"url": "redis+cluster://h1:7000/db"}, ValueError, "database number"),
        ({"url": "redis+cluster://h1:7000?db=2"}, ValueError, "takes no"),
    ],
)
def test_bad_connect_arguments(kwargs: dict[str, Any], exc: type[Exception], text: str) -> None:
    with pytest.raises(exc, match=text):
        hotlock.connect(**{"url": "redis://127.0.0.1:1/0", **kwargs})


@pytest.mark.parametrize("url", ["redis+cluster://", "redis+cluster://h:1/2", "redis+cluster://h:x"])
def test_bad_cluster_url_sends_nothing(url: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """A bad cluster URL is refused before any socket is opened (from connect and from CACHE_URL)."""
    import socket

    def no_io(*args: object, **kwargs: object) -> None:
        raise AssertionError("a bad url must be refused before any I/O")

    monkeypatch.setattr(socket, "create_connection", no_io)
    monkeypatch.setattr(socket.socket, "connect", no_io)
    with pytest.raises(ValueError):
        hotlock.connect(url)
    monkeypatch.setenv("CACHE_URL", url)
    with pytest.raises(ValueError):
        hotlock.connect()


def test_cluster_url_form() -> None:
    from hotlock._config import parse_url

    config = parse_url("rediss+cluster://app:s3cret@10.0.0.1:7000,10.0.0.2,[::1]:7001/", connect_timeout=1, timeout=1)
    assert config.seeds == (("10.0.0.1", 7000), ("10.0.0.2", 6379), ("::1", 7001))
    assert (config.username, config.password, config.tls, config.db) == ("app", "s3cret", True, 0)
    assert config.display == "rediss+cluster://10.0.0.1:7000,10.0.0.2:6379,[::1]:7001"
    assert "s3cret" not in repr(config)
    node = config.node("10.0.0.3", 7002)
    assert (node.host, node.port, node.seeds, node.password, node.tls) == ("10.0.0.3", 7002, (), "s3cret", True)
    assert parse_url("redis+cluster://h:7000/0", connect_timeout=1, timeout=1).seeds == (("h", 7000),)


def test_no_url_refuses_options_that_need_a_server(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("CACHE_URL", raising=False)
    with pytest.raises(ValueError, match="backend='native' needs a url"):
        hotlock.connect(None, backend="native")
    with pytest.raises(ValueError, match="wait_replicas=1 needs a url"):
        hotlock.connect(None, wait_replicas=1)


def test_url_password_never_in_errors() -> None:
    with pytest.raises(ValueError) as info:
        hotlock.connect("redis://user:s3cret@127.0.0.1:99999/0")
    assert "s3cret" not in str(info.value)
    with pytest.raises(hotlock.CacheError) as info2:
        hotlock.connect("redis://user:s3cret@127.0.0.1:1/0", connect_timeout=0.2, backend="redis-py")
    assert "s3cret" not in str(info2.value) and "127.0.0.1:1" in str(info2.value)


@pytest.mark.parametrize("backend", ["native", "redis-py"])
def test_shortest_timeout_still_ends_the_call(backend: str) -> None:
    """The smallest timeout connect() takes (1 ms) bounds a call to a server that accepts
    and never answers: a CacheError in about a millisecond, never a wait without end."""
    if backend == "native":
        native_for_module()
    silent = socket.socket()
    silent.bind(("127.0.0.1", 0))
    silent.listen(8)  # the kernel completes the handshake; nobody ever reads or replies
    try:
        url = f"redis://127.0.0.1:{silent.getsockname()[1]}"
        started = time.monotonic()
        with pytest.raises(hotlock.CacheError):
            hotlock.connect(url, timeout=0.001, connect_timeout=0.001, backend=backend)
        assert time.monotonic() - started < 5.0
    finally:
        silent.close()
