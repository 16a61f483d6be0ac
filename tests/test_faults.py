"""Faults, each turned into a test: ambiguous replies through the fault proxy,
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
from collections.abc import Awaitable, Callable, Coroutine, Iterator
from typing import Any, TypeVar

import pytest
import redis
import uvloop
from redis.backoff import NoBackoff
from redis.retry import Retry

import hotlock
import hotlock.aio
from hotlock import CacheError, LockLost, LockNotAcquired
from hotlock._keys import stored as stored_key
from hotlock._scripts import SCRIPTS
from hotlock.backends.native import native_aio

from .conftest import REQUIRE_NATIVE, RedisServer, lock_name, open_cache, start_redis
from .faultproxy import FaultProxy

T = TypeVar("T")

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


# The faults hit the acquire, the same script on every server kind: Valkey's run is slow.
@pytest.mark.slow_variants("server_kind")
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


@pytest.mark.slow_variants("server_kind")
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


@pytest.mark.slow_variants("server_kind")
def test_blackhole_from_the_start_of_lock_wait(pcache: hotlock.Cache, proxy: FaultProxy) -> None:
    pcache.lock("busy2", ttl=30)
    proxy.blackhole(True)
    started = time.monotonic()
    with pytest.raises(CacheError):
        pcache.lock_wait("busy2", ttl=5, wait=1.0)
    assert time.monotonic() - started < 1.0 + REPLY_TIMEOUT + 0.15


@pytest.mark.slow_variants("server_kind")
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
    execs = commandstat(redis_server, "exec")
    flushes, calls = 5, 0
    for _ in range(flushes):
        client.script_flush()
        for i in range(10):
            lock = rcache.lock(f"flush-{i}", ttl=5)
            lock.extend(5)
            assert lock.unlock() is True
            calls += 3
    # Each flush: one EVALSHA answered NOSCRIPT, then every script loaded once, and
    # every later call of every script runs first time. On the Lua-free path (Valkey 9)
    # extend and release send no script, and the acquire of a free key none when it goes
    # as a transaction (EXEC): then nothing meets the flushes.
    locks = calls // 3
    by_transaction = commandstat(redis_server, "exec") - execs == locks
    scripts_per_lock = (0 if by_transaction else 1) + (0 if rcache.server_info["lua_free"] else 2)
    flushed = flushes if scripts_per_lock else 0
    assert commandstat(redis_server, "evalsha") - evalsha == locks * scripts_per_lock + flushed
    assert commandstat(redis_server, "script|load") - loads == flushed * len(SCRIPTS)


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


@pytest.mark.slow_variants("server_kind")
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


# -- a lost handshake reply ---------------------------------------------------------
#
# A fresh connection's first round trip is its handshake (native: AUTH, SELECT and the
# script loads in one write; redis-py: AUTH and SELECT). Nothing of the call has been sent
# yet, so a lost handshake reply is retried once, within the call's time budget, for every
# operation, idempotent or not. The proxy here names db 1, so redis-py has a handshake too.
#
# The operation's own reply is another matter. acquire (same token), release and the
# batches of both are safe to send twice and are resent; INCRBY and SET NX are not (a
# resent INCRBY counts twice, a resent SET NX answers "not set" for a value this call
# set), so their own lost reply is a CacheError the caller must treat as "maybe ran";
# extend's own lost reply is a CacheError too (the caller retries while valid_for() lasts).

HANDSHAKE_DB = 1


@pytest.fixture
def hproxy(redis_server: RedisServer, redis_url: str) -> Iterator[FaultProxy]:
    """A proxy whose url selects HANDSHAKE_DB, so every backend's fresh connection has a handshake."""
    with FaultProxy(redis_server.port, db=HANDSHAKE_DB) as p:
        yield p


@pytest.fixture
def side(redis_server: RedisServer) -> Iterator[redis.Redis]:
    """A plain client on HANDSHAKE_DB, to look at what the server holds."""
    client = redis.Redis(port=redis_server.port, db=HANDSHAKE_DB, socket_timeout=5)
    yield client
    client.close()


