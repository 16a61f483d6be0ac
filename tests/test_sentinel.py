"""Sentinel: a primary, a replica and three sentinels on loopback, and what a failover does
to locks.

The sentinels run with a 400 ms down-after and a 2 s failover timeout so a whole failover
takes a couple of seconds. Every topology is private to its test and stopped by pid.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import signal
import subprocess
import tempfile
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import pytest
import redis

import hotlock
import hotlock.aio
from hotlock import CacheError, LockLost, LockNotAcquired
from hotlock._config import parse_url
from hotlock.backends.native import native_aio

from .conftest import REQUIRE_NATIVE, RedisServer, free_port, lock_name, server_exe, start_redis
from .faultproxy import FaultProxy

# Each test starts its own topology and most wait out a failover. On the first server kind
# (Redis) in make test; on Valkey (its own sentinel mode) the discovery and the planned
# failover are followed in make test too (the two tests marked slow_variants() below), the
# rest in make test-slow.
pytestmark = pytest.mark.slow_variants("server_kind")

SERVICE = "mymaster"
# Short timeouts: the gap a failover leaves is made of them.
TIMEOUT = 0.3


@dataclass
class Topology:
    primary: RedisServer
    replica: RedisServer
    sentinel_ports: list[int]
    workdir: str
    proxy: FaultProxy | None = None  # between the replica and the primary, when asked for
    sentinels: list[subprocess.Popen[bytes]] = field(default_factory=list)

    @property
    def url(self) -> str:
        hosts = ",".join(f"127.0.0.1:{p}" for p in self.sentinel_ports)
        return f"redis+sentinel://{hosts}/{SERVICE}"

    def sentinel(self, i: int = 0) -> redis.Redis:
        return redis.Redis(port=self.sentinel_ports[i], socket_timeout=2)

    def primary_port(self) -> int:
        """The primary's port as the first sentinel names it now."""
        with self.sentinel() as s:
            _host, port = s.execute_command("SENTINEL", "get-master-addr-by-name", SERVICE)
        return int(port)

    def node(self, port: int) -> redis.Redis:
        return redis.Redis(port=port, socket_timeout=2)

    def stop(self) -> None:
        for proc in self.sentinels:
            proc.send_signal(signal.SIGTERM)
        for proc in self.sentinels:
            try:
                proc.wait(5)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        if self.proxy is not None:
            self.proxy.stop()
        self.replica.stop()
        self.primary.stop()
        shutil.rmtree(self.workdir, ignore_errors=True)


def _wait(what: str, ok: object, timeout: float = 15.0) -> None:
    deadline = time.monotonic() + timeout
    while True:
        try:
            if ok():  # type: ignore[operator]
                return
        except redis.RedisError:
            pass
        if time.monotonic() > deadline:
            pytest.fail(f"timed out waiting for {what}")
        time.sleep(0.05)


def _replica_acks(primary: RedisServer) -> bool:
    side = primary.client()
    side.set("topology-ack", 1)
    side.delete("topology-ack")
    return int(side.wait(1, 100)) >= 1


def _ping_period(topo: Topology, i: int, ms: int) -> int:
    """Set sentinel i's ping period (which also paces its reconnects) to ``ms``, once it
    answers; return the one it had (SENTINEL DEBUG, Redis 7.0+ and Valkey)."""

    def answers() -> bool:
        with topo.sentinel(i) as s:
            return bool(s.ping())

    _wait(f"sentinel {i} to answer", answers)
    with topo.sentinel(i) as s:
        was = s.execute_command("SENTINEL", "DEBUG")[b"PING-PERIOD"]  # redis-py makes it a dict
        s.execute_command("SENTINEL", "DEBUG", "PING-PERIOD", ms)
    return int(was)


