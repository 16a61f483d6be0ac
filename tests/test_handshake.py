"""What every new connection does before the first lock, on every path (native and redis-py,
sync and async, one server or a cluster, the data connections and the wake-up subscribers):
it names itself (CLIENT SETINFO lib-name hotlock and lib-ver, CLIENT SETNAME from
?client_name=), turns TCP keepalive on, and reports a refusal as one. Against real servers:
Redis 7.0 refuses CLIENT SETINFO (it came in 7.2), Valkey 9 takes it.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import secrets
import shutil
import socket
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Coroutine, Iterator
from pathlib import Path
from typing import Any, TypeVar

import pytest
import redis
import uvloop

import hotlock
import hotlock.aio
from hotlock._config import KEEPALIVE_OPTIONS, lib_version, parse_url

from .conftest import BACKENDS, RedisServer, start_redis
from .fakeserver import FakeRedis, honest
from .tls import Pki, TLSCluster, TLSServer, start_tls_cluster, start_tls_redis

T = TypeVar("T")

REDIS_BACKENDS = [b for b in BACKENDS if b != "memory"]
NAME = "billing-worker-7"


def fresh(name: str) -> str:
    """A client name no earlier test used: a connection a previous test closed may still be
    listed by CLIENT LIST for a moment (the server has not read its EOF yet), and its socket
    is gone from this process."""
    return f"{name}-{secrets.token_hex(4)}"


def run(loop: str, coro: Coroutine[Any, Any, T]) -> T:
    if sys.version_info < (3, 11):
        return uvloop.run(coro) if loop == "uvloop" else asyncio.run(coro)
    with asyncio.Runner(loop_factory=uvloop.new_event_loop if loop == "uvloop" else None) as runner:
        return runner.run(coro)


def clients(nodes: list[redis.Redis], name: str) -> list[dict[str, Any]]:
    """CLIENT LIST entries named ``name`` on every node."""
    return [c for node in nodes for c in node.client_list() if c.get("name") == name]


def wait_for(what: Callable[[], T], ok: Callable[[T], bool], timeout: float = 10.0) -> T:
    deadline = time.monotonic() + timeout
    while True:
        got = what()
        if ok(got) or time.monotonic() > deadline:
            return got
        time.sleep(0.02)


def our_sockets() -> dict[tuple[int, int], int]:
    """This process's TCP sockets: (local port, remote port) -> file descriptor (from /proc).
    Both ports: one local port may serve two connections of this process to two servers."""
    inodes = {}
    for fd in os.listdir("/proc/self/fd"):
        with contextlib.suppress(OSError):
            link = os.readlink(f"/proc/self/fd/{fd}")
            if link.startswith("socket:["):
                inodes[int(link[8:-1])] = int(fd)
    ports = {}
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with contextlib.suppress(OSError), open(table) as lines:
            for line in list(lines)[1:]:
                fields = line.split()
                inode = int(fields[9])
                if inode in inodes:
                    local, remote = (int(fields[i].rsplit(":", 1)[1], 16) for i in (1, 2))
                    ports[local, remote] = inodes[inode]
    return ports


def keepalive_of(fd: int) -> tuple[int, dict[int, int]]:
    """SO_KEEPALIVE and the TCP keepalive options of the socket at ``fd`` (read on a dup)."""
    sock = socket.socket(fileno=os.dup(fd))
    try:
        on = sock.getsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE)
        return on, {option: sock.getsockopt(socket.IPPROTO_TCP, option) for option in KEEPALIVE_OPTIONS}
    finally:
        sock.close()


def assert_named_and_kept_alive(found: list[dict[str, Any]], kind: str) -> None:
    """Each connection is named, says what opened it where the server knows CLIENT SETINFO,
    and has TCP keepalive on with libhiredis's intervals; the subscriber is among them."""
    assert any("P" in c["flags"] for c in found), found  # the wake-up subscriber
    assert any("P" not in c["flags"] for c in found), found  # a data connection
    sockets = our_sockets()
    for c in found:
        if kind == "valkey":
            assert (c.get("lib-name"), c.get("lib-ver")) == ("hotlock", lib_version()), c
        else:  # Redis 7.0: CLIENT SETINFO refused, and ignored
            assert not c.get("lib-name"), c
        ports = int(c["addr"].rsplit(":", 1)[1]), int(c["laddr"].rsplit(":", 1)[1])
        assert ports in sockets, (c, sorted(sockets))
        assert keepalive_of(sockets[ports]) == (1, KEEPALIVE_OPTIONS), c


