"""Fencing tokens (docs/fencing.md): ``lock.fence`` on every lock, strictly increasing
per key, returned by the acquire's one round trip; every key the library writes expires.

Run on every backend through the behaviour suite's fixtures (``cache``/``rcache`` from
conftest), against real redis-servers; the lost reply goes through the fault proxy. The
async twins are in test_aio.py ("fencing").
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Iterator

import pytest

import hotlock
from hotlock import Cache, LockLost
from hotlock.backends.memory import MemoryBackend

from .conftest import RedisServer, lock_name, open_cache, start_redis
from .faultproxy import FaultProxy
from .test_faults import restart

PREFIX = b"hotlock:"


def increasing(fences: list[int]) -> bool:
    return all(a < b for a, b in itertools.pairwise(fences))


def server_us(server: RedisServer) -> int:
    seconds, micros = server.client().time()
    return int(seconds) * 1_000_000 + int(micros)


def test_the_checker_catches_a_repeated_or_decreasing_fence() -> None:
    assert increasing([1, 2, 5])
    assert not increasing([1, 2, 2])
    assert not increasing([3, 2])


# -- sync, every backend ------------------------------------------------------------------


def test_fence_is_an_int_that_extend_keeps(cache: Cache) -> None:
    lock = cache.lock("fenced", ttl=5)
    assert type(lock.fence) is int and lock.fence > 0
    fence = lock.fence
    lock.extend(10)
    assert lock.fence == fence
    assert cache.extend_many([lock], 10) == [True] and lock.fence == fence
    assert lock.unlock() is True
    assert lock.fence == fence  # still readable after the release, for the caller's records


def test_fence_strictly_increases_over_a_thousand_lock_unlock_pairs(cache: Cache) -> None:
    fences = []
    for _ in range(1000):
        lock = cache.lock("hot", ttl=5)
        fences.append(lock.fence)
        assert lock.unlock() is True
    assert increasing(fences)


def test_fence_strictly_increases_through_lock_wait(cache: Cache) -> None:
    fences = []
    for _ in range(200):
        with cache.lock_wait("hot-wait", ttl=5, wait=1) as lock:
            fences.append(lock.fence)
    assert increasing(fences)


def test_fence_strictly_increases_through_lock_many_and_unlock_many(cache: Cache) -> None:
    keys = ["m0", "m1", "m2"]
    fences: dict[str, list[int]] = {k: [] for k in keys}
    for _ in range(1000):
        locks = cache.lock_many(keys, ttl=5)
        for key, lock in zip(keys, locks, strict=True):
            assert lock is not None
            fences[key].append(lock.fence)
        assert cache.unlock_many(locks) == [True, True, True]
    for key in keys:
        assert increasing(fences[key]), key


def test_fence_increases_across_an_expiry_and_a_takeover(cache: Cache, backend: str, redis_url: str) -> None:
    first = cache.lock("expiring", ttl=0.05)
    time.sleep(0.1)
    # Taken over by another client (its own connection) while the first still has the object.
    other_cache = cache if backend == "memory" else open_cache(backend, redis_url)
    try:
        taker = other_cache.lock("expiring", ttl=0.05)
        assert taker.fence > first.fence
        with pytest.raises(LockLost):
            first.extend(5)
        time.sleep(0.1)  # and expires in turn
        after = cache.lock("expiring", ttl=5)
        assert after.fence > taker.fence
        assert after.unlock() is True
    finally:
        if other_cache is not cache:
            other_cache.close()


def test_fence_increases_across_flushall(rcache: Cache, redis_server: RedisServer) -> None:
    before = rcache.lock("flushed", ttl=30)
    redis_server.client().flushall()
    after = rcache.lock("flushed", ttl=30)
    assert after.fence > before.fence
    assert after.unlock() is True


def test_memory_fence_increases_across_a_new_backend() -> None:
    # The memory backend's FLUSHALL and restart: close() empties it, a new one starts empty.
    first = hotlock.connect(None)
    one = first.lock("k", ttl=30)
    first.close()
    second = hotlock.connect(None)
    try:
        assert second.lock("k", ttl=30).fence > one.fence
    finally:
        second.close()


def test_memory_fence_never_repeats_when_the_clock_stands_still_or_steps_back(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # The clock alone could repeat: the "last fence + 1" rule keeps it strictly increasing.
    backend = MemoryBackend()
    clock = iter([2_000_000_000_000] * 500 + [1_000_000_000_000] * 500)
    monkeypatch.setattr(time, "time_ns", lambda: next(clock))
    fences = []
    for i in range(1000):
        token = b"%016d" % i
        fences.append(backend.acquire(b"k", token, 1000))
        assert backend.release(b"k", token) is True
    assert increasing(fences)


@pytest.fixture
def own_server() -> Iterator[RedisServer]:
    server = start_redis()
    yield server
    server.stop()


def test_fence_increases_across_a_restart_without_persistence(redis_backend: str, own_server: RedisServer) -> None:
    cache = open_cache(redis_backend, own_server.url, timeout=0.5)
    try:
        fences = []
        for _ in range(3):
            with cache.lock("restarted", ttl=30) as lock:
                fences.append(lock.fence)
            restart(own_server)  # no persistence: the new server knows nothing of the key
        fences.append(cache.lock("restarted", ttl=30).fence)
        assert increasing(fences)
    finally:
        cache.close()


def test_fence_is_the_server_clock_in_microseconds(rcache: Cache, redis_server: RedisServer) -> None:
    before = server_us(redis_server)
    lock = rcache.lock("clock", ttl=5)
    after = server_us(redis_server)
    assert before <= lock.fence <= after
    stored = redis_server.client().get(lock_name(b"clock"))
    assert stored == lock._token and len(stored) == 16  # the token alone: the fence is not stored
    lock.unlock()


@pytest.fixture
def proxy(redis_server: RedisServer, redis_url: str) -> Iterator[FaultProxy]:
    with FaultProxy(redis_server.port) as p:
        yield p


def test_a_lost_acquire_reply_retried_holds_the_lock_with_the_retrys_fence(
    redis_backend: str, proxy: FaultProxy, redis_server: RedisServer
) -> None:
    cache = open_cache(redis_backend, proxy.url, timeout=0.5, connect_timeout=0.5)
    try:
        before = server_us(redis_server)
        proxy.drop_replies(1)
        lock = cache.lock("lost", ttl=10)
        assert proxy.dropped_replies == 1
        stored = redis_server.client().get(lock_name(b"lost"))
        assert stored == lock._token
        # The fence is the retry's, sent after one reply timeout (0.5 s): later than the
        # lost run's, which no one saw, so fences still only increase.
        assert lock.fence >= before + 250_000
        assert lock.unlock() is True
    finally:
        proxy.clear()
        cache.close()


def test_an_uncontended_acquire_is_one_round_trip(rcache: Cache, redis_server: RedisServer) -> None:
    rcache.lock("warm", ttl=5).unlock()  # connect and load the scripts first
    side = redis_server.client()

    def calls() -> dict[str, int]:
        return {k: int(v["calls"]) for k, v in side.info("commandstats").items()}

    before = calls()
    lock = rcache.lock("one-trip", ttl=5)
    after = calls()
    ran = {k: after[k] - before.get(k, 0) for k in after if after[k] != before.get(k, 0)}
    # The INFO that read `before` is counted in `after`. The client sent one transaction
    # (MULTI, SET, TIME, EXEC: hotlock._acquire) and nothing else, or one EVALSHA and
    # nothing else (a backend that takes a free key by script), inside which the script
    # ran GET, SET and TIME once each.
    by_script = {"cmdstat_evalsha": 1, "cmdstat_get": 1}
    by_transaction = {"cmdstat_multi": 1, "cmdstat_exec": 1}
    assert ran == {
        "cmdstat_info": 1,
        "cmdstat_set": 1,
        "cmdstat_time": 1,
        **(by_transaction if "cmdstat_exec" in ran else by_script),
    }
    assert lock.fence > 0
    lock.unlock()


# -- every key expires ----------------------------------------------------------------------


def test_every_key_the_library_writes_has_a_ttl(rcache: Cache, redis_server: RedisServer) -> None:
    """incr's counters are the exception: user data the caller asked to keep (docs/key-layout.md)."""
    with rcache.lock("a", ttl=5):
        pass
    held = rcache.lock("b", ttl=5)
    held.extend(10)
    rcache.lock_wait("c", ttl=5, wait=0.1)
    rcache.unlock_many(rcache.lock_many(["d", "e"], ttl=5))
    rcache.lock_many(["f", "g"], ttl=5)
    rcache.set_nx("once", "v", ttl=5)
    rcache.incr("counter")
    held.unlock()
    side = redis_server.client()
    keys = list(side.scan_iter(match=PREFIX + b"*"))
    assert keys  # c, f, g, once and the counter are still there
    for key in keys:
        if key.startswith(PREFIX + b"count:"):
            continue
        assert side.pttl(key) > 0, key