ONCE = b"hotlock:once:"
COUNT = b"hotlock:count:"


def fresh_thread(proxy: FaultProxy, call: Callable[[], T]) -> T:
    """Run ``call`` on a connection opened for it, with that connection's first reply lost.

    A new thread has no native connection yet; the reset kills the pooled redis-py ones, so
    redis-py opens a new one too. Returns what ``call`` returned (or raises what it raised)."""
    proxy.reset()
    connections, dropped = proxy.connections, proxy.dropped_replies
    proxy.drop_replies(1)
    out, elapsed = in_new_thread(call)
    assert proxy.dropped_replies - dropped == 1, "the handshake's reply was not the one dropped"
    assert proxy.connections > connections
    if isinstance(out, BaseException):
        raise out
    # One reply timeout for the lost handshake, then the retry: never more than the budget.
    assert elapsed < 2 * REPLY_TIMEOUT + 0.3, elapsed
    return out


def in_new_thread(call: Callable[[], T]) -> tuple[T | BaseException, float]:
    """What ``call`` returned or raised in a thread of its own, and how long it took."""
    out: list[T | BaseException] = []

    def body() -> None:
        try:
            out.append(call())
        except BaseException as exc:
            out.append(exc)

    started = time.monotonic()
    thread = threading.Thread(target=body)
    thread.start()
    thread.join(30)
    assert out, "the call did not return within 30 s"
    return out[0], time.monotonic() - started


@pytest.fixture
def hcache(redis_backend: str, hproxy: FaultProxy) -> Iterator[hotlock.Cache]:
    c = open_cache(redis_backend, hproxy.url, timeout=REPLY_TIMEOUT, connect_timeout=REPLY_TIMEOUT)
    yield c
    hproxy.clear()
    c.close()


def test_lost_handshake_reply_acquire(hcache: hotlock.Cache, hproxy: FaultProxy, side: redis.Redis) -> None:
    lock = fresh_thread(hproxy, lambda: hcache.lock("hs-acquire", ttl=10))
    assert side.exists(lock_name(b"hs-acquire")) == 1
    assert lock.unlock() is True
    assert side.exists(lock_name(b"hs-acquire")) == 0


def test_lost_handshake_reply_lock_wait_free(hcache: hotlock.Cache, hproxy: FaultProxy, side: redis.Redis) -> None:
    lock = fresh_thread(hproxy, lambda: hcache.lock_wait("hs-wait", ttl=10, wait=1.0))
    assert side.exists(lock_name(b"hs-wait")) == 1
    assert lock.unlock() is True


def test_lost_handshake_reply_lock_wait_then_polls_until_the_holder_expires(
    hcache: hotlock.Cache, hproxy: FaultProxy, side: redis.Redis
) -> None:
    # The first attempt's handshake is lost and retried; the attempt finds the key held, and
    # the wait goes on polling on the new connection until the holder's TTL runs out.
    hcache.lock("hs-wait-held", ttl=0.3)
    lock = fresh_thread(hproxy, lambda: hcache.lock_wait("hs-wait-held", ttl=10, wait=1.0))
    assert side.exists(lock_name(b"hs-wait-held")) == 1
    assert lock.unlock() is True


def test_lost_handshake_reply_release(hcache: hotlock.Cache, hproxy: FaultProxy, side: redis.Redis) -> None:
    lock = hcache.lock("hs-release", ttl=10)
    assert fresh_thread(hproxy, lock.unlock) is True
    assert side.exists(lock_name(b"hs-release")) == 0


def test_lost_handshake_reply_extend(hcache: hotlock.Cache, hproxy: FaultProxy, side: redis.Redis) -> None:
    lock = hcache.lock("hs-extend", ttl=10)
    fresh_thread(hproxy, lambda: lock.extend(60))
    assert 59_000 < side.pttl(lock_name(b"hs-extend")) <= 60_000
    assert lock.unlock() is True


