"""Credentials that rotate: connect(credential_provider=..., reauth_interval=...), a NOAUTH
or WRONGPASS on a live connection, and a username sent without a password.

Every test runs on each path: the sync and the async API, each on the native and the
redis-py backend (ids ``native``, ``redis-py``, ``aio-native``, ``aio-redis-py``), against
a private server whose ``default`` user is off, so a connection that authenticated as
nobody (or as ``default``) cannot run a single command. The cluster and Sentinel forms
are covered at the end. A NOAUTH no real server sends on a live connection is injected
by tests/fakeserver.py.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable, Coroutine, Iterator
from typing import Any, TypeVar

import pytest
import redis
from redis.credentials import StreamingCredentialProvider, UsernamePasswordCredentialProvider

import hotlock
import hotlock.aio
from hotlock import CacheError
from hotlock._scripts import ACQUIRE, EXTEND
from hotlock.backends.native import native_aio, native_module

from .conftest import REQUIRE_NATIVE, RedisServer, start_redis
from .fakeserver import FakeRedis

T = TypeVar("T")

# The slow part is starting servers; the client is the subject, not the server kind.
pytestmark = pytest.mark.slow_variants("server_kind")

PATHS = ["native", "redis-py", "aio-native", "aio-redis-py"]
ADMIN = ("admin", "admin-secret")
RIGHTS = ("~*", "&*", "+@all")


class Provider:
    """A credential provider as redis-py shapes one: what it answers can change (a
    rotation), and it counts how often it was asked."""

    def __init__(self, username: str | None, password: str) -> None:
        self.username = username
        self.password = password
        self.asked = 0
        self._mutex = threading.Lock()

    def get_credentials(self) -> tuple[str] | tuple[str, str]:
        with self._mutex:
            self.asked += 1
            return (self.password,) if self.username is None else (self.username, self.password)


class Broken:
    """A provider whose token service is down."""

    def get_credentials(self) -> tuple[str, str]:
        raise RuntimeError("token service unreachable")


def is_aio(path: str) -> bool:
    return path.startswith("aio-")


def backend_of(path: str) -> str:
    return path.removeprefix("aio-")


@pytest.fixture(params=PATHS)
def path(request: pytest.FixtureRequest) -> str:
    name: str = request.param
    if backend_of(name) == "native":
        native, why = native_aio() if is_aio(name) else native_module()
        if native is None:
            if REQUIRE_NATIVE:
                pytest.fail(f"HOTLOCK_REQUIRE_EXTENSIONS=1 but the native backend is not live: {why}")
            pytest.skip(f"the native backend is not live: {why}")
    return name


@pytest.fixture
def server(server_kind: str) -> Iterator[tuple[RedisServer, redis.Redis]]:
    """A private server whose default user is off, and a client of its admin user."""
    srv = start_redis(kind=server_kind)
    srv.client().execute_command("ACL", "SETUSER", ADMIN[0], "on", f">{ADMIN[1]}", *RIGHTS)
    admin = redis.Redis(port=srv.port, username=ADMIN[0], password=ADMIN[1], socket_timeout=5)
    admin.execute_command("ACL", "SETUSER", "default", "off")
    srv.client().connection_pool.disconnect()
    yield srv, admin
    admin.close()
    srv.stop()


def users(admin: redis.Redis) -> list[str]:
    """The user of every client connection but the admin's own."""
    return [c["user"] for c in admin.client_list() if c["user"] != ADMIN[0]]


def stat(admin: redis.Redis, name: str) -> int:
    if name == "auth":
        return int(admin.info("commandstats").get("cmdstat_auth", {}).get("calls", 0))
    return int(admin.info("stats")[name])


# -- driving a path from a test: the same steps, sync or async ------------------------------


