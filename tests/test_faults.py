"""Faults, each turned into a test (issue 6): ambiguous replies through the fault proxy,
a restart without persistence, SCRIPT FLUSH, eviction, fork and a paused holder.

Every test runs on each backend that talks to Redis (redis-py, native once built) and
asserts what the caller can observe, against a real redis-server.
"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator

import pytest
import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

import hotlock
import hotlock.aio
from hotlock import CacheError, LockLost, LockNotAcquired
from hotlock.aio._backend import native_aio

from .conftest import REQUIRE_NATIVE, RedisServer, lock_name, open_cache, start_redis
from .faultproxy import FaultProxy

# A short reply timeout keeps every lost-reply test fast; it is what each fault costs.
REPLY_TIMEOUT = 0.5


@pytest.fixture
def proxy(redis_server: RedisServer, redis_url: str) -> Iterator[FaultProxy]:
    with FaultProxy(redis_server.port) as p:
        yield p


@pytest.fixture
def pcache(redis_backend: str, proxy: FaultProxy) -> Iterator[hotlock.Cache]:
    """A cache whose every byte goes through the fault proxy."""
    c = open_cache(redis_backend, proxy.url, timeout=REPLY_TIMEOUT, connect_timeout=REPLY_TIMEOUT)
    yield c
    proxy.clear()
    c.close()


def stored(server: RedisServer, key: str) -> bytes | None:
    value = server.client().get(lock_name(key.encode()))
    assert value is None or isinstance(value, bytes)
    return value


def commandstat(server: RedisServer, command: str) -> int:
    """How many times the server ran ``command`` (INFO commandstats), e.g. "evalsha"."""
    stats = server.client().info("commandstats")
    entry = stats.get(f"cmdstat_{command}")
    return int(entry["calls"]) if entry else 0


def test_fault_proxy_stops_promptly_with_connections_open(redis_server: RedisServer) -> None:
    """The proxy is bounded: stop() ends its thread even mid-blackhole with clients connected."""
    proxy = FaultProxy(redis_server.port).start()
    # No retries: redis-py's default ones would stretch each failure below into seconds.
    client = redis.Redis(port=proxy.port, socket_timeout=0.3, retry=Retry(NoBackoff(), 0))
    assert client.ping() is True
    proxy.blackhole(True)
    with pytest.raises(redis.TimeoutError):
        client.ping()
    started = time.monotonic()
    proxy.stop()
    assert time.monotonic() - started < 2.0
    assert not proxy._thread.is_alive()
    with pytest.raises(redis.ConnectionError):
        client.ping()  # nothing listens any more
    client.close()


# -- ambiguous replies ----------------------------------------------------------------


def test_lost_acquire_reply_is_recovered_by_the_same_token_retry(
    pcache: hotlock.Cache, proxy: FaultProxy, redis_server: RedisServer
) -> None:
    # The server runs the acquire, the reply never arrives: the retry with the same token
    # must find "already my token" and report success, not "held elsewhere".
    proxy.drop_replies(1)
    lock = pcache.lock("lost-acquire", ttl=10)
    assert proxy.dropped_replies == 1
    assert stored(redis_server, "lost-acquire") == lock._token
    assert lock.unlock() is True
    assert stored(redis_server, "lost-acquire") is None


def test_lost_acquire_reply_under_contention_is_still_a_conflict(
    pcache: hotlock.Cache, proxy: FaultProxy, redis_server: RedisServer
) -> None:
    holder = pcache.lock("contended", ttl=10)
    proxy.drop_replies(1)
    with pytest.raises(LockNotAcquired):
        pcache.lock("contended", ttl=10)
    assert stored(redis_server, "contended") == holder._token


@pytest.mark.parametrize("fault", ["drop_reply", "drop_request", "reset_after_request", "reset_now"])
def test_after_one_lost_message_holding_a_lock_iff_the_key_holds_its_token(
    pcache: hotlock.Cache, proxy: FaultProxy, redis_server: RedisServer, fault: str
) -> None:
    """One message lost per call, many calls: the outcome always matches the server."""
    for i in range(5):
        key = f"iff-{fault}-{i}"
        if fault == "drop_reply":
            proxy.drop_replies(1)
        elif fault == "drop_request":
            proxy.drop_requests(1)
        elif fault == "reset_after_request":
            proxy.reset_after_request(1)
        else:
            proxy.reset()
        try:
            lock = pcache.lock(key, ttl=10)
        except CacheError:
            # Allowed only when the server does not hold a lock we failed to report.
            assert stored(redis_server, key) is None
        else:
            assert stored(redis_server, key) == lock._token
            assert lock.unlock() is True
        proxy.clear()


def test_lost_release_reply_raises_nothing_and_the_key_is_gone(
    pcache: hotlock.Cache, proxy: FaultProxy, redis_server: RedisServer
) -> None:
    lock = pcache.lock("lost-release", ttl=10)
    proxy.drop_replies(1)
    lock.unlock()  # no exception: the release ran, only its reply was lost
    assert proxy.dropped_replies == 1
    assert stored(redis_server, "lost-release") is None
    assert lock.unlock() is False  # idempotent: nothing more to release


def test_lost_release_reply_in_a_with_block_is_silent(
    pcache: hotlock.Cache, proxy: FaultProxy, redis_server: RedisServer, caplog: pytest.LogCaptureFixture
) -> None:
    with pcache.lock("lost-release-with", ttl=10):
        proxy.drop_replies(1)
    assert stored(redis_server, "lost-release-with") is None
    assert not [r for r in caplog.records if r.levelname == "WARNING" and "release" in r.getMessage()]


def test_blackhole_during_lock_wait_is_a_cache_error_within_wait_plus_one_reply_timeout(
    pcache: hotlock.Cache, proxy: FaultProxy
) -> None:
    pcache.lock("busy", ttl=30)  # held elsewhere: lock_wait polls
    wait = 1.0
    started = time.monotonic()
    # Blackhole mid-wait, from another thread: an attempt in flight then loses its reply
    # right before the deadline, the worst moment for the lost-reply retry.
    timer = threading.Timer(0.8, proxy.blackhole, (True,))
    timer.start()
    try:
        with pytest.raises(CacheError):
            pcache.lock_wait("busy", ttl=5, wait=wait)
    finally:
        timer.cancel()
    elapsed = time.monotonic() - started
    # Not ten silent retries, and not a second full reply timeout for the same-token retry.
    assert elapsed < wait + REPLY_TIMEOUT + 0.15, elapsed
    assert elapsed >= 0.8


def test_blackhole_from_the_start_of_lock_wait(pcache: hotlock.Cache, proxy: FaultProxy) -> None:
    pcache.lock("busy2", ttl=30)
    proxy.blackhole(True)
    started = time.monotonic()
    with pytest.raises(CacheError):
        pcache.lock_wait("busy2", ttl=5, wait=1.0)
    assert time.monotonic() - started < 1.0 + REPLY_TIMEOUT + 0.15


def test_blackhole_costs_one_reply_timeout_for_extend_and_unlock(pcache: hotlock.Cache, proxy: FaultProxy) -> None:
    lock = pcache.lock("bh", ttl=30)
    proxy.blackhole(True)
    for call in (lambda: lock.extend(30), lock.unlock):
        started = time.monotonic()
        with pytest.raises(CacheError):
            call()
        # A release retries once after a lost reply; the pair shares one reply timeout... or
        # two at most. Never ten.
        assert time.monotonic() - started < 2 * REPLY_TIMEOUT + 0.3


def test_reset_mid_extend_is_a_cache_error_and_the_next_extend_decides(
    pcache: hotlock.Cache, proxy: FaultProxy, redis_server: RedisServer
) -> None:
    lock = pcache.lock("reset-extend", ttl=10)
    proxy.reset_after_request(1)
    with pytest.raises(CacheError):
        lock.extend(20)
    # The extend may or may not have run; either way the next one is exact.
    lock.extend(20)
    assert 19_000 < redis_server.client().pttl(lock_name(b"reset-extend")) <= 20_000
    # And once another token sits there, the next extend is LockLost, not a CacheError.
    redis_server.client().set(lock_name(b"reset-extend"), b"someone-else", px=10_000)
    proxy.reset_after_request(1)
    with pytest.raises(CacheError):
        lock.extend(20)
    with pytest.raises(LockLost):
        lock.extend(20)


# -- restart and script cache ---------------------------------------------------------


def restart(server: RedisServer) -> None:
    """SIGKILL ``server`` and start a fresh one, without persistence, on the same port."""
    assert server.proc is not None
    args = list(server.proc.args)  # type: ignore[arg-type]
    server.proc.kill()
    server.proc.wait(10)
    if server._client is not None:
        server._client.close()
    server.proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    server.pid = server.proc.pid
    deadline = time.monotonic() + 10
    while True:
        try:
            if server.client().ping():
                return
        except redis.ConnectionError:
            pass
        assert server.proc.poll() is None and time.monotonic() < deadline, "redis-server did not restart"
        time.sleep(0.02)


@pytest.fixture
def own_server(server_kind: str) -> Iterator[RedisServer]:
    """A private server of this test's kind that it may restart, fill or reconfigure."""
    server = start_redis(kind=server_kind)
    yield server
    server.stop()


