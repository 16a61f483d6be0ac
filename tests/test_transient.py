"""Transient replies (READONLY, LOADING, BUSY, MASTERDOWN, TRYAGAIN, CLUSTERDOWN) on every
path: a failover behind one endpoint, a long script on a cluster node and a Sentinel
failover cost the callers of 16 threads (or tasks) no error; each reply injected once by
a fake server ends in success with the lock's own token; a reply that does not go away is
a CacheError within the call's budget that names it and says it was retried.

Each load test prints what it counted (``-s`` shows it): errors, and lock cycles done.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import threading
import time
from collections.abc import Callable, Iterator

import pytest
import redis

import hotlock
import hotlock.aio
from hotlock import CacheError
from hotlock._scripts import ACQUIRE, EXTEND, RELEASE
from hotlock.backends.native import native_aio

from .cluster import Cluster
from .conftest import BACKENDS, REQUIRE_NATIVE, RedisServer, free_port, lock_name, start_redis
from .fakeserver import FakeRedis, fence_of

pytestmark = pytest.mark.slow_variants("server_kind")

SYNC_BACKENDS = [b for b in BACKENDS if b != "memory"]
AIO_BACKENDS = ["redis-py"] + (["native"] if native_aio()[0] is not None or REQUIRE_NATIVE else [])
THREADS = 16
FLIP_S = 0.3  # how long the endpoint answers as a replica
TIMEOUT = 2.0

REPLIES = {
    "READONLY": b"-READONLY You can't write against a read only replica.\r\n",
    "LOADING": b"-LOADING Redis is loading the dataset in memory\r\n",
    "BUSY": b"-BUSY Redis is busy running a script. You can only call SCRIPT KILL or SHUTDOWN NOSAVE.\r\n",
    "MASTERDOWN": b"-MASTERDOWN Link with MASTER is down and replica-serve-stale-data is set to 'no'.\r\n",
    "TRYAGAIN": b"-TRYAGAIN Multiple keys request during rehashing of slot\r\n",
    "CLUSTERDOWN": b"-CLUSTERDOWN The cluster is down\r\n",
}


def _need_native_aio(backend: str) -> None:
    if backend == "native" and native_aio()[0] is None:
        pytest.fail(f"HOTLOCK_REQUIRE_EXTENSIONS=1 but the native async backend is not live: {native_aio()[1]}")


@pytest.fixture
def own_server(server_kind: str) -> Iterator[RedisServer]:
    """A private server: these tests make it a replica."""
    server = start_redis(kind=server_kind)
    yield server
    server.stop()


def _replicaof_nowhere(server: RedisServer) -> None:
    """Make ``server`` a replica of an address where nothing listens: it keeps its data,
    answers reads, and refuses every write with READONLY (a demoted primary)."""
    server.client().execute_command("REPLICAOF", "127.0.0.1", str(free_port()))


def _flip(server: RedisServer) -> None:
    _replicaof_nowhere(server)
    time.sleep(FLIP_S)
    server.client().execute_command("REPLICAOF", "NO", "ONE")


class Tally:
    """What the workers saw: errors (as text), and lock cycles done before and after the event."""

    def __init__(self) -> None:
        self.errors: list[str] = []
        self.done = 0
        self.others: list[str] = []

    def report(self, path: str) -> str:
        return f"{path}: {len(self.errors)} errors, {self.done} lock cycles"


def _load_sync(cache: hotlock.Cache, event: Callable[[], None], path: str) -> Tally:
    """THREADS threads lock (try once) and unlock distinct keys while ``event`` runs."""
    tally = Tally()
    stop = threading.Event()
    run = os.urandom(4).hex()  # keys of a run no other run left behind (the cluster is shared)

    def worker(n: int) -> None:
        i = 0
        while not stop.is_set():
            i += 1
            try:
                cache.lock(f"{run}-t{n}-{i}", ttl=5).unlock()
                tally.done += 1
            except CacheError as exc:
                tally.errors.append(str(exc))
                time.sleep(0.01)  # as a caller would, rather than count one error per spin
            except Exception as exc:  # anything else is a bug, reported as such
                tally.others.append(repr(exc))

    threads = [threading.Thread(target=worker, args=(n,)) for n in range(THREADS)]
    for t in threads:
        t.start()
    try:
        time.sleep(0.2)
        event()
        before = tally.done
        time.sleep(0.5)
        after = tally.done
    finally:
        stop.set()
        for t in threads:
            t.join(30)
    print(f"\n{tally.report(path)}")
    assert tally.others == []
    assert after > before, "locking did not resume after the event"
    return tally


async def _load_async(cache: hotlock.aio.AsyncCache, event: Callable[[], None], path: str) -> Tally:
    """THREADS tasks lock (try once) and unlock distinct keys while ``event`` runs in a thread."""
    tally = Tally()
    stop = asyncio.Event()
    run = os.urandom(4).hex()

    async def worker(n: int) -> None:
        i = 0
        while not stop.is_set():
            i += 1
            try:
                await (await cache.lock(f"{run}-t{n}-{i}", ttl=5)).unlock()
                tally.done += 1
            except CacheError as exc:
                tally.errors.append(str(exc))
                await asyncio.sleep(0.01)
            except Exception as exc:
                tally.others.append(repr(exc))
            await asyncio.sleep(0)

    tasks = [asyncio.ensure_future(worker(n)) for n in range(THREADS)]
    try:
        await asyncio.sleep(0.2)
        await asyncio.get_running_loop().run_in_executor(None, event)
        before = tally.done
        await asyncio.sleep(0.5)
        after = tally.done
    finally:
        stop.set()
        await asyncio.gather(*tasks)
    print(f"\n{tally.report(path)}")
    assert tally.others == []
    assert after > before, "locking did not resume after the event"
    return tally


# -- a failover behind one endpoint: the server answers READONLY for 300 ms -------------------


def test_a_replica_flip_costs_no_error(redis_backend: str, own_server: RedisServer) -> None:
    cache = hotlock.connect(own_server.url, backend=redis_backend, timeout=TIMEOUT)  # type: ignore[arg-type]
    try:
        tally = _load_sync(cache, lambda: _flip(own_server), f"REPLICAOF flip, {redis_backend} threads")
    finally:
        cache.close()
    assert tally.errors == []


@pytest.mark.parametrize("aio_backend", AIO_BACKENDS)
def test_a_replica_flip_costs_no_error_async(aio_backend: str, own_server: RedisServer) -> None:
    _need_native_aio(aio_backend)

    async def main() -> Tally:
        cache = await hotlock.aio.connect(own_server.url, backend=aio_backend, timeout=TIMEOUT)
        try:
            return await _load_async(cache, lambda: _flip(own_server), f"REPLICAOF flip, {aio_backend} async")
        finally:
            await cache.close()

    assert asyncio.run(main()).errors == []


def test_a_lasting_readonly_is_a_cache_error_within_the_budget(redis_backend: str, own_server: RedisServer) -> None:
    timeout = 0.5
    cache = hotlock.connect(own_server.url, backend=redis_backend, timeout=timeout)  # type: ignore[arg-type]
    try:
        _replicaof_nowhere(own_server)
        started = time.monotonic()
        with pytest.raises(CacheError, match="READONLY") as info:
            cache.lock("stays-readonly", ttl=5)
        took = time.monotonic() - started
        assert "retried" in str(info.value)
        # Retried for the call's timeout (0.5 s), then one more reply timeout at most:
        # about 0.5 s; loosely bounded both ways.
        assert 0.25 <= took < 5.0, took
    finally:
        own_server.client().execute_command("REPLICAOF", "NO", "ONE")
        cache.close()


@pytest.mark.parametrize("aio_backend", AIO_BACKENDS)
def test_a_lasting_readonly_is_a_cache_error_within_the_budget_async(aio_backend: str, own_server: RedisServer) -> None:
    _need_native_aio(aio_backend)

    async def main() -> tuple[str, float]:
        cache = await hotlock.aio.connect(own_server.url, backend=aio_backend, timeout=0.5)
        try:
            _replicaof_nowhere(own_server)
            started = time.monotonic()
            with pytest.raises(CacheError, match="READONLY") as info:
                await cache.lock("stays-readonly", ttl=5)
            return str(info.value), time.monotonic() - started
        finally:
            own_server.client().execute_command("REPLICAOF", "NO", "ONE")
            await cache.close()

    text, took = asyncio.run(main())
    assert "retried" in text
    assert 0.25 <= took < 5.0, took


# -- each transient reply once, from a fake server -----------------------------------------------


def _probed(fake: FakeRedis) -> tuple[bool, int]:
    """After a probe (a lock and its unlock): whether the backend took the free key by
    transaction (MULTI...EXEC) rather than by the ACQUIRE script, and where the commands
    after the probe start in ``fake.received``."""
    return any(c[0].upper() == b"MULTI" for c in fake.received), len(fake.received)


def _acquire_tokens(commands: list[list[bytes]], key: bytes) -> list[bytes]:
    """The tokens each acquire of ``key`` sent: a transaction's SET, or an ACQUIRE EVALSHA."""
    name = lock_name(key)
    return [c[2] for c in commands if c[0].upper() == b"SET" and c[1] == name] + [
        c[4] for c in commands if c[0].upper() == b"EVALSHA" and c[1] == ACQUIRE.sha and c[3] == name
    ]