def test_lost_handshake_reply_lock_many(hcache: hotlock.Cache, hproxy: FaultProxy, side: redis.Redis) -> None:
    hcache.lock("hs-many-b", ttl=10)  # held elsewhere: that slot is None
    locks = fresh_thread(hproxy, lambda: hcache.lock_many(["hs-many-a", "hs-many-b", "hs-many-c"], ttl=10))
    assert [lock is not None for lock in locks] == [True, False, True]
    assert side.exists(lock_name(b"hs-many-a"), lock_name(b"hs-many-c")) == 2
    assert hcache.unlock_many([lock for lock in locks if lock is not None]) == [True, True]


def test_lost_handshake_reply_extend_many(hcache: hotlock.Cache, hproxy: FaultProxy, side: redis.Redis) -> None:
    locks = [hcache.lock(f"hs-xmany-{i}", ttl=10) for i in range(2)]
    assert fresh_thread(hproxy, lambda: hcache.extend_many(locks, 60)) == [True, True]
    assert all(59_000 < side.pttl(lock_name(f"hs-xmany-{i}".encode())) <= 60_000 for i in range(2))


def test_lost_handshake_reply_unlock_many(hcache: hotlock.Cache, hproxy: FaultProxy, side: redis.Redis) -> None:
    locks = [hcache.lock(f"hs-umany-{i}", ttl=10) for i in range(2)]
    assert fresh_thread(hproxy, lambda: hcache.unlock_many(locks)) == [True, True]
    assert side.exists(*(lock_name(f"hs-umany-{i}".encode()) for i in range(2))) == 0


def test_lost_handshake_reply_set_nx_sets_once(
    hcache: hotlock.Cache, hproxy: FaultProxy, side: redis.Redis, redis_server: RedisServer
) -> None:
    before = commandstat(redis_server, "set")
    assert fresh_thread(hproxy, lambda: hcache.set_nx("hs-once", "v1", ttl=60)) is True
    assert commandstat(redis_server, "set") - before == 1  # sent once: the handshake was what was retried
    assert hcache.set_nx("hs-once", "v2", ttl=60) is False
    assert side.get(stored_key(ONCE, b"hs-once")) == b"v1"


def test_lost_handshake_reply_incr_counts_once(
    hcache: hotlock.Cache, hproxy: FaultProxy, side: redis.Redis, redis_server: RedisServer
) -> None:
    before = commandstat(redis_server, "incrby")
    assert fresh_thread(hproxy, lambda: hcache.incr("hs-count", 5)) == 5
    assert commandstat(redis_server, "incrby") - before == 1
    assert side.get(stored_key(COUNT, b"hs-count")) == b"5"


def test_lost_incr_reply_is_a_cache_error_that_counted_once(
    hcache: hotlock.Cache, hproxy: FaultProxy, side: redis.Redis, redis_server: RedisServer
) -> None:
    """INCRBY's own reply lost: never resent (that would count twice); the caller hears CacheError."""
    assert hcache.incr("hs-lost-incr") == 1  # the connection is open and warm
    before = commandstat(redis_server, "incrby")
    hproxy.drop_replies(1)
    with pytest.raises(CacheError, match="incr"):
        hcache.incr("hs-lost-incr")
    assert commandstat(redis_server, "incrby") - before == 1
    assert side.get(stored_key(COUNT, b"hs-lost-incr")) == b"2"
    assert hcache.incr("hs-lost-incr") == 3


def test_lost_set_nx_reply_is_a_cache_error_not_a_false(
    hcache: hotlock.Cache, hproxy: FaultProxy, side: redis.Redis, redis_server: RedisServer
) -> None:
    """SET NX's own reply lost: a resend would answer False for the value this call set."""
    assert hcache.set_nx("hs-warm", "1", ttl=60) is True
    before = commandstat(redis_server, "set")
    hproxy.drop_replies(1)
    with pytest.raises(CacheError, match="set_nx"):
        hcache.set_nx("hs-lost-once", "mine", ttl=60)
    assert commandstat(redis_server, "set") - before == 1
    assert side.get(stored_key(ONCE, b"hs-lost-once")) == b"mine"