class Driver:
    """One cache on one path, used the same way whether its API is sync or async: the
    async one runs on a loop in a thread of its own, so a test can rotate credentials on
    the server while it works."""

    def __init__(self, path: str, url: str, **kwargs: Any) -> None:
        self.aio = is_aio(path)
        self.loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        if self.aio:
            self.loop = asyncio.new_event_loop()
            self._thread = threading.Thread(target=self.loop.run_forever, daemon=True)
            self._thread.start()
            try:
                self.cache: Any = self.call(lambda: hotlock.aio.connect(url, backend=backend_of(path), **kwargs))
            except BaseException:
                self._stop()
                raise
        else:
            self.cache = hotlock.connect(url, backend=backend_of(path), **kwargs)

    def call(self, make: Callable[[], Any]) -> Any:
        """make() on this path: called (sync), or awaited on the cache's loop (async)."""
        if not self.aio:
            return make()
        assert self.loop is not None

        async def run() -> Any:
            return await make()

        return asyncio.run_coroutine_threadsafe(run(), self.loop).result(30)

    def cycle(self, key: str) -> None:
        """lock, extend, unlock."""
        if self.aio:

            async def steps() -> None:
                lease = await self.cache.lock(key, 10)
                await lease.extend(10)
                await lease.unlock()

            self.call(steps)
            return
        lease = self.cache.lock(key, 10)
        lease.extend(10)
        lease.unlock()

    def workers(self, n: int, stop: threading.Event, errors: list[BaseException], done: list[int]) -> list[Any]:
        """n threads (sync) or n tasks (async), each locking and unlocking its own key until
        ``stop``. (No extend: an extend whose reply a killed connection lost is a
        CacheError by design, never resent; acquire and release are resent once.)"""
        if not self.aio:

            def work(i: int) -> None:
                while not stop.is_set():
                    try:
                        self.cache.lock(f"k{i}", 10).unlock()
                        done[i] += 1
                    except BaseException as exc:
                        errors.append(exc)
                        return

            threads = [threading.Thread(target=work, args=(i,)) for i in range(n)]
            for t in threads:
                t.start()
            return threads
        assert self.loop is not None

        async def task(i: int) -> None:
            while not stop.is_set():
                try:
                    lease = await self.cache.lock(f"k{i}", 10)
                    await lease.unlock()
                    done[i] += 1
                except BaseException as exc:
                    errors.append(exc)
                    return
                await asyncio.sleep(0)

        return [asyncio.run_coroutine_threadsafe(task(i), self.loop) for i in range(n)]

    @staticmethod
    def join(workers: list[Any]) -> None:
        for w in workers:
            if isinstance(w, threading.Thread):
                w.join(30)
                assert not w.is_alive()
            else:
                w.result(30)

    def close(self) -> None:
        if self.aio:
            try:
                self.call(self.cache.close)
            finally:
                self._stop()
        else:
            self.cache.close()

    def _stop(self) -> None:
        assert self.loop is not None and self._thread is not None
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(10)
        self.loop.close()


def rotate(
    admin: redis.Redis, provider: Provider, user: str, old: str, new: str, ports: list[int] | None = None
) -> None:
    """What a password rotation does: the new password added, the provider told, the old
    one removed, and the user's connections killed (they were authenticated with it)."""
    clients = [admin] if ports is None else [redis.Redis(port=p, socket_timeout=5) for p in ports]
    for c in clients:
        c.execute_command("ACL", "SETUSER", user, f">{new}")
    provider.password = new
    for c in clients:
        c.execute_command("ACL", "SETUSER", user, f"<{old}")
    for c in clients:
        c.execute_command("CLIENT", "KILL", "USER", user)
    if ports is not None:
        for c in clients:
            c.close()


# -- bad input ---------------------------------------------------------------------------

# A port nothing listens on: any I/O would be a CacheError, so a TypeError or ValueError
# shows the argument was refused first.
NOWHERE = "redis://127.0.0.1:1/0"