def test_restart_without_persistence_mid_hold(redis_backend: str, own_server: RedisServer) -> None:
    cache = open_cache(redis_backend, own_server.url, timeout=REPLY_TIMEOUT)
    try:
        held = cache.lock("restart", ttl=30)
        restart(own_server)
        # The new server forgot the lock: extend says so (stale connection, empty script
        # cache and all), rather than a CacheError or a false success.
        with pytest.raises(LockLost):
            held.extend(30)
        # No user action: the same cache grants the key again, and other keys too.
        again = cache.lock("restart", ttl=30)
        assert stored(own_server, "restart") == again._token
        assert cache.lock("other", ttl=30).unlock() is True
        assert held.unlock() is False
        assert again.unlock() is True
    finally:
        cache.close()


def test_restart_between_calls_costs_no_error(redis_backend: str, own_server: RedisServer) -> None:
    cache = open_cache(redis_backend, own_server.url, timeout=REPLY_TIMEOUT)
    try:
        cache.lock("warm", ttl=5).unlock()  # a pooled connection now exists
        restart(own_server)
        # The pooled connection is dead; the first call notices before sending and reconnects.
        lock = cache.lock("after-restart", ttl=5)
        assert lock.unlock() is True
    finally:
        cache.close()


def test_script_flush_costs_one_reload_per_flush(rcache: hotlock.Cache, redis_server: RedisServer) -> None:
    rcache.lock("warm", ttl=5).unlock()
    client = redis_server.client()
    loads, evalsha = commandstat(redis_server, "script|load"), commandstat(redis_server, "evalsha")
    flushes, calls = 5, 0
    for _ in range(flushes):
        client.script_flush()
        for i in range(10):
            lock = rcache.lock(f"flush-{i}", ttl=5)
            lock.extend(5)
            assert lock.unlock() is True
            calls += 3
    # Each flush: one EVALSHA answered NOSCRIPT, then the three scripts loaded once, and
    # every later call of every script runs first time. On the Lua-free path (Valkey 9)
    # only the acquire is a script: extend and release send none.
    if rcache.server_info["lua_free"]:
        calls //= 3
    assert commandstat(redis_server, "evalsha") - evalsha == calls + flushes
    assert commandstat(redis_server, "script|load") - loads == flushes * 3