@pytest.mark.slow_variants("server_kind")
def test_blackholed_handshake_costs_the_call_budget(hcache: hotlock.Cache, hproxy: FaultProxy) -> None:
    """A server that accepts but never answers: a fresh connection's call ends in CacheError
    within two reply timeouts (the handshake and its one retry), lock_wait within
    max(wait, one reply timeout) plus one reply timeout."""
    hproxy.reset()
    hproxy.blackhole(True)
    calls: list[tuple[Callable[[], object], float]] = [
        (lambda: hcache.lock("hs-bh", ttl=5), 2 * REPLY_TIMEOUT),
        (lambda: hcache.incr("hs-bh"), 2 * REPLY_TIMEOUT),
        (lambda: hcache.lock_wait("hs-bh", ttl=5, wait=1.5), 1.5 + REPLY_TIMEOUT),
    ]
    for call, budget in calls:
        out, elapsed = in_new_thread(call)
        assert isinstance(out, CacheError) and not isinstance(out, LockNotAcquired), out
        assert elapsed < budget + 0.3, elapsed


# -- a lost handshake reply, async --------------------------------------------------
#
# The same rule on hotlock.aio: a connection opened for a call (here: after a reset broke
# the previous one) loses its handshake's reply; the call retries within its budget.

AIO_LOOPS = ["asyncio", "uvloop"]

Fresh = Callable[[Callable[[], Awaitable[T]]], Awaitable[T]]


@pytest.fixture(params=AIO_LOOPS)
def aio_loop(request: pytest.FixtureRequest) -> str:
    return str(request.param)


def run_on(loop: str, coro: Coroutine[Any, Any, T]) -> T:
    factory = uvloop.new_event_loop if loop == "uvloop" else None
    with asyncio.Runner(loop_factory=factory) as runner:
        return runner.run(coro)


def run_handshake_case(
    backend: str,
    loop: str,
    proxy: FaultProxy,
    body: Callable[[hotlock.aio.AsyncCache, Fresh[Any]], Awaitable[None]],
) -> None:
    """Run ``body(cache, fresh)``: ``await fresh(call)`` runs ``call`` on a new connection
    whose first reply (its handshake's) is lost, and returns what it returned."""

    async def fresh(call: Callable[[], Awaitable[T]]) -> T:
        proxy.reset()
        await asyncio.sleep(0.1)  # the loop sees the connections reset before the call
        connections, dropped = proxy.connections, proxy.dropped_replies
        proxy.drop_replies(1)
        started = time.monotonic()
        result = await call()
        elapsed = time.monotonic() - started
        assert proxy.dropped_replies - dropped == 1, "the handshake's reply was not the one dropped"
        assert proxy.connections > connections
        assert elapsed < 2 * REPLY_TIMEOUT + 0.3, elapsed
        return result

    async def main() -> None:
        cache = await hotlock.aio.connect(
            proxy.url, backend=backend, timeout=REPLY_TIMEOUT, connect_timeout=REPLY_TIMEOUT
        )
        try:
            await body(cache, fresh)
        finally:
            proxy.clear()
            await cache.close()

    run_on(loop, main())


def test_async_lost_handshake_reply_acquire(
    aio_backend: str, aio_loop: str, hproxy: FaultProxy, side: redis.Redis
) -> None:
    async def body(cache: hotlock.aio.AsyncCache, fresh: Fresh[Any]) -> None:
        lock = await fresh(lambda: cache.lock("ahs-acquire", ttl=10))
        assert side.exists(lock_name(b"ahs-acquire")) == 1
        assert await lock.unlock() is True
        assert side.exists(lock_name(b"ahs-acquire")) == 0

    run_handshake_case(aio_backend, aio_loop, hproxy, body)