def contend_sync(cache: hotlock.Cache, key: str) -> None:
    """A lock_wait that finds its key held long enough to start the wake-up subscriber."""
    with cache.lock(key, ttl=5), pytest.raises(hotlock.LockNotAcquired):
        cache.lock_wait(key, ttl=5, wait=0.3)


async def contend_async(cache: hotlock.aio.AsyncCache, key: str) -> None:
    async with cache.lock(key, ttl=5):
        with pytest.raises(hotlock.LockNotAcquired):
            await cache.lock_wait(key, ttl=5, wait=0.3)


@pytest.fixture
def nodes(topology: str, server_kind: str, request: pytest.FixtureRequest) -> list[redis.Redis]:
    """Clients to look at every server of this test's topology from the side."""
    if topology == "cluster":
        cluster = request.getfixturevalue("redis_cluster")
        return [cluster.client(port) for port in cluster.primary_ports()]
    server: RedisServer = request.getfixturevalue("redis_server")
    return [server.client()]


def named_url(url: str, name: str = NAME) -> str:
    return f"{url}{'&' if '?' in url else '?'}client_name={name}"


# -- naming and keepalive, every path ---------------------------------------------------------


@pytest.mark.topologies("single", "cluster")
@pytest.mark.parametrize("backend", REDIS_BACKENDS)
def test_every_sync_connection_is_named_and_kept_alive(
    backend: str, topology: str, server_kind: str, server_url: str, nodes: list[redis.Redis]
) -> None:
    name = fresh(NAME)
    cache = hotlock.connect(named_url(server_url, name), backend=backend)
    try:
        contend_sync(cache, "named")
        found = wait_for(lambda: clients(nodes, name), lambda f: any("P" in c["flags"] for c in f))
        assert_named_and_kept_alive(found, server_kind)
    finally:
        cache.close()


@pytest.mark.topologies("single", "cluster")
@pytest.mark.parametrize("loop", ["asyncio", "uvloop"])
@pytest.mark.parametrize("backend", REDIS_BACKENDS)
def test_every_async_connection_is_named_and_kept_alive(
    backend: str, loop: str, topology: str, server_kind: str, server_url: str, nodes: list[redis.Redis]
) -> None:
    name = fresh(NAME)

    async def main() -> list[dict[str, Any]]:
        cache = await hotlock.aio.connect(named_url(server_url, name), backend=backend)
        try:
            await contend_async(cache, "named")
            deadline = time.monotonic() + 10
            while True:
                # Looked at from a thread: the side client blocks, the loop must go on.
                found = await asyncio.to_thread(clients, nodes, name)
                if any("P" in c["flags"] for c in found) or time.monotonic() > deadline:
                    break
                await asyncio.sleep(0.02)
            await asyncio.to_thread(assert_named_and_kept_alive, found, server_kind)
            return found
        finally:
            await cache.close()

    assert run(loop, main())


def test_an_unnamed_connection_says_what_opened_it(redis_backend: str, redis_server: RedisServer) -> None:
    before = {c["id"] for c in redis_server.client().client_list()}
    cache = hotlock.connect(redis_server.url, backend=redis_backend)
    try:
        cache.lock("x", ttl=1).unlock()
        mine = [c for c in redis_server.client().client_list() if c["id"] not in before and c["cmd"] != "client|list"]
        assert mine and all(c["name"] == "" for c in mine), mine
        if redis_server.kind == "valkey":
            assert all(c.get("lib-name") == "hotlock" for c in mine), mine
    finally:
        cache.close()