@pytest.mark.parametrize(
    ("n", "ttl"),
    [pytest.param(20_000, 1.5, id="20k"), pytest.param(100_000, 3.0, id="100k", marks=pytest.mark.slow)],
)
def test_the_state_of_many_keys_locked_once_is_gone_within_their_ttl(
    rcache: Cache, redis_server: RedisServer, n: int, ttl: float
) -> None:
    side = redis_server.client()
    keys = [f"many-{i}" for i in range(n)]
    started = time.monotonic()
    for i in range(0, len(keys), 10_000):
        assert all(lk is not None for lk in rcache.lock_many(keys[i : i + 10_000], ttl=ttl))
    count = side.dbsize()
    # One key per lock, no fence state of its own (all n still there unless the machine
    # was so slow that the first batches expired already).
    assert count <= n
    if time.monotonic() - started < ttl - 0.5:
        assert count == n
    deadline = time.monotonic() + ttl + 10.0  # the TTL plus a margin for Redis's expiry cycle
    while side.dbsize() and time.monotonic() < deadline:
        time.sleep(0.2)
    assert side.dbsize() == 0


def test_memory_keeps_no_state_for_expired_keys() -> None:
    backend = MemoryBackend()
    for round_ in range(3):
        names = [b"r%d-%d" % (round_, i) for i in range(100_000)]
        assert all(f > 0 for f in backend.acquire_many(names, [b"t" * 16] * len(names), 100))
        time.sleep(0.15)
    # Bounded by the keys in use (within 2x), not by the 300,000 ever locked.
    assert len(backend._data) <= 200_000