def start_topology(kind: str, replica_via_proxy: bool = False) -> Topology:
    """A primary, a replica and three sentinels, all of ``kind``: Valkey's sentinels are its
    own sentinel mode (valkey-server --sentinel), Redis's are redis-sentinel."""
    # No 5 s pause before a full sync (the diskless default), on either side: the replica
    # syncs at start, and the old primary from the new one after a failover.
    fast_sync = ("--repl-diskless-sync-delay", "0")
    primary = start_redis(*fast_sync, kind=kind)
    proxy = FaultProxy(primary.port).start() if replica_via_proxy else None
    upstream = proxy.port if proxy is not None else primary.port
    replica = start_redis(*fast_sync, "--replicaof", "127.0.0.1", str(upstream), kind=kind)
    workdir = tempfile.mkdtemp(prefix="hotlock-sentinel-")
    # Sentinel "fixes" a replica whose master address is not the primary's (ours points at
    # the proxy) once failover-timeout has passed; a long one keeps the proxy in the path.
    failover_timeout_ms = 60_000 if replica_via_proxy else 2000
    topo = Topology(primary, replica, [free_port() for _ in range(3)], workdir, proxy)
    # Each sentinel is told its own id, the replica and the other two up front (the lines a
    # sentinel writes to its own config once it has found them), and, while it starts,
    # retries a link every 0.1 s, not every 1 s: the first to start finds the others not
    # yet listening. Left to find each other by the hellos every 2 s they took 2-3 s.
    ids = {port: os.urandom(20).hex() for port in topo.sentinel_ports}
    try:
        _wait("the replica to sync", lambda: replica.client().info("replication")["master_link_status"] == "up")
        # ...and to have acknowledged a write: after a diskless sync the primary sends the
        # replica nothing (a WAIT's GETACK included) until the replica's first ACK, up to
        # a second later, and a test under wait_replicas would see 0 replicas.
        _wait("the replica to acknowledge a write", lambda: _replica_acks(primary))
        for port in topo.sentinel_ports:
            conf = os.path.join(workdir, f"sentinel-{port}.conf")
            known = "".join(
                f"sentinel known-sentinel {SERVICE} 127.0.0.1 {other} {ids[other]}\n"
                for other in topo.sentinel_ports
                if other != port
            )
            with open(conf, "w") as f:
                f.write(
                    f"port {port}\nbind 127.0.0.1\ndaemonize no\ndir {workdir}\n"
                    f"logfile {workdir}/sentinel-{port}.log\n"
                    f"sentinel myid {ids[port]}\n"
                    f"sentinel monitor {SERVICE} 127.0.0.1 {primary.port} 2\n"
                    # Fast detection and retries keep a failover to a couple of seconds.
                    f"sentinel down-after-milliseconds {SERVICE} 400\n"
                    f"sentinel failover-timeout {SERVICE} {failover_timeout_ms}\n"
                    f"sentinel known-replica {SERVICE} 127.0.0.1 {replica.port}\n"
                    f"{known}"
                )
            exe = server_exe(kind, sentinel=True)
            topo.sentinels.append(
                subprocess.Popen([exe[0], conf, *exe[1:]], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            )
        ping_periods = [_ping_period(topo, i, 100) for i in range(3)]

        def down(instance: dict[str, object]) -> bool:
            return bool(instance["is_sdown"] or instance["is_disconnected"])

        def ready() -> bool:
            # Every sentinel is connected to the primary, the replica and the other two, none
            # of them marked down, and has read the replica's INFO: a replica never read is
            # no candidate to promote.
            for i in range(3):
                with topo.sentinel(i) as s:
                    primary_state = s.sentinel_master(SERVICE)
                    others = s.sentinel_sentinels(SERVICE)
                    replicas = s.sentinel_slaves(SERVICE)
                if down(primary_state) or len(others) != 2 or any(down(o) for o in others):
                    return False
                if len(replicas) != 1 or down(replicas[0]) or not replicas[0]["runid"]:
                    return False
                if replicas[0]["master-link-status"] != "ok":
                    return False
            return True

        _wait("three sentinels that know the replica and each other", ready)
        for i, period in enumerate(ping_periods):
            _ping_period(topo, i, period)
    except BaseException:
        topo.stop()
        raise
    return topo


@pytest.fixture
def topology(server_kind: str) -> Iterator[Topology]:
    topo = start_topology(server_kind)
    yield topo
    topo.stop()


@pytest.fixture
def proxied_topology(server_kind: str) -> Iterator[Topology]:
    topo = start_topology(server_kind, replica_via_proxy=True)
    yield topo
    topo.stop()


# -- the URL --------------------------------------------------------------------------


def test_sentinel_url_form() -> None:
    config = parse_url(
        "redis+sentinel://app:s3cret@10.0.0.1:26379,10.0.0.2,[::1]:26380/mymaster/3", connect_timeout=1, timeout=1
    )
    assert config.sentinels == (("10.0.0.1", 26379), ("10.0.0.2", 26379), ("::1", 26380))
    assert config.service == "mymaster" and config.db == 3
    assert config.username == "app" and config.password == "s3cret"
    assert config.display == "redis+sentinel://10.0.0.1:26379,10.0.0.2:26379,[::1]:26380/mymaster/3"
    assert "s3cret" not in repr(config)
    assert parse_url("redis+sentinel://h/svc", connect_timeout=1, timeout=1).db == 0


@pytest.mark.parametrize(
    "url", ["redis+sentinel://h1,h2", "redis+sentinel://h1,h2/", "redis+sentinel:///svc", "redis+sentinel://h:x/svc"]
)
def test_bad_sentinel_urls_are_value_errors(url: str) -> None:
    with pytest.raises(ValueError):
        parse_url(url, connect_timeout=1, timeout=1)


@pytest.mark.slow_variants()
def test_unknown_service_is_a_cache_error_naming_it(redis_backend: str, topology: Topology) -> None:
    url = topology.url.replace(SERVICE, "nosuch")
    with pytest.raises(CacheError, match="nosuch"):
        hotlock.connect(url, backend=redis_backend, timeout=TIMEOUT, connect_timeout=TIMEOUT)


# -- following the primary ------------------------------------------------------------


def _lock_until_on_new_primary(cache: hotlock.Cache, topo: Topology, old_port: int, budget: float) -> dict[str, object]:
    """Lock fresh keys in a loop until one is granted by a new primary; record the gap.

    Returns when the switch was seen (sentinels name another primary), when the first lock
    landed on the new primary, and every error seen meanwhile.
    """
    errors: list[BaseException] = []
    switched = landed = None
    deadline = time.monotonic() + budget
    i = 0
    while time.monotonic() < deadline:
        i += 1
        now = time.monotonic()
        port = topo.primary_port()
        if switched is None and port != old_port:
            switched = now
        try:
            lock = cache.lock(f"gap-{i}", ttl=5)
        except Exception as exc:
            errors.append(exc)
            time.sleep(0.02)
            continue
        if port != old_port and topo.node(port).get(lock_name(f"gap-{i}".encode())) == lock._token:
            landed = time.monotonic()
            break
        try:
            lock.unlock()
        except CacheError as exc:
            errors.append(exc)
        time.sleep(0.02)
    return {"switched": switched, "landed": landed, "errors": errors}


def _check_resumed(outcome: dict[str, object]) -> None:
    switched, landed, errors = outcome["switched"], outcome["landed"], outcome["errors"]
    assert switched is not None, "the sentinels never named a new primary"
    assert landed is not None, f"no lock landed on the new primary; errors: {errors}"
    print(f"\nresumed {landed - switched:.3f} s after the switch; {len(errors)} CacheErrors in the gap")  # type: ignore[operator]
    # Resumed soon after the sentinels' switch: a client asks them again every 0.5 s
    # (typically resumed 0.4-0.5 s after it here), where one that did not would write to
    # the old primary until Sentinel demotes it (up to its 10 s INFO period). 4 s leaves a
    # loaded machine room and still tells the two apart.
    assert landed - switched < 4.0, landed - switched  # type: ignore[operator]
    # The gap shows only as CacheError: never "held elsewhere", never anything else.
    assert all(type(e) is CacheError for e in errors), {type(e).__name__ for e in errors}  # type: ignore[attr-defined]


@pytest.mark.slow_variants()
def test_follows_the_primary_through_sentinel_failover(redis_backend: str, topology: Topology) -> None:
    old = topology.primary_port()
    cache = hotlock.connect(topology.url, backend=redis_backend, timeout=TIMEOUT, connect_timeout=TIMEOUT)
    try:
        assert cache.lock("before", ttl=5).unlock() is True
        assert topology.node(old).info("replication")["role"] == "master"
        with topology.sentinel() as s:
            s.execute_command("SENTINEL", "FAILOVER", SERVICE)
        outcome = _lock_until_on_new_primary(cache, topology, old, budget=15)
        _check_resumed(outcome)
    finally:
        cache.close()


def test_follows_the_primary_after_sigkill(redis_backend: str, topology: Topology) -> None:
    old = topology.primary_port()
    cache = hotlock.connect(topology.url, backend=redis_backend, timeout=TIMEOUT, connect_timeout=TIMEOUT)
    try:
        assert cache.lock("before", ttl=5).unlock() is True
        assert topology.primary.proc is not None
        topology.primary.proc.kill()  # no goodbye: the sentinels notice after down-after-milliseconds
        topology.primary.proc.wait(5)
        outcome = _lock_until_on_new_primary(cache, topology, old, budget=20)
        _check_resumed(outcome)
        assert outcome["errors"], "the gap should have been visible as CacheError"
    finally:
        cache.close()


# -- the two-holder window, and wait_replicas -----------------------------------------


def _failover_to_the_stale_replica(topo: Topology) -> int:
    """Fail over while the replica's link is blackholed; return the new primary's port."""
    old = topo.primary_port()
    with topo.sentinel() as s:
        s.execute_command("SENTINEL", "FAILOVER", SERVICE)
    _wait("the sentinels to name the replica", lambda: topo.primary_port() != old)
    new = topo.primary_port()
    assert new == topo.replica.port
    return new


def test_failover_can_give_two_holders(redis_backend: str, proxied_topology: Topology) -> None:
    """The documented window: granted by the primary, lost with it, granted again."""
    topo = proxied_topology
    assert topo.proxy is not None
    a = hotlock.connect(topo.url, backend=redis_backend, timeout=TIMEOUT, connect_timeout=TIMEOUT)
    try:
        topo.proxy.blackhole(True)  # replication stops reaching the replica (it does not know yet)
        first = a.lock("invoice-1", ttl=30)  # the primary grants it and answers at once
        assert topo.node(topo.replica.port).get(lock_name(b"invoice-1")) is None
        new = _failover_to_the_stale_replica(topo)
        b = hotlock.connect(topo.url, backend=redis_backend, timeout=TIMEOUT, connect_timeout=TIMEOUT)
        try:
            second = b.lock("invoice-1", ttl=30)  # the promoted replica never saw the first
            # Two holders of one key, each with a valid-looking lease: why the protected
            # resource must check an idempotency key or a fencing token.
            assert first.valid_for() > 20 and second.valid_for() > 20
            assert topo.node(new).get(lock_name(b"invoice-1")) == second._token
        finally:
            b.close()
    finally:
        a.close()


def test_wait_replicas_confirms_when_replicas_keep_up(redis_backend: str, proxied_topology: Topology) -> None:
    topo = proxied_topology
    cache = hotlock.connect(topo.url, backend=redis_backend, timeout=TIMEOUT, wait_replicas=1, wait_timeout=0.2)
    try:
        lock = cache.lock("confirmed", ttl=30)
        # WAIT returned only once the replica had it.
        assert topo.node(topo.replica.port).get(lock_name(b"confirmed")) == lock._token
        assert cache.lock_many(["m1", "m2"], ttl=30)[0] is not None
        assert lock.unlock() is True
    finally:
        cache.close()


def test_wait_replicas_closes_the_simple_two_holder_window(redis_backend: str, proxied_topology: Topology) -> None:
    topo = proxied_topology
    assert topo.proxy is not None
    a = hotlock.connect(topo.url, backend=redis_backend, timeout=TIMEOUT, wait_replicas=1, wait_timeout=0.2)
    try:
        topo.proxy.blackhole(True)
        started = time.monotonic()
        # The replica cannot confirm: the acquire is undone and reported as an outage, so A
        # never believes it holds the lock...
        with pytest.raises(CacheError, match="replicas"):
            a.lock("invoice-1", ttl=30)
        assert time.monotonic() - started < 0.2 + TIMEOUT + 0.2
        assert topo.node(topo.primary.port).get(lock_name(b"invoice-1")) is None
        with pytest.raises(CacheError, match="replicas"):
            a.lock_many(["invoice-2", "invoice-3"], ttl=30)
        with pytest.raises(CacheError, match="replicas"):
            a.lock_wait("invoice-4", ttl=30, wait=1)
        assert topo.node(topo.primary.port).keys(lock_name(b"*")) == []
        # ...and after the failover there is exactly one holder.
        _failover_to_the_stale_replica(topo)
        b = hotlock.connect(topo.url, backend=redis_backend, timeout=TIMEOUT)
        try:
            b.lock("invoice-1", ttl=30)
            with pytest.raises(LockNotAcquired):
                b.lock("invoice-1", ttl=30)
        finally:
            b.close()
    finally:
        a.close()


def test_wait_replicas_confirms_renewals_under_sentinel(redis_backend: str, proxied_topology: Topology) -> None:
    """A lease confirmed before the replica's link is cut is not renewed past the cut:
    the isolated primary's extend is unconfirmed, so its holder (sync and async) is told
    the lease is lost, where it would otherwise go on renewing a lock the promoted replica
    lets expire and grants to someone else."""
    topo = proxied_topology
    assert topo.proxy is not None
    if redis_backend == "native" and native_aio()[0] is None:
        pytest.fail(f"the native async backend is not live: {native_aio()[1]}")
    settings: dict[str, Any] = {"timeout": TIMEOUT, "wait_replicas": 1, "wait_timeout": 0.2}
    a = hotlock.connect(topo.url, backend=redis_backend, **settings)

    ready, cut = threading.Event(), threading.Event()

    async def extend_async() -> None:
        async with await hotlock.aio.connect(topo.url, backend=redis_backend, **settings) as cache:
            lock = await cache.lock("invoice-2", ttl=30)
            await lock.extend(30)  # confirmed
            ready.set()
            await asyncio.get_running_loop().run_in_executor(None, cut.wait)
            with pytest.raises(LockLost, match="extend undone: 0 of 1 replicas"):
                await lock.extend(30)
            assert lock.lost

    try:
        lock = a.lock("invoice-1", ttl=30)
        lock.extend(30)  # confirmed: the replica has the new TTL
        assert topo.node(topo.replica.port).pttl(lock_name(b"invoice-1")) > 20_000
        aside = threading.Thread(target=lambda: asyncio.run(extend_async()))
        aside.start()
        assert ready.wait(30)
        topo.proxy.blackhole(True)
        cut.set()
        started = time.monotonic()
        with pytest.raises(LockLost, match="extend undone: 0 of 1 replicas"):
            lock.extend(30)
        assert time.monotonic() - started < 0.2 + TIMEOUT + 3.0
        assert lock.lost
        aside.join(30)
        assert not aside.is_alive()
        # Released on the primary: nothing of either lease is left there to be renewed.
        assert topo.node(topo.primary.port).keys(lock_name(b"*")) == []
    finally:
        a.close()


def test_errors_during_a_failover_under_load_are_cache_errors(redis_backend: str, topology: Topology) -> None:
    """Four threads lock and unlock through a failover: nothing but CacheError escapes."""
    cache = hotlock.connect(topology.url, backend=redis_backend, timeout=TIMEOUT, connect_timeout=TIMEOUT)
    stop = threading.Event()
    seen: list[str] = []
    done = [0]

    def worker(n: int) -> None:
        i = 0
        while not stop.is_set():
            i += 1
            try:
                with cache.lock(f"load-{n}-{i}", ttl=5):
                    done[0] += 1
            except CacheError:
                time.sleep(0.01)
            except Exception as exc:
                seen.append(type(exc).__name__)

    threads = [threading.Thread(target=worker, args=(n,)) for n in range(4)]
    for t in threads:
        t.start()
    try:
        time.sleep(0.3)
        old = topology.primary_port()
        with topology.sentinel() as s:
            s.execute_command("SENTINEL", "FAILOVER", SERVICE)
        _wait("the switch", lambda: topology.primary_port() != old)
        before = done[0]
        time.sleep(1.0)
    finally:
        stop.set()
        for t in threads:
            t.join(10)
        cache.close()
    assert seen == []
    assert done[0] > before  # locking resumed on the new primary


# -- the async API --------------------------------------------------------------------

AIO_BACKENDS = ["redis-py"] + (["native"] if native_aio()[0] is not None or REQUIRE_NATIVE else [])


@pytest.mark.parametrize("aio_backend", AIO_BACKENDS)
def test_async_follows_the_primary_through_sentinel_failover(aio_backend: str, topology: Topology) -> None:
    if aio_backend == "native" and native_aio()[0] is None:
        pytest.fail(f"HOTLOCK_REQUIRE_EXTENSIONS=1 but the native async backend is not live: {native_aio()[1]}")

    async def main() -> dict[str, object]:
        old = topology.primary_port()
        cache = await hotlock.aio.connect(topology.url, backend=aio_backend, timeout=TIMEOUT, connect_timeout=TIMEOUT)
        try:
            assert await (await cache.lock("before", ttl=5)).unlock() is True
            with topology.sentinel() as s:
                s.execute_command("SENTINEL", "FAILOVER", SERVICE)
            errors: list[BaseException] = []
            switched = landed = None
            deadline = time.monotonic() + 15
            i = 0
            while time.monotonic() < deadline:
                i += 1
                now = time.monotonic()
                port = topology.primary_port()
                if switched is None and port != old:
                    switched = now
                try:
                    lock = await cache.lock(f"gap-{i}", ttl=5)
                except Exception as exc:
                    errors.append(exc)
                    await asyncio.sleep(0.02)
                    continue
                if port != old and topology.node(port).get(lock_name(f"gap-{i}".encode())) == lock._token:
                    landed = time.monotonic()
                    break
                await asyncio.sleep(0.02)
            return {"switched": switched, "landed": landed, "errors": errors}
        finally:
            await cache.close()

    _check_resumed(asyncio.run(main()))