@pytest.mark.parametrize(
    ("kwargs", "error"),
    [
        ({"credential_provider": object()}, TypeError),
        ({"credential_provider": "secret"}, TypeError),
        ({"credential_provider": Provider("u", "p"), "reauth_interval": 0}, ValueError),
        ({"credential_provider": Provider("u", "p"), "reauth_interval": -5}, ValueError),
        ({"credential_provider": Provider("u", "p"), "reauth_interval": float("nan")}, ValueError),
        ({"credential_provider": Provider("u", "p"), "reauth_interval": float("inf")}, ValueError),
        ({"credential_provider": Provider("u", "p"), "reauth_interval": "60"}, TypeError),
        ({"credential_provider": Provider("u", "p"), "reauth_interval": True}, TypeError),
        ({"reauth_interval": 60}, ValueError),
    ],
    ids=["object", "str", "zero", "negative", "nan", "inf", "text", "bool", "no-provider"],
)
@pytest.mark.parametrize("api", ["sync", "aio"])
@pytest.mark.parametrize("lazy", [False, True])
def test_bad_input_is_refused_before_any_io(
    kwargs: dict[str, Any], error: type[Exception], api: str, lazy: bool
) -> None:
    with pytest.raises(error):
        if api == "sync":
            hotlock.connect(NOWHERE, lazy=lazy, **kwargs)
        else:
            asyncio.run(hotlock.aio.connect(NOWHERE, lazy=lazy, **kwargs))