@pytest.fixture
def no_setinfo_user(redis_server: RedisServer) -> Iterator[str]:
    """A URL for an ACL user allowed everything but CLIENT SETINFO (which Redis 7.0 does not
    know: there the server refuses it by itself)."""
    side = redis_server.client()
    deny = ["-client|setinfo"] if redis_server.kind == "valkey" else []
    side.execute_command("ACL", "SETUSER", "nosetinfo", "on", ">pw", "~*", "&*", "+@all", *deny)
    yield redis_server.url.replace("redis://", "redis://nosetinfo:pw@")
    side.execute_command("ACL", "DELUSER", "nosetinfo")


@pytest.mark.parametrize("aio", [False, True], ids=["sync", "async"])
def test_a_refused_client_setinfo_is_ignored(
    redis_backend: str, aio: bool, no_setinfo_user: str, redis_server: RedisServer
) -> None:
    """An ACL without CLIENT SETINFO (or a server before 7.2) costs nothing: the name is
    still set, every lock works, the subscriber too."""
    name = fresh(NAME)
    url = named_url(no_setinfo_user, name)
    if aio:

        async def main() -> None:
            cache = await hotlock.aio.connect(url, backend=redis_backend)
            try:
                await contend_async(cache, "acl")
                async with cache.lock("acl2", ttl=1):
                    pass
            finally:
                await cache.close()

        run("asyncio", main())
    else:
        cache = hotlock.connect(url, backend=redis_backend)
        try:
            contend_sync(cache, "acl")
            with cache.lock("acl2", ttl=1):
                pass
            found = wait_for(lambda: clients([redis_server.client()], name), lambda f: len(f) >= 2)
            assert found and all(c["user"] == "nosetinfo" and not c.get("lib-name") for c in found), found
        finally:
            cache.close()


@pytest.mark.parametrize("name", ["", "two words", "line\nbreak", "tab\there", "caf\u00e9", "x" * 257], ids=repr)
def test_a_bad_client_name_is_refused_before_any_io(name: str) -> None:
    from urllib.parse import quote

    for url in (
        "redis://127.0.0.1:1/0?client_name=",
        "redis+cluster://127.0.0.1:1?client_name=",
        "redis+sentinel://127.0.0.1:1/mymaster?client_name=",
        "unix:///nowhere.sock?client_name=",
    ):
        if not name:
            # An empty value is no value (parse_qs drops it): no name, as without the setting.
            assert parse_url(url, connect_timeout=1, timeout=1).client_name is None
            continue
        with pytest.raises(ValueError, match="client_name must be"):
            hotlock.connect(url + quote(name))


def test_client_name_is_taken_by_every_url_scheme() -> None:
    for url in (
        "redis://h/0?client_name=a",
        "rediss://h?client_name=a",
        "unix:///s.sock?db=1&client_name=a",
        "redis+cluster://h1,h2?client_name=a",
        "redis+sentinel://h1/m?client_name=a",
    ):
        config = parse_url(url, connect_timeout=1, timeout=1)
        assert config.client_name == "a", url
        assert config.node("10.0.0.1", 7000).client_name == "a"


# -- errors that say what failed --------------------------------------------------------------


@pytest.fixture(scope="module")
def password_server() -> Iterator[RedisServer]:
    """A server of its own whose password is "right" (its side client authenticated before)."""
    server = start_redis()
    server.client().config_set("requirepass", "right")
    server.url = f"redis://:right@127.0.0.1:{server.port}/0"
    yield server
    server.stop()