def _check_injected(fake: FakeRedis, start: int, key: bytes, fence: int, released: bool, extended: bool) -> None:
    sent = fake.received[start:]
    tokens = _acquire_tokens(sent, key)
    assert len(tokens) == 2, tokens
    assert tokens[0] == tokens[1], "the acquire was resent with another token"
    assert fence == fence_of(lock_name(key)), "the lock is not the resent acquire's"
    assert released and extended
    for script in (RELEASE, EXTEND):
        assert sum(c[0].upper() == b"EVALSHA" and c[1] == script.sha for c in sent) == 2
    assert fake.pending() == 0


def _inject(fake: FakeRedis, reply: str, by_transaction: bool) -> None:
    # A transaction's SET refused with the reply (EXEC then refused too): its resend is a
    # transaction again.
    fake.on(*((b"SET",) if by_transaction else (b"EVALSHA", ACQUIRE.sha)), reply=REPLIES[reply])
    for script in (EXTEND, RELEASE):
        fake.on(b"EVALSHA", script.sha, reply=REPLIES[reply])


@pytest.mark.parametrize("reply", list(REPLIES))
def test_each_transient_reply_once_ends_in_success(redis_backend: str, reply: str) -> None:
    with FakeRedis() as fake:
        cache = hotlock.connect(fake.url, backend=redis_backend, timeout=TIMEOUT)  # type: ignore[arg-type]
        try:
            cache.lock("probe", ttl=5).unlock()
            by_transaction, start = _probed(fake)
            _inject(fake, reply, by_transaction)
            lock = cache.lock("once", ttl=5)
            extended = lock.extend(5)
            released = lock.unlock()
            _check_injected(fake, start, b"once", lock.fence, released, extended is None or bool(extended))
        finally:
            cache.close()