def test_async_lost_handshake_reply_lock_wait(
    aio_backend: str, aio_loop: str, hproxy: FaultProxy, side: redis.Redis
) -> None:
    async def body(cache: hotlock.aio.AsyncCache, fresh: Fresh[Any]) -> None:
        lock = await fresh(lambda: cache.lock_wait("ahs-wait", ttl=10, wait=1.0))
        assert side.exists(lock_name(b"ahs-wait")) == 1
        assert await lock.unlock() is True
        # Held by another with a short TTL: the retried first attempt finds it held, and
        # the wait goes on polling until the holder expires.
        await cache.lock("ahs-wait-held", ttl=0.3)
        lock = await fresh(lambda: cache.lock_wait("ahs-wait-held", ttl=10, wait=1.0))
        assert side.exists(lock_name(b"ahs-wait-held")) == 1
        assert await lock.unlock() is True

    run_handshake_case(aio_backend, aio_loop, hproxy, body)


def test_async_lost_handshake_reply_release_and_extend(
    aio_backend: str, aio_loop: str, hproxy: FaultProxy, side: redis.Redis
) -> None:
    async def body(cache: hotlock.aio.AsyncCache, fresh: Fresh[Any]) -> None:
        lock = await cache.lock("ahs-lock", ttl=10)
        await fresh(lambda: lock.extend(60))
        assert 59_000 < side.pttl(lock_name(b"ahs-lock")) <= 60_000
        assert await fresh(lock.unlock) is True
        assert side.exists(lock_name(b"ahs-lock")) == 0

    run_handshake_case(aio_backend, aio_loop, hproxy, body)


def test_async_lost_handshake_reply_batches(
    aio_backend: str, aio_loop: str, hproxy: FaultProxy, side: redis.Redis
) -> None:
    async def body(cache: hotlock.aio.AsyncCache, fresh: Fresh[Any]) -> None:
        await cache.lock("ahs-many-b", ttl=10)  # held elsewhere: that slot is None
        names = ["ahs-many-a", "ahs-many-b", "ahs-many-c"]
        got = await fresh(lambda: cache.lock_many(names, ttl=10))
        assert [lock is not None for lock in got] == [True, False, True]
        locks = [lock for lock in got if lock is not None]
        assert await fresh(lambda: cache.extend_many(locks, 60)) == [True, True]
        assert all(59_000 < side.pttl(lock_name(n.encode())) <= 60_000 for n in ("ahs-many-a", "ahs-many-c"))
        assert await fresh(lambda: cache.unlock_many(locks)) == [True, True]
        assert side.exists(lock_name(b"ahs-many-a"), lock_name(b"ahs-many-c")) == 0

    run_handshake_case(aio_backend, aio_loop, hproxy, body)


def test_async_lost_handshake_reply_set_nx_and_incr_run_once(
    aio_backend: str, aio_loop: str, hproxy: FaultProxy, side: redis.Redis, redis_server: RedisServer
) -> None:
    async def body(cache: hotlock.aio.AsyncCache, fresh: Fresh[Any]) -> None:
        sets, incrs = commandstat(redis_server, "set"), commandstat(redis_server, "incrby")
        assert await fresh(lambda: cache.set_nx("ahs-once", "v1", ttl=60)) is True
        assert await fresh(lambda: cache.incr("ahs-count", 5)) == 5
        assert commandstat(redis_server, "set") - sets == 1
        assert commandstat(redis_server, "incrby") - incrs == 1
        assert await cache.set_nx("ahs-once", "v2", ttl=60) is False
        assert side.get(stored_key(ONCE, b"ahs-once")) == b"v1"
        assert side.get(stored_key(COUNT, b"ahs-count")) == b"5"

    run_handshake_case(aio_backend, aio_loop, hproxy, body)