@pytest.mark.parametrize("aio", [False, True], ids=["sync", "async"])
def test_a_wrong_password_is_an_authentication_failure(
    redis_backend: str, aio: bool, password_server: RedisServer
) -> None:
    url = f"redis://:wrong@127.0.0.1:{password_server.port}/0"
    with pytest.raises(hotlock.CacheError) as caught:
        if aio:
            run("asyncio", hotlock.aio.connect(url, backend=redis_backend))
        else:
            hotlock.connect(url, backend=redis_backend)
    text = str(caught.value)
    assert "lost reply" not in text
    assert "WRONGPASS" in text
    assert "authentication failed" in text


# -- the wake-up subscriber: a refusal said once ----------------------------------------------


@pytest.mark.parametrize("aio", [False, True], ids=["sync", "async"])
def test_a_subscriber_refused_says_so_once_then_says_it_recovered(
    aio: bool, password_server: RedisServer, caplog: pytest.LogCaptureFixture
) -> None:
    """The subscriber's connection is cut and the password changed under it: it tries again
    every second or so, and a WARNING says why once (DEBUG after that); when the password
    is right again it connects, and says so."""
    side = password_server.client()
    caplog.set_level(logging.DEBUG, logger="hotlock")

    def refused_then_fixed() -> None:
        side.config_set("requirepass", "changed")
        try:
            side.client_kill_filter(_type="pubsub")
            wait_for(
                lambda: [r for r in caplog.records if r.levelno == logging.DEBUG and "AUTH refused" in r.getMessage()],
                lambda debug: len(debug) >= 2,
            )
        finally:
            side.config_set("requirepass", "right")
        wait_for(lambda: [r for r in caplog.records if r.getMessage().startswith("wake-ups: connected to")], bool)

    # The side client authenticates once, on a connection the change leaves as it is.
    side.ping()
    if aio:

        async def main() -> None:
            cache = await hotlock.aio.connect(password_server.url, backend="native" if "native" in BACKENDS else None)
            try:
                await contend_async(cache, "sub")
                await asyncio.to_thread(refused_then_fixed)
            finally:
                await cache.close()

        run("asyncio", main())
    else:
        cache = hotlock.connect(password_server.url)
        try:
            contend_sync(cache, "sub")
            refused_then_fixed()
        finally:
            cache.close()
    said = [(r.levelname, r.getMessage()) for r in caplog.records if r.name == "hotlock"]
    warnings = [m for level, m in said if level == "WARNING" and "AUTH refused" in m]
    assert len(warnings) == 1, said
    assert "WRONGPASS" in warnings[0], said
    assert sum(level == "DEBUG" and "AUTH refused" in m for level, m in said) >= 2, said
    assert any(level == "INFO" and m.startswith("wake-ups: connected to") for level, m in said), said


def test_subscriber_logs_a_new_error_at_warning_again() -> None:
    from hotlock.backends.wakeup import ConnectTrouble, Refused

    records: list[logging.LogRecord] = []

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            records.append(record)

    logger = logging.getLogger("hotlock")
    handler = Keep(logging.DEBUG)
    logger.addHandler(handler)
    old = logger.level
    logger.setLevel(logging.DEBUG)
    try:
        trouble = ConnectTrouble("redis://h:1/0")
        trouble.failed(ConnectionRefusedError("refused"))  # passing: DEBUG
        for _ in range(3):
            trouble.failed(Refused("AUTH refused: WRONGPASS"))
        trouble.failed(Refused("CLIENT SETNAME refused: NOPERM"))
        trouble.connected()
        trouble.connected()
    finally:
        logger.removeHandler(handler)
        logger.setLevel(old)
    levels = [(r.levelname, r.getMessage().split(": ", 2)[-1][:26]) for r in records]
    assert [lv for lv, _ in levels] == ["DEBUG", "WARNING", "DEBUG", "DEBUG", "WARNING", "INFO"], levels


# -- a cluster node announced with no endpoint -------------------------------------------------