@pytest.mark.parametrize("reply", list(REPLIES))
@pytest.mark.parametrize("aio_backend", AIO_BACKENDS)
def test_each_transient_reply_once_ends_in_success_async(aio_backend: str, reply: str) -> None:
    _need_native_aio(aio_backend)

    async def main(fake: FakeRedis) -> None:
        cache = await hotlock.aio.connect(fake.url, backend=aio_backend, timeout=TIMEOUT)
        try:
            await (await cache.lock("probe", ttl=5)).unlock()
            by_transaction, start = _probed(fake)
            _inject(fake, reply, by_transaction)
            lock = await cache.lock("once", ttl=5)
            extended = await lock.extend(5)
            released = await lock.unlock()
            _check_injected(fake, start, b"once", lock.fence, released, extended is None or bool(extended))
        finally:
            await cache.close()

    with FakeRedis() as fake:
        asyncio.run(main(fake))


@pytest.mark.parametrize("path", ["sync", "async"])
def test_a_loading_reply_inside_a_batch_loses_no_reply_behind_it(path: str) -> None:
    """redis-py raises LOADING as a ConnectionError, and disconnected on it by default: the
    replies behind it in the same write were lost, and a batch of extends failed where
    only the refused one was to go again (on the redis-py backends, sync and async)."""
    keys = [lock_name(k) for k in (b"b1", b"b2", b"b3")]
    tokens = [b"a" * 16, b"b" * 16, b"c" * 16]

    def script(fake: FakeRedis) -> int:
        fake.on(b"EVALSHA", EXTEND.sha, b"1", keys[1], reply=REPLIES["LOADING"])
        return len(fake.received)

    def extended(fake: FakeRedis, start: int) -> list[bytes]:
        return [c[3] for c in fake.received[start:] if c[0] == b"EVALSHA" and c[1] == EXTEND.sha]

    with FakeRedis() as fake:
        if path == "sync":
            cache = hotlock.connect(fake.url, backend="redis-py", timeout=TIMEOUT)
            try:
                start = script(fake)
                assert cache._backend.extend_many(keys, tokens, 5000) == [True, True, True]
            finally:
                cache.close()
        else:

            async def main() -> int:
                cache = await hotlock.aio.connect(fake.url, backend="redis-py", timeout=TIMEOUT)
                try:
                    start = script(fake)
                    assert await cache._backend.extend_many(keys, tokens, 5000) == [True, True, True]
                    return start
                finally:
                    await cache.close()

            start = asyncio.run(main())
        assert extended(fake, start) == [*keys, keys[1]]  # only the refused one again