def test_readonly_is_a_cache_error_that_drops_the_connection(redis_backend: str, own_server: RedisServer) -> None:
    """A primary demoted under a client (what a failover does to the old one)."""
    other = start_redis(kind=own_server.kind)
    cache = open_cache(redis_backend, own_server.url, timeout=REPLY_TIMEOUT)
    try:
        cache.lock("before", ttl=5).unlock()
        own_server.client().replicaof("127.0.0.1", other.port)
        with pytest.raises(CacheError, match="READONLY") as info:
            cache.lock("refused", ttl=5)
        assert not isinstance(info.value, LockNotAcquired)
        own_server.client().replicaof("NO", "ONE")
        connects = int(own_server.client().info("stats")["total_connections_received"])
        # The connection that saw READONLY was dropped: the next call makes a new one.
        cache.lock("after", ttl=5)
        assert int(own_server.client().info("stats")["total_connections_received"]) > connects
    finally:
        cache.close()
        other.stop()


# -- eviction -------------------------------------------------------------------------


@pytest.mark.parametrize("policy", ["allkeys-lru", "volatile-ttl", "volatile-lru"])
def test_evicting_policy_is_warned_and_an_evicted_lock_is_lost(
    redis_backend: str, own_server: RedisServer, policy: str, caplog: pytest.LogCaptureFixture
) -> None:
    own_server.client().config_set("maxmemory-policy", policy)
    caplog.set_level("INFO", logger="hotlock")
    cache = open_cache(redis_backend, own_server.url, timeout=REPLY_TIMEOUT)
    try:
        warnings = [r for r in caplog.records if r.name == "hotlock" and r.levelname == "WARNING"]
        assert len(warnings) == 1 and policy in warnings[0].getMessage(), warnings
        lock = cache.lock("evicted", ttl=30)
        # A 1-byte limit: the next command makes Redis evict what the policy allows, and
        # under every policy here that includes the lock key (it has a TTL).
        own_server.client().config_set("maxmemory", 1)
        with pytest.raises(LockLost):
            lock.extend(30)
    finally:
        own_server.client().config_set("maxmemory", 0)
        cache.close()