@pytest.mark.parametrize("announced", [b"$0\r\n\r\n", b"$1\r\n?\r\n", b"$-1\r\n"], ids=["empty", "question", "nil"])
@pytest.mark.parametrize("aio", [False, True], ids=["sync", "async"])
def test_an_unknown_endpoint_in_cluster_slots_is_the_seed_host(redis_backend: str, aio: bool, announced: bytes) -> None:
    """CLUSTER SLOTS naming a primary by "", "?" or nil (the node does not know the address
    clients use) means the host the client asked, as in redis-py: the locks go there."""
    port_holder: list[int] = []

    def answer(command: list[bytes], scripts: dict[bytes, str]) -> bytes:
        if command[0].upper() == b"CLUSTER" and command[1].upper() == b"SLOTS":
            node = b"*2\r\n" + announced + b":%d\r\n" % port_holder[0]
            return b"*1\r\n*3\r\n:0\r\n:16383\r\n" + node
        if command[0].upper() == b"CLUSTER":
            return b"-ERR unknown subcommand\r\n"  # no CLUSTER SHARDS: SLOTS is asked
        return honest(command, scripts)

    with FakeRedis(answer) as fake:
        port_holder.append(fake.port)
        url = f"redis+cluster://localhost:{fake.port}"
        if aio:

            async def main() -> int:
                cache = await hotlock.aio.connect(url, backend=redis_backend, wakeups=False)
                try:
                    lock = await cache.lock("k", ttl=1)
                    return lock.fence
                finally:
                    await cache.close()

            fence = run("asyncio", main())
        else:
            cache = hotlock.connect(url, backend=redis_backend, wakeups=False)
            try:
                fence = cache.lock("k", ttl=1).fence
            finally:
                cache.close()
        assert fence > 0
        assert fake.count(b"EXEC") >= 1  # the acquire's transaction reached the seed host


def test_unknown_endpoints_parse_as_the_asked_host() -> None:
    from hotlock.backends.cluster import parse_shards, parse_slots

    slots = [[0, 99, [b"", 7000]], [100, 199, [b"?", 7001]], [200, 16383, [None, 7002]], [5, 5, [b"10.0.0.9", 7003]]]
    assert [a for _, _, a in parse_slots(slots, "seed.example")] == [
        ("seed.example", 7000),
        ("seed.example", 7001),
        ("seed.example", 7002),
        ("10.0.0.9", 7003),
    ]
    shard = [
        b"slots",
        [0, 16383],
        b"nodes",
        [[b"role", b"master", b"endpoint", b"?", b"ip", b"10.1.1.1", b"port", 7000]],
    ]
    assert parse_shards([shard], False, "seed.example") == [(0, 16383, ("seed.example", 7000))]


# -- TLS: a server name for nodes announced by IP, certificate files read again -------------

INTERNAL = "redis.internal"  # the only name in the certificates below: no IP SAN


@pytest.fixture(scope="module")
def pki() -> Iterator[Pki]:
    with tempfile.TemporaryDirectory(prefix="hotlock-pki-") as d:
        yield Pki.make(Path(d))


@pytest.fixture(scope="module")
def internal(pki: Pki) -> Iterator[TLSServer]:
    """A TLS server whose certificate names redis.internal only, reached as 127.0.0.1."""
    server = start_tls_redis(pki, "internal", f"DNS:{INTERNAL}")
    yield server
    server.stop()


@pytest.fixture(scope="module")
def internal_cluster(pki: Pki) -> Iterator[TLSCluster]:
    """A TLS cluster announcing its nodes as 127.0.0.1, each with a certificate for
    redis.internal only (as a managed cluster behind one DNS name does)."""
    cluster = start_tls_cluster(pki, sans=f"DNS:{INTERNAL}")
    yield cluster
    cluster.stop()


def with_tls(url: str, ca: Path, **query: str) -> str:
    extra = "&".join(f"{k}={v}" for k, v in {"ssl_ca_certs": str(ca), **query}.items())
    return f"{url}{'&' if '?' in url else '?'}{extra}"


def tls_ip_url(server: TLSServer) -> str:
    return f"rediss://127.0.0.1:{server.tls_port}/0"