# -- a cluster node busy with a long script for 300 ms ------------------------------------------------


def _busy_node(cluster: Cluster, port: int) -> Callable[[], None]:
    """An event: the node at ``port`` runs an endless script for FLIP_S (answering BUSY to
    everyone once busy-reply-threshold has passed), then SCRIPT KILL."""

    def event() -> None:
        side = cluster.client(port)
        was = side.config_get("busy-reply-threshold")["busy-reply-threshold"]
        side.config_set("busy-reply-threshold", 20)
        runner = redis.Redis(port=port, socket_timeout=10)
        outcome: list[BaseException] = []

        def run() -> None:
            try:
                runner.eval("while true do end", 0)
            except redis.ResponseError as exc:  # "Script killed by user with SCRIPT KILL"
                outcome.append(exc)

        t = threading.Thread(target=run)
        t.start()
        time.sleep(FLIP_S)
        killer = redis.Redis(port=port, socket_timeout=5)
        deadline = time.monotonic() + 5
        while t.is_alive() and time.monotonic() < deadline:
            with contextlib.suppress(redis.ResponseError):  # NOTBUSY: not started yet, or already over
                killer.script_kill()
            t.join(0.05)
        t.join(10)
        killer.close()
        runner.close()
        side.config_set("busy-reply-threshold", was)
        assert outcome, "the script was not killed"

    return event


def test_a_busy_cluster_node_costs_no_error(redis_backend: str, redis_cluster: Cluster) -> None:
    cache = hotlock.connect(redis_cluster.url, backend=redis_backend, timeout=TIMEOUT)  # type: ignore[arg-type]
    try:
        port = redis_cluster.primary_ports()[0]
        tally = _load_sync(cache, _busy_node(redis_cluster, port), f"cluster node BUSY, {redis_backend} threads")
    finally:
        cache.close()
    assert tally.errors == []


@pytest.mark.parametrize("aio_backend", AIO_BACKENDS)
def test_a_busy_cluster_node_costs_no_error_async(aio_backend: str, redis_cluster: Cluster) -> None:
    _need_native_aio(aio_backend)

    async def main() -> Tally:
        cache = await hotlock.aio.connect(redis_cluster.url, backend=aio_backend, timeout=TIMEOUT)
        try:
            port = redis_cluster.primary_ports()[0]
            return await _load_async(cache, _busy_node(redis_cluster, port), f"cluster node BUSY, {aio_backend} async")
        finally:
            await cache.close()

    assert asyncio.run(main()).errors == []


# -- a Sentinel failover --------------------------------------------------------------------------


def test_a_sentinel_failover_under_load(redis_backend: str, server_kind: str) -> None:
    """16 threads lock through a planned Sentinel failover: the old primary answers
    READONLY once demoted, and the retry asks the sentinels again."""
    from .test_sentinel import SERVICE, _wait, start_topology

    topo = start_topology(server_kind)
    try:
        old = topo.primary_port()
        cache = hotlock.connect(topo.url, backend=redis_backend, timeout=TIMEOUT)  # type: ignore[arg-type]

        def failover() -> None:
            with topo.sentinel() as s:
                s.execute_command("SENTINEL", "FAILOVER", SERVICE)
            _wait("the switch", lambda: topo.primary_port() != old)
            time.sleep(0.5)

        try:
            tally = _load_sync(cache, failover, f"Sentinel failover, {redis_backend} threads")
        finally:
            cache.close()
    finally:
        topo.stop()
    assert tally.errors == []