@pytest.mark.parametrize("api", ["sync", "aio"])
def test_a_provider_beside_url_credentials_or_without_a_url_is_refused(
    api: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("CACHE_URL", raising=False)
    provider = Provider("u", "p")
    for url in ("redis://u:p@127.0.0.1:1/0", "redis://u@127.0.0.1:1/0", "redis://:p@127.0.0.1:1/0", None):
        with pytest.raises(ValueError, match="credential_provider"):
            if api == "sync":
                hotlock.connect(url, credential_provider=provider)
            else:
                asyncio.run(hotlock.aio.connect(url, credential_provider=provider))
    assert provider.asked == 0


# -- a provider at each new connection -------------------------------------------------------


def test_rotation_under_load_costs_no_error(path: str, server: tuple[RedisServer, redis.Redis]) -> None:
    """8 threads (or tasks) lock, extend and unlock while the password rotates and every
    connection of the user is killed: not one error, and the new connections authenticate
    with the new password (a thread started after the rotation too)."""
    srv, admin = server
    admin.execute_command("ACL", "SETUSER", "app", "on", ">old-pw", *RIGHTS)
    provider = Provider("app", "old-pw")
    driver = Driver(path, f"redis://127.0.0.1:{srv.port}", credential_provider=provider, timeout=2.0)
    try:
        stop = threading.Event()
        errors: list[BaseException] = []
        done = [0] * 8
        workers = driver.workers(8, stop, errors, done)
        deadline = time.monotonic() + 20
        while sum(done) < 40 and not errors and time.monotonic() < deadline:
            time.sleep(0.01)
        before = list(done)
        asked = provider.asked
        rotate(admin, provider, "app", "old-pw", "new-pw")
        # Every worker goes on after the kill.
        while any(d - b < 5 for d, b in zip(done, before, strict=True)) and not errors:
            if time.monotonic() > deadline:
                break
            time.sleep(0.01)
        # A thread (task) that starts now authenticates with the new password.
        driver.cycle("after")
        stop.set()
        driver.join(workers)
        assert errors == []
        assert all(d - b >= 5 for d, b in zip(done, before, strict=True)), (before, done)
        assert provider.asked > asked  # the reconnections asked again
        assert set(users(admin)) <= {"app"}
    finally:
        driver.close()


def test_username_alone_is_sent_as_that_user(path: str, server: tuple[RedisServer, redis.Redis]) -> None:
    """A URL with a username and no password authenticates as that user (an ACL user with
    nopass), on every path: never as ``default`` (which is off here)."""
    srv, admin = server
    admin.execute_command("ACL", "SETUSER", "lonely", "on", "nopass", *RIGHTS)
    driver = Driver(path, f"redis://lonely@127.0.0.1:{srv.port}")
    try:
        driver.cycle("k")
        assert users(admin) and set(users(admin)) == {"lonely"}
    finally:
        driver.close()


def test_a_provider_username_alone_and_password_alone(path: str, server: tuple[RedisServer, redis.Redis]) -> None:
    """(username, "") from a provider is that nopass user; (password,) is the default user's
    password (requirepass), as redis-py reads the 1-tuple."""
    srv, admin = server
    admin.execute_command("ACL", "SETUSER", "lonely", "on", "nopass", *RIGHTS)
    driver = Driver(path, f"redis://127.0.0.1:{srv.port}", credential_provider=Provider("lonely", ""))
    try:
        driver.cycle("k")
        assert set(users(admin)) == {"lonely"}
    finally:
        driver.close()
    admin.execute_command("ACL", "SETUSER", "default", "on", ">the-default-pw")
    provider = Provider(None, "the-default-pw")
    driver = Driver(path, f"redis://127.0.0.1:{srv.port}", credential_provider=provider)
    try:
        driver.cycle("k")
        assert "default" in users(admin)
        assert provider.asked >= 1
    finally:
        driver.close()


def test_a_failing_provider_is_a_cache_error_naming_it(path: str, server: tuple[RedisServer, redis.Redis]) -> None:
    srv, _ = server
    with pytest.raises(CacheError, match=r"credential_provider Broken\.get_credentials\(\) failed") as info:
        Driver(path, f"redis://127.0.0.1:{srv.port}", credential_provider=Broken())
    assert isinstance(info.value.__cause__, RuntimeError)
    assert "token service unreachable" in str(info.value)


def test_a_provider_that_fails_later_is_a_cache_error_and_the_next_call_recovers(
    path: str, server: tuple[RedisServer, redis.Redis]
) -> None:
    """Connected, then the provider fails when a new connection asks it: that call is a
    CacheError naming the provider; once it answers again, so does the cache."""
    srv, admin = server
    admin.execute_command("ACL", "SETUSER", "app", "on", ">pw", *RIGHTS)
    provider = Provider("app", "pw")
    driver = Driver(path, f"redis://127.0.0.1:{srv.port}", credential_provider=provider)
    try:
        driver.cycle("k")
        original = provider.get_credentials

        def down() -> tuple[str, str]:
            raise OSError("no route to the token service")

        provider.get_credentials = down  # type: ignore[method-assign]
        admin.execute_command("CLIENT", "KILL", "USER", "app")
        with pytest.raises(CacheError, match="credential_provider Provider") as info:
            for _ in range(3):  # the first call may find the killed connection first
                driver.cycle("k")
        assert isinstance(info.value.__cause__, OSError)
        provider.get_credentials = original  # type: ignore[method-assign]
        driver.cycle("k")
    finally:
        driver.close()


# -- reauth_interval ------------------------------------------------------------------------


def test_reauth_interval_resends_auth_on_live_connections(path: str, server: tuple[RedisServer, redis.Redis]) -> None:
    """AUTH is sent again on the connection in use once the interval has passed (the
    server's AUTH count grows), without a reconnect (its connection count does not)."""
    srv, admin = server
    admin.execute_command("ACL", "SETUSER", "app", "on", ">pw", *RIGHTS)
    provider = Provider("app", "pw")
    driver = Driver(path, f"redis://127.0.0.1:{srv.port}", credential_provider=provider, reauth_interval=0.05)
    try:
        driver.cycle("k")
        auths, connections = stat(admin, "auth"), stat(admin, "total_connections_received")
        for _ in range(6):
            time.sleep(0.08)
            driver.cycle("k")
        assert stat(admin, "auth") - auths >= 4
        # The admin client's own reconnects aside (none expected), no new connection.
        assert stat(admin, "total_connections_received") == connections
    finally:
        driver.close()


def test_reauth_after_a_rotation_keeps_the_connection(path: str, server: tuple[RedisServer, redis.Redis]) -> None:
    """The old password removed without killing anything: the live connection is
    authenticated again with the new one, and it is still that connection."""
    srv, admin = server
    admin.execute_command("ACL", "SETUSER", "app", "on", ">one", *RIGHTS)
    provider = Provider("app", "one")
    driver = Driver(path, f"redis://127.0.0.1:{srv.port}", credential_provider=provider, reauth_interval=0.05)
    try:
        driver.cycle("k")
        connections = stat(admin, "total_connections_received")
        admin.execute_command("ACL", "SETUSER", "app", ">two", "<one")
        provider.password = "two"
        time.sleep(0.1)
        driver.cycle("k")
        assert stat(admin, "total_connections_received") == connections
        # Had the re-sent AUTH been refused, the connection would have been replaced.
        failed = int(admin.info("commandstats").get("cmdstat_auth", {}).get("failed_calls", 0))
        assert failed == 0
    finally:
        driver.close()


# -- NOAUTH / WRONGPASS on a live connection (injected) ---------------------------------------

NOAUTH = b"-NOAUTH Authentication required.\r\n"
WRONGPASS = b"-WRONGPASS invalid username-password pair or user is disabled.\r\n"


@pytest.mark.parametrize("command", ["acquire", "extend"])
def test_noauth_on_a_live_connection_asks_again_and_retries_once(path: str, command: str) -> None:
    """A NOAUTH on a live connection (the command did not run): the provider is asked
    again for a new connection, and the call, even an extend (never resent after a lost
    reply), succeeds on it. A second NOAUTH in the same call is a CacheError."""
    provider = Provider("app", "pw")
    with FakeRedis() as fake:
        driver = Driver(path, fake.url, credential_provider=provider, timeout=2.0)
        try:
            driver.cycle("warm")
            asked, conns = provider.asked, fake.connections
            # A free key's acquire is a transaction (its MULTI refused first), or the
            # ACQUIRE script on a backend that still sends it.
            by_transaction = any(c[0].upper() == b"MULTI" for c in fake.received)
            if command == "extend":
                match: tuple[bytes, ...] = (b"EVALSHA", EXTEND.sha)
            else:
                match = (b"MULTI",) if by_transaction else (b"EVALSHA", ACQUIRE.sha)
            fake.on(*match, reply=NOAUTH)
            driver.cycle("k")
            assert fake.pending() == 0
            assert provider.asked == asked + 1
            assert fake.connections == conns + 1
            fake.on(*match, reply=NOAUTH)
            fake.on(*match, reply=NOAUTH)
            with pytest.raises(CacheError, match="NOAUTH"):
                driver.cycle("k2")
        finally:
            driver.close()


@pytest.mark.parametrize("command", ["set_nx", "incr"])
def test_noauth_with_url_credentials_reconnects_and_succeeds(path: str, command: str) -> None:
    """Without a provider, the url's credentials are sent again on the new connection: a
    server that forgot a connection's authentication (a restart behind a proxy that kept
    the socket) costs no error, where before every later call on it failed. set_nx and
    incr, never resent after a lost reply, are resent after NOAUTH: it says they did not run."""
    with FakeRedis() as fake:
        driver = Driver(path, fake.url.replace("redis://", "redis://u:p@"), timeout=2.0)
        try:
            driver.cycle("warm")
            conns = fake.connections
            name = b"SET" if command == "set_nx" else b"INCRBY"
            fake.on(name, reply=NOAUTH)
            if command == "set_nx":
                assert driver.call(lambda: driver.cache.set_nx("once", "1", ttl=10)) is True
            else:
                assert driver.call(lambda: driver.cache.incr("count", 5)) == 5
            assert fake.pending() == 0
            assert fake.connections == conns + 1
            assert fake.count(b"AUTH", b"u", b"p") == fake.connections
            driver.cycle("after")
        finally:
            driver.close()


def test_wrongpass_on_a_resent_auth_asks_again_on_a_new_connection(path: str) -> None:
    """reauth_interval's AUTH refused (WRONGPASS): the call goes on a new connection whose
    handshake asks the provider again, and succeeds."""
    provider = Provider("app", "pw")
    with FakeRedis() as fake:
        driver = Driver(path, fake.url, credential_provider=provider, reauth_interval=0.05, timeout=2.0)
        try:
            driver.cycle("warm")
            conns = fake.connections
            fake.on(b"AUTH", reply=WRONGPASS)
            time.sleep(0.1)
            driver.cycle("k")
            assert fake.pending() == 0
            assert fake.connections == conns + 1
        finally:
            driver.close()


def test_url_credentials_unchanged_send_one_auth(path: str) -> None:
    """Without a provider nothing changes: the url's user and password, one AUTH per connection."""
    with FakeRedis() as fake:
        driver = Driver(path, fake.url.replace("redis://", "redis://u:p@"))
        try:
            driver.cycle("k")
            assert [c for c in fake.received if c[0].upper() == b"AUTH"] == [[b"AUTH", b"u", b"p"]] * fake.connections
        finally:
            driver.close()


# -- the cluster and Sentinel ---------------------------------------------------------------


@pytest.fixture
def cluster_user(redis_cluster: Any) -> Iterator[tuple[Any, list[int]]]:
    """An ACL user "app" (password "c-one") on every node of the session's cluster; removed after."""
    ports = [n.port for n in redis_cluster.nodes]
    redis_cluster.flush()
    for port in ports:
        with redis.Redis(port=port, socket_timeout=5) as c:
            c.execute_command("ACL", "SETUSER", "app", "reset", "on", ">c-one", *RIGHTS)
            c.execute_command("ACL", "SETUSER", "lonely", "reset", "on", "nopass", *RIGHTS)
    yield redis_cluster, ports
    for port in ports:
        with redis.Redis(port=port, socket_timeout=5) as c:
            c.execute_command("ACL", "DELUSER", "app", "lonely")


def test_cluster_rotation_username_alone_and_reauth(path: str, cluster_user: tuple[Any, list[int]]) -> None:
    """On a Redis Cluster: a rotation under 8 workers costs no error; AUTH is re-sent on
    every node's live connection; a username alone authenticates as that user."""
    cluster, ports = cluster_user
    provider = Provider("app", "c-one")
    driver = Driver(path, cluster.url, credential_provider=provider, reauth_interval=0.2)
    try:
        stop = threading.Event()
        errors: list[BaseException] = []
        done = [0] * 8
        workers = driver.workers(8, stop, errors, done)
        deadline = time.monotonic() + 30
        while sum(done) < 40 and not errors and time.monotonic() < deadline:
            time.sleep(0.01)
        before = list(done)
        rotate(redis.Redis(port=ports[0]), provider, "app", "c-one", "c-two", ports)
        while any(d - b < 5 for d, b in zip(done, before, strict=True)) and not errors:
            if time.monotonic() > deadline:
                break
            time.sleep(0.01)
        primaries = cluster.primary_ports()
        auths = {
            p: int(cluster.client(p).info("commandstats").get("cmdstat_auth", {}).get("calls", 0)) for p in primaries
        }
        time.sleep(0.5)
        while any(d - b < 10 for d, b in zip(done, before, strict=True)) and not errors:
            if time.monotonic() > deadline:
                break
            time.sleep(0.01)
        stop.set()
        driver.join(workers)
        assert errors == []
        grown = [
            p for p in primaries if int(cluster.client(p).info("commandstats")["cmdstat_auth"]["calls"]) > auths[p]
        ]
        assert grown, "no primary saw AUTH again"
    finally:
        driver.close()
    driver = Driver(path, cluster.url.replace("redis+cluster://", "redis+cluster://lonely@"))
    try:
        for i in range(10):
            driver.cycle(f"spread{i}")
        seen = {c["user"] for p in cluster.primary_ports() for c in cluster.client(p).client_list()}
        assert "lonely" in seen
    finally:
        driver.close()


def test_sentinel_rotation_and_username_alone(path: str, server_kind: str) -> None:
    """Under Sentinel: the primary's connections ask the provider, and after a rotation
    (the user's connections killed) the next calls succeed; a username alone is that user."""
    from .test_sentinel import start_topology

    topo = start_topology(server_kind)
    try:
        primary = topo.primary.client()
        for c in (primary, topo.replica.client()):
            c.execute_command("ACL", "SETUSER", "app", "on", ">s-one", *RIGHTS)
            c.execute_command("ACL", "SETUSER", "lonely", "on", "nopass", *RIGHTS)
        provider = Provider("app", "s-one")
        driver = Driver(path, topo.url, credential_provider=provider)
        try:
            driver.cycle("k")
            rotate(primary, provider, "app", "s-one", "s-two")
            for _ in range(3):
                driver.cycle("k")
            assert {c["user"] for c in primary.client_list()} >= {"app"}
        finally:
            driver.close()
        driver = Driver(path, topo.url.replace("redis+sentinel://", "redis+sentinel://lonely@"))
        try:
            driver.cycle("k")
            assert "lonely" in {c["user"] for c in primary.client_list()}
        finally:
            driver.close()
    finally:
        topo.stop()


def run(coro: Coroutine[Any, Any, T]) -> T:
    return asyncio.run(coro)


def test_a_provider_sends_what_the_url_password_sends(path: str) -> None:
    """Per new connection, a provider costs no command and no round trip: the server gets
    the same commands, AUTH with the same arguments, as with the password in the url."""
    seen = []
    for kwargs, url_auth in (({}, "redis://u:p@"), ({"credential_provider": Provider("u", "p")}, "redis://")):
        with FakeRedis() as fake:
            driver = Driver(path, fake.url.replace("redis://", url_auth), **kwargs)
            try:
                driver.cycle("k")
            finally:
                driver.close()
            seen.append([c if c[0].upper() == b"AUTH" else c[:1] for c in fake.received])
    assert seen[0] == seen[1]
    assert [b"AUTH", b"u", b"p"] in seen[0]


class Streaming(StreamingCredentialProvider):
    """A provider in redis-entraid's shape (a redis-py StreamingCredentialProvider with its
    own get_credentials_async): hotlock asks it at each connection as any other."""

    def __init__(self, username: str, password: str) -> None:
        self.pair = (username, password)
        self.asked_async = 0

    def get_credentials(self) -> tuple[str, str]:
        return self.pair

    async def get_credentials_async(self) -> tuple[str, str]:
        self.asked_async += 1
        return self.pair

    def on_next(self, callback: Callable[[Any], None]) -> None:
        pass

    def on_error(self, callback: Callable[[Exception], None]) -> None:
        pass

    def is_streaming(self) -> bool:
        return True


@pytest.mark.parametrize("kind", ["redis-py", "streaming"])
def test_redis_py_providers_work_as_they_are(path: str, kind: str, server: tuple[RedisServer, redis.Redis]) -> None:
    """redis-py's own UsernamePasswordCredentialProvider, and a StreamingCredentialProvider
    (redis-entraid's kind), passed unchanged; the async paths await get_credentials_async."""
    srv, admin = server
    admin.execute_command("ACL", "SETUSER", "app", "on", ">pw", *RIGHTS)
    provider: Any = UsernamePasswordCredentialProvider("app", "pw") if kind == "redis-py" else Streaming("app", "pw")
    driver = Driver(path, f"redis://127.0.0.1:{srv.port}", credential_provider=provider)
    try:
        driver.cycle("k")
        assert set(users(admin)) == {"app"}
        if kind == "streaming":
            assert (provider.asked_async > 0) == is_aio(path)
    finally:
        driver.close()


class Misshapen:
    """A provider answering a dict: not the shape, and it holds the secret."""

    def get_credentials(self) -> Any:
        return {"password": "s3cret-token"}


def test_a_provider_answer_of_the_wrong_shape_is_a_cache_error_without_the_secret(path: str) -> None:
    with (
        FakeRedis() as fake,
        pytest.raises(CacheError, match=r"Misshapen\.get_credentials\(\) returned a dict") as info,
    ):
        Driver(path, fake.url, credential_provider=Misshapen())
    assert "s3cret" not in str(info.value)


def test_the_wakeup_subscriber_authenticates_with_the_provider(
    path: str, server: tuple[RedisServer, redis.Redis]
) -> None:
    """A lock_wait that waits starts the wake-up subscriber: its connection asks the
    provider too (the default user is off here, so it could not subscribe otherwise), and
    the release wakes the waiter."""
    srv, admin = server
    admin.execute_command("ACL", "SETUSER", "app", "on", ">pw", *RIGHTS)
    provider = Provider("app", "pw")
    driver = Driver(path, f"redis://127.0.0.1:{srv.port}", credential_provider=provider)
    try:
        held = driver.call(lambda: driver.cache.lock("w", 30))
        waited: list[Any] = []

        def wait() -> None:
            waited.append(driver.call(lambda: driver.cache.lock_wait("w", 30, wait=20)))

        waiter = threading.Thread(target=wait)
        waiter.start()
        deadline = time.monotonic() + 10
        subscribers: list[dict[str, Any]] = []
        while not subscribers and time.monotonic() < deadline:
            subscribers = [c for c in admin.client_list() if c["cmd"] in ("subscribe", "ssubscribe")]
            time.sleep(0.02)
        assert subscribers and {c["user"] for c in subscribers} == {"app"}
        driver.call(held.unlock)
        waiter.join(20)
        assert len(waited) == 1
        driver.call(waited[0].unlock)
    finally:
        driver.close()


def test_a_lazy_cache_asks_the_provider_at_its_first_call(path: str) -> None:
    provider = Provider("app", "pw")
    with FakeRedis() as fake:
        driver = Driver(path, fake.url, credential_provider=provider, lazy=True)
        try:
            assert provider.asked == 0 and fake.connections == 0
            driver.cycle("k")
            assert provider.asked >= 1
            assert fake.count(b"AUTH", b"app", b"pw") == fake.connections >= 1
        finally:
            driver.close()


def test_a_provider_failing_at_a_reauth_fails_no_call(path: str, caplog: pytest.LogCaptureFixture) -> None:
    """The provider down when AUTH is due again on a live connection: that connection is
    still authenticated, so the calls go on; the failure is a WARNING naming the provider.
    A new connection (the server closed the old one) then fails as CacheError."""
    provider = Provider("app", "pw")
    with FakeRedis() as fake:
        driver = Driver(path, fake.url, credential_provider=provider, reauth_interval=0.05, timeout=2.0)
        try:
            driver.cycle("warm")
            conns, auths = fake.connections, fake.count(b"AUTH")

            def down() -> tuple[str, str]:
                raise OSError("token service down")

            provider.get_credentials = down  # type: ignore[method-assign]
            with caplog.at_level("WARNING", logger="hotlock"):
                for _ in range(3):
                    time.sleep(0.08)
                    driver.cycle("k")
            assert fake.connections == conns and fake.count(b"AUTH") == auths
            assert "AUTH not re-sent" in caplog.text and "credential_provider Provider" in caplog.text
            fake.cut_all()
            with pytest.raises(CacheError, match="credential_provider Provider"):
                for _ in range(3):
                    driver.cycle("k")
        finally:
            driver.close()


@pytest.fixture(scope="module")
def tls_server() -> Iterator[Any]:
    """A TLS server (the sync native client on its TLS build, the others through Python's ssl)."""
    import tempfile
    from pathlib import Path

    from .tls import Pki, start_tls_redis

    with tempfile.TemporaryDirectory(prefix="hotlock-auth-pki-") as d:
        server = start_tls_redis(Pki.make(Path(d)), "auth", "DNS:localhost")
        yield server
        server.stop()


def test_over_tls_the_provider_and_reauth_work_alike(path: str, tls_server: Any) -> None:
    """rediss://: the provider asked at each connection, AUTH re-sent on the live one, and a
    rotation with the user's connections killed costs no error."""
    admin = tls_server.plain.client()
    admin.execute_command("ACL", "SETUSER", "tlsapp", "reset", "on", ">t-one", *RIGHTS)
    provider = Provider("tlsapp", "t-one")
    url = tls_server.url(ssl_ca_certs=str(tls_server.ca))
    driver = Driver(path, url, credential_provider=provider, reauth_interval=0.05, timeout=2.0)
    try:
        driver.cycle("k")
        auths = stat(admin, "auth")
        time.sleep(0.1)
        driver.cycle("k")
        assert stat(admin, "auth") > auths
        rotate(admin, provider, "tlsapp", "t-one", "t-two")
        for _ in range(3):
            driver.cycle("k")
        assert "tlsapp" in {c["user"] for c in admin.client_list()}
    finally:
        driver.close()
        admin.execute_command("ACL", "DELUSER", "tlsapp")