@pytest.mark.parametrize("aio", [False, True], ids=["sync", "async"])
def test_without_ssl_server_name_a_node_announced_by_ip_fails_its_check(
    redis_backend: str, aio: bool, internal: TLSServer
) -> None:
    url = with_tls(tls_ip_url(internal), internal.ca)
    with pytest.raises(hotlock.CacheError, match=r"(?i)mismatch") as caught:
        if aio:
            run("asyncio", hotlock.aio.connect(url, backend=redis_backend))
        else:
            hotlock.connect(url, backend=redis_backend)
    assert "retried" not in str(caught.value)


@pytest.mark.parametrize("aio", [False, True], ids=["sync", "async"])
def test_ssl_server_name_is_checked_in_place_of_the_ip(redis_backend: str, aio: bool, internal: TLSServer) -> None:
    """The server is reached by IP; its certificate is checked against ssl_server_name, on
    the data connections and the subscriber alike; a name it does not carry is refused."""
    name = fresh("by-name")
    url = with_tls(tls_ip_url(internal), internal.ca, ssl_server_name=INTERNAL, client_name=name)
    side = internal.plain.client()
    if aio:

        async def main() -> None:
            cache = await hotlock.aio.connect(url, backend=redis_backend)
            try:
                await contend_async(cache, "tls")
                found = await asyncio.to_thread(
                    wait_for, lambda: clients([side], name), lambda f: any("P" in c["flags"] for c in f)
                )
                assert any("P" in c["flags"] for c in found), found
            finally:
                await cache.close()

        run("asyncio", main())
    else:
        cache = hotlock.connect(url, backend=redis_backend)
        try:
            contend_sync(cache, "tls")
            found = wait_for(lambda: clients([side], name), lambda f: any("P" in c["flags"] for c in f))
            assert any("P" in c["flags"] for c in found), found
        finally:
            cache.close()
    wrong = with_tls(tls_ip_url(internal), internal.ca, ssl_server_name="other.internal")
    with pytest.raises(hotlock.CacheError, match=r"(?i)mismatch"):
        hotlock.connect(wrong, backend=redis_backend)


@pytest.mark.parametrize("aio", [False, True], ids=["sync", "async"])
def test_ssl_server_name_reaches_every_node_of_a_cluster_announced_by_ip(
    redis_backend: str, aio: bool, internal_cluster: TLSCluster
) -> None:
    for node in internal_cluster.nodes:
        node.plain.client().flushall()
    name = fresh("c")
    url = internal_cluster.url(ssl_ca_certs=str(internal_cluster.ca), ssl_server_name=INTERNAL, client_name=name)
    sides = [node.plain.client() for node in internal_cluster.nodes]
    keys = [f"k{i}" for i in range(30)]
    if aio:

        async def main() -> None:
            cache = await hotlock.aio.connect(url, backend=redis_backend)
            try:
                locks = await cache.lock_many(keys, ttl=5)
                assert all(lock is not None for lock in locks)
                await contend_async(cache, "tls")
                # The node's sharded subscriber, connected (over TLS, checked by name) before close().
                found = await asyncio.to_thread(
                    wait_for, lambda: clients(sides, name), lambda f: any("P" in c["flags"] for c in f)
                )
                assert any("P" in c["flags"] for c in found), found
            finally:
                await cache.close()

        run("asyncio", main())
    else:
        cache = hotlock.connect(url, backend=redis_backend)
        try:
            locks = cache.lock_many(keys, ttl=5)
            assert all(lock is not None for lock in locks)
            assert all(side.dbsize() > 0 for side in sides)  # every primary reached
            contend_sync(cache, "tls")
            found = wait_for(lambda: clients(sides, name), lambda f: any("P" in c["flags"] for c in f))
            assert any("P" in c["flags"] for c in found), found  # the node's sharded subscriber
        finally:
            cache.close()
    with pytest.raises(hotlock.CacheError, match=r"(?i)mismatch"):
        hotlock.connect(internal_cluster.url(ssl_ca_certs=str(internal_cluster.ca)), backend=redis_backend)