def test_noeviction_is_not_warned_and_at_maxmemory_lock_is_an_oom_cache_error(
    redis_backend: str, own_server: RedisServer, caplog: pytest.LogCaptureFixture
) -> None:
    own_server.client().config_set("maxmemory-policy", "noeviction")
    caplog.set_level("INFO", logger="hotlock")
    cache = open_cache(redis_backend, own_server.url, timeout=REPLY_TIMEOUT)
    try:
        assert not [r for r in caplog.records if r.name == "hotlock" and r.levelname == "WARNING"]
        held = [cache.lock(f"held-{i}", ttl=30) for i in range(3)]
        own_server.client().config_set("maxmemory", 1)
        with pytest.raises(CacheError, match="OOM") as info:
            cache.lock("new", ttl=30)
        assert not isinstance(info.value, LockNotAcquired)
        assert stored(own_server, "new") is None
        # What frees or keeps memory still works: extend (PEXPIRE) and unlock (DEL).
        held[0].extend(60)
        assert 59_000 < own_server.client().pttl(lock_name(b"held-0")) <= 60_000
        assert cache.extend_many(held[1:], 60) == [True, True]
        assert held[0].unlock() is True
        assert cache.unlock_many(held[1:]) == [True, True]
        with pytest.raises(CacheError, match="OOM"):
            cache.set_nx("once", "1", ttl=30)
    finally:
        own_server.client().config_set("maxmemory", 0)
        cache.close()


# -- fork -----------------------------------------------------------------------------


def _in_child(body: Callable[[], int], timeout: float = 30.0) -> int:
    """Run ``body`` in a forked child; return its exit status (body's return value)."""
    pid = os.fork()
    if pid == 0:  # the child: never return into pytest
        code = 99
        try:
            code = body()
        finally:
            os._exit(code)
    deadline = time.monotonic() + timeout
    while True:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            return os.waitstatus_to_exitcode(status)
        if time.monotonic() > deadline:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
            pytest.fail("forked child did not finish in time")
        time.sleep(0.01)


def test_forked_child_never_reads_the_parents_replies(rcache: hotlock.Cache) -> None:
    # The parent has a live connection before the fork; both sides then hammer it. Every
    # reply is predictable (a private counter counts 1, 2, 3...), so a shared socket would
    # hand one side the other's replies and show up as mismatches.
    assert rcache.incr("warm") == 1
    calls = 2000

    def hammer(name: str) -> int:
        mismatches = 0
        for i in range(1, calls + 1):
            if i % 4 == 0:
                lock = rcache.lock(f"{name}-lock", ttl=5)
                mismatches += lock.unlock() is not True
            elif rcache.incr(name) != i - i // 4:
                mismatches += 1
        return mismatches

    pid_before = os.getpid()
    status: list[int] = []
    child = threading.Thread(target=lambda: status.append(_in_child(lambda: min(hammer("child"), 90))))
    child.start()
    parent_mismatches = hammer("parent")
    child.join(60)
    assert os.getpid() == pid_before
    assert parent_mismatches == 0
    assert status == [0], f"child saw {status} mismatches (90 = 90 or more)"


def test_forked_child_cannot_release_or_extend_the_parents_lock(
    rcache: hotlock.Cache, redis_server: RedisServer
) -> None:
    lock = rcache.lock("parent-held", ttl=30)

    def child() -> int:
        try:
            lock.extend(60)
        except LockLost:
            pass
        else:
            return 1
        if lock.unlock() is not False:
            return 2
        if rcache.unlock_many([lock]) != [False] or rcache.extend_many([lock], 60) != [False]:
            return 3
        return 0

    assert _in_child(child) == 0
    assert stored(redis_server, "parent-held") == lock._token
    assert redis_server.client().pttl(lock_name(b"parent-held")) <= 30_000  # not extended by the child
    assert lock.unlock() is True


# -- a paused holder ------------------------------------------------------------------

_HOLDER = r"""
import sys, hotlock
cache = hotlock.connect(sys.argv[1], backend=sys.argv[2], timeout=2)
lock = cache.lock("paused", ttl=float(sys.argv[3]))
print("held", flush=True)
sys.stdin.readline()          # the test stops us with SIGSTOP around here, then resumes
try:
    lock.extend(5)
except hotlock.LockLost:
    print("LockLost", flush=True)
except Exception as exc:
    print(type(exc).__name__, flush=True)
else:
    print("extended", flush=True)
"""


