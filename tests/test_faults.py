"""Faults, each turned into a test (issue 6): ambiguous replies through the fault proxy,
a restart without persistence, SCRIPT FLUSH, eviction, fork and a paused holder.

Every test runs on each backend that talks to Redis (redis-py, native once built) and
asserts what the caller can observe, against a real redis-server.
"""

from __future__ import annotations

import time
from collections.abc import Iterator

import pytest

import hotlock
from hotlock import CacheError, LockLost, LockNotAcquired

from .conftest import RedisServer, open_cache
from .faultproxy import FaultProxy

# A short reply timeout keeps every lost-reply test fast; it is what each fault costs.
REPLY_TIMEOUT = 0.5
PREFIX = b"hotlock:lock:"


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
    value = server.client().get(PREFIX + key.encode())
    assert value is None or isinstance(value, bytes)
    return value


def commandstat(server: RedisServer, command: str) -> int:
    """How many times the server ran ``command`` (INFO commandstats), e.g. "evalsha"."""
    stats = server.client().info("commandstats")
    entry = stats.get(f"cmdstat_{command}")
    return int(entry["calls"]) if entry else 0


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
    for i in range(8):
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
    import threading

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
    assert 19_000 < redis_server.client().pttl(PREFIX + b"reset-extend") <= 20_000
    # And once another token sits there, the next extend is LockLost, not a CacheError.
    redis_server.client().set(PREFIX + b"reset-extend", b"someone-else", px=10_000)
    proxy.reset_after_request(1)
    with pytest.raises(CacheError):
        lock.extend(20)
    with pytest.raises(LockLost):
        lock.extend(20)