@pytest.mark.parametrize("aio", [False, True], ids=["sync", "async"])
def test_a_ca_rotated_on_disk_is_read_by_the_next_connection(redis_backend: str, aio: bool, tmp_path: Path) -> None:
    """The server moves to a certificate from a new CA, and the client's ssl_ca_certs file
    is replaced by that CA: the next new connection trusts it, without a restart."""
    old_ca, new_ca = Pki.make(tmp_path / "old"), Pki.make(tmp_path / "new")
    server = start_tls_redis(old_ca, "rotating", "DNS:localhost")
    try:
        trusted = tmp_path / "trusted.pem"
        shutil.copy(old_ca.ca, trusted)
        url = with_tls(server.url(), trusted, client_name="rotating")
        side = server.plain.client()

        def rotate() -> None:
            cert, key = new_ca.leaf("rotated", "DNS:localhost")
            # All three at once (Redis 7 takes several in one CONFIG SET): a certificate
            # alone would not match the key in use.
            side.execute_command(
                "CONFIG",
                "SET",
                "tls-cert-file",
                str(cert),
                "tls-key-file",
                str(key),
                "tls-ca-cert-file",
                str(new_ca.ca),
            )
            staged = tmp_path / "trusted.pem.new"
            shutil.copy(new_ca.ca, staged)
            os.replace(staged, trusted)  # as a rotation deploys it: the new file renamed over the old
            for c in clients([side], "rotating"):
                side.client_kill_filter(_id=c["id"])

        if aio:

            async def main() -> None:
                cache = await hotlock.aio.connect(url, backend=redis_backend)
                try:
                    async with cache.lock("before", ttl=5):
                        pass
                    await asyncio.to_thread(rotate)
                    async with cache.lock("after", ttl=5):
                        pass
                finally:
                    await cache.close()

            run("asyncio", main())
        else:
            cache = hotlock.connect(url, backend=redis_backend)
            try:
                with cache.lock("before", ttl=5):
                    pass
                rotate()
                with cache.lock("after", ttl=5):
                    pass
                # A thread of its own: a new connection, on the same context.
                errors: list[BaseException] = []

                def other() -> None:
                    try:
                        cache.lock("other", ttl=5).unlock()
                    except BaseException as exc:
                        errors.append(exc)

                t = threading.Thread(target=other)
                t.start()
                t.join(10)
                assert not errors, errors
            finally:
                cache.close()
    finally:
        server.stop()


# -- Sentinel: the primary's connections, named alike ------------------------------------------


@pytest.fixture(scope="module")
def sentinel_topology() -> Iterator[Any]:
    from .test_sentinel import start_topology

    topo = start_topology("valkey")
    yield topo
    topo.stop()


@pytest.mark.parametrize("aio", [False, True], ids=["sync", "async"])
def test_connections_to_a_sentinel_primary_are_named_and_kept_alive(
    redis_backend: str, aio: bool, sentinel_topology: Any
) -> None:
    name = fresh("under-sentinel")
    url = named_url(sentinel_topology.url, name)
    primary = sentinel_topology.node(sentinel_topology.primary_port())
    look = lambda: clients([primary], name)  # noqa: E731
    if aio:

        async def main() -> list[dict[str, Any]]:
            cache = await hotlock.aio.connect(url, backend=redis_backend)
            try:
                await contend_async(cache, "sentinel")
                found = await asyncio.to_thread(wait_for, look, lambda f: any("P" in c["flags"] for c in f))
                await asyncio.to_thread(assert_named_and_kept_alive, found, "valkey")
                return found
            finally:
                await cache.close()

        assert run("asyncio", main())
    else:
        cache = hotlock.connect(url, backend=redis_backend)
        try:
            contend_sync(cache, "sentinel")
            found = wait_for(look, lambda f: any("P" in c["flags"] for c in f))
            assert_named_and_kept_alive(found, "valkey")
        finally:
            cache.close()