@pytest.mark.parametrize("taken_over", [False, True])
def test_holder_paused_past_its_ttl_gets_lock_lost_on_first_extend(
    redis_backend: str, rcache: hotlock.Cache, redis_url: str, taken_over: bool
) -> None:
    ttl = 0.3
    cmd = [sys.executable, "-c", _HOLDER, redis_url, redis_backend, str(ttl)]
    with subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True) as proc:
        try:
            assert proc.stdout is not None and proc.stdin is not None
            assert proc.stdout.readline().strip() == "held"
            os.kill(proc.pid, signal.SIGSTOP)  # a GC pause, a VM migration, a laptop lid
            time.sleep(ttl + 0.2)
            if taken_over:
                rcache.lock("paused", ttl=30)  # the lock expired: someone else rightly has it now
            os.kill(proc.pid, signal.SIGCONT)
            proc.stdin.write("go\n")
            proc.stdin.flush()
            # Resumed, the holder cannot tell it was paused; its first extend tells it.
            assert proc.stdout.readline().strip() == "LockLost"
            assert proc.wait(10) == 0
        finally:
            if proc.poll() is None:
                proc.kill()


# -- the async API: the same lost replies ---------------------------------------------

AIO_BACKENDS = ["redis-py"] + (["native"] if native_aio()[0] is not None or REQUIRE_NATIVE else [])


@pytest.fixture(params=AIO_BACKENDS)
def aio_backend(request: pytest.FixtureRequest) -> str:
    if request.param == "native" and native_aio()[0] is None:
        pytest.fail(f"HOTLOCK_REQUIRE_EXTENSIONS=1 but the native async backend is not live: {native_aio()[1]}")
    return str(request.param)


def test_async_blackhole_during_lock_wait_is_a_cache_error_within_wait_plus_one_reply_timeout(
    aio_backend: str, proxy: FaultProxy
) -> None:
    async def main() -> float:
        cache = await hotlock.aio.connect(proxy.url, backend=aio_backend, timeout=REPLY_TIMEOUT)
        try:
            await cache.lock("busy", ttl=30)
            loop = asyncio.get_running_loop()
            loop.call_later(0.8, proxy.blackhole, True)
            started = time.monotonic()
            with pytest.raises(CacheError):
                await cache.lock_wait("busy", ttl=5, wait=1.0)
            return time.monotonic() - started
        finally:
            proxy.clear()
            await cache.close()

    elapsed = asyncio.run(main())
    assert 0.8 <= elapsed < 1.0 + REPLY_TIMEOUT + 0.15, elapsed


@pytest.mark.parametrize("fault", ["drop_reply", "reset_after_request"])
def test_async_after_one_lost_message_holding_a_lock_iff_the_key_holds_its_token(
    aio_backend: str, proxy: FaultProxy, redis_server: RedisServer, fault: str
) -> None:
    async def main() -> None:
        cache = await hotlock.aio.connect(proxy.url, backend=aio_backend, timeout=REPLY_TIMEOUT)
        try:
            for i in range(4):
                key = f"aiff-{fault}-{i}"
                if fault == "drop_reply":
                    proxy.drop_replies(1)
                else:
                    proxy.reset_after_request(1)
                try:
                    lock = await cache.lock(key, ttl=10)
                except CacheError:
                    assert stored(redis_server, key) is None
                else:
                    assert stored(redis_server, key) == lock._token
                    proxy.drop_replies(1)  # and the release's reply is lost too: no error
                    await lock.unlock()
                    assert stored(redis_server, key) is None
                proxy.clear()
        finally:
            await cache.close()

    asyncio.run(main())


def test_async_restart_without_persistence_mid_hold(aio_backend: str, own_server: RedisServer) -> None:
    async def main() -> None:
        cache = await hotlock.aio.connect(own_server.url, backend=aio_backend, timeout=REPLY_TIMEOUT)
        try:
            held = await cache.lock("restart", ttl=30)
            restart(own_server)
            # Let the loop see the old connections close, as it would in a live application
            # (restart() blocked it; the sync test covers a connection found dead on use).
            await asyncio.sleep(0.05)
            with pytest.raises(LockLost):
                await held.extend(30)
            again = await cache.lock("restart", ttl=30)
            assert stored(own_server, "restart") == again._token
        finally:
            await cache.close()

    asyncio.run(main())