def test_async_lost_incr_and_set_nx_replies_are_cache_errors_that_ran_once(
    aio_backend: str, aio_loop: str, hproxy: FaultProxy, side: redis.Redis, redis_server: RedisServer
) -> None:
    async def main() -> None:
        cache = await hotlock.aio.connect(hproxy.url, backend=aio_backend, timeout=REPLY_TIMEOUT)
        try:
            assert await cache.incr("ahs-lost-incr") == 1
            incrs = commandstat(redis_server, "incrby")
            hproxy.drop_replies(1)
            with pytest.raises(CacheError, match="incr"):
                await cache.incr("ahs-lost-incr")
            # The lost reply cost that connection: open the next one before losing a reply again.
            await (await cache.lock("ahs-rewarm", ttl=5)).unlock()
            sets = commandstat(redis_server, "set")  # after the acquire script's own SET
            hproxy.drop_replies(1)
            with pytest.raises(CacheError, match="set_nx"):
                await cache.set_nx("ahs-lost-once", "mine", ttl=60)
            assert commandstat(redis_server, "incrby") - incrs == 1
            assert commandstat(redis_server, "set") - sets == 1
            assert side.get(stored_key(COUNT, b"ahs-lost-incr")) == b"2"
            assert side.get(stored_key(ONCE, b"ahs-lost-once")) == b"mine"
            assert await cache.incr("ahs-lost-incr") == 3
        finally:
            hproxy.clear()
            await cache.close()

    run_on(aio_loop, main())


def test_async_connect_retries_a_lost_handshake_reply(
    aio_backend: str, aio_loop: str, hproxy: FaultProxy, side: redis.Redis
) -> None:
    """connect()'s own first round trip follows the rule too."""

    async def main() -> None:
        hproxy.drop_replies(1)
        started = time.monotonic()
        cache = await hotlock.aio.connect(
            hproxy.url, backend=aio_backend, timeout=REPLY_TIMEOUT, connect_timeout=REPLY_TIMEOUT
        )
        try:
            assert hproxy.dropped_replies == 1
            assert time.monotonic() - started < 2 * REPLY_TIMEOUT + 0.3
            lock = await cache.lock("ahs-connect", ttl=10)
            assert side.exists(lock_name(b"ahs-connect")) == 1
            assert await lock.unlock() is True
        finally:
            await cache.close()

    run_on(aio_loop, main())


def test_connect_retries_a_lost_handshake_reply(redis_backend: str, hproxy: FaultProxy, side: redis.Redis) -> None:
    hproxy.drop_replies(1)
    started = time.monotonic()
    cache = open_cache(redis_backend, hproxy.url, timeout=REPLY_TIMEOUT, connect_timeout=REPLY_TIMEOUT)
    try:
        assert hproxy.dropped_replies == 1
        assert time.monotonic() - started < 2 * REPLY_TIMEOUT + 0.3
        assert cache.lock("hs-connect", ttl=10).unlock() is True
    finally:
        cache.close()


@pytest.mark.slow_variants("server_kind")
def test_async_blackholed_handshake_costs_the_call_budget(aio_backend: str, aio_loop: str, hproxy: FaultProxy) -> None:
    async def main() -> None:
        cache = await hotlock.aio.connect(
            hproxy.url, backend=aio_backend, timeout=REPLY_TIMEOUT, connect_timeout=REPLY_TIMEOUT
        )
        try:
            hproxy.reset()
            await asyncio.sleep(0.1)
            hproxy.blackhole(True)
            calls: list[tuple[Callable[[], Awaitable[object]], float]] = [
                (lambda: cache.lock("ahs-bh", ttl=5), 2 * REPLY_TIMEOUT),
                (lambda: cache.incr("ahs-bh"), 2 * REPLY_TIMEOUT),
                (lambda: cache.lock_wait("ahs-bh", ttl=5, wait=1.5), 1.5 + REPLY_TIMEOUT),
            ]
            for call, budget in calls:
                started = time.monotonic()
                with pytest.raises(CacheError) as info:
                    await call()
                assert not isinstance(info.value, LockNotAcquired)
                elapsed = time.monotonic() - started
                assert elapsed < budget + 0.3, elapsed
        finally:
            hproxy.clear()
            await cache.close()

    run_on(aio_loop, main())
