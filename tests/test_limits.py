"""Concurrency limits: lock(key, limit=N) admits up to N holders, each with a lock of its own.

Sync and async, on every backend (memory, redis-py, native), on Redis and Valkey (whose
Lua-free extend/release must leave permits to the scripts), on one server and on the
cluster; faults through the fault proxy; a multi-process soak with a checker shown to catch
a limit that admits one too many; a Hypothesis state machine against a reference model.
"""

# The aio fixtures come from test_aio, and pytest passes them by name.
# ruff: noqa: F811

from __future__ import annotations

import asyncio
import multiprocessing as mp
import threading
import time
from typing import Any

import hypothesis.strategies as st
import pytest
from hypothesis import HealthCheck, settings
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule, run_state_machine_as_test

import hotlock
import hotlock.aio
import hotlock.metrics
from hotlock import Cache, CacheError, LockLost, LockNotAcquired

from .conftest import RedisServer, lock_name
from .faultproxy import FaultProxy
from .overlap import OverlapChecker
from .test_aio import Aio, aio, loop_kind, raio  # noqa: F401  (fixtures)
from .test_faults import pcache, proxy  # noqa: F401  (fixtures)
from .test_validation import check_nothing_sent

on_every_topology = pytest.mark.topologies("single", "cluster")


def take_all(cache: Cache, key: str, limit: int, ttl: float = 10) -> list[hotlock.Lock]:
    """Every place of ``key``, then proof that there is no other."""
    held = [cache.lock(key, ttl, limit=limit) for _ in range(limit)]
    with pytest.raises(LockNotAcquired):
        cache.lock(key, ttl, limit=limit)
    return held


# -- N admitted, not N+1 ---------------------------------------------------------------------


@on_every_topology
def test_n_holders_are_admitted_and_not_one_more(cache: Cache) -> None:
    held = take_all(cache, "export", 3)
    with pytest.raises(LockNotAcquired) as info:
        cache.lock("export", 10, limit=3)
    assert "3 holders" in str(info.value) and "limit=3" in str(info.value)
    assert not isinstance(info.value, CacheError)
    # Each is a lock of its own: fences increase, each extends and releases alone.
    fences = [lk.fence for lk in held]
    assert fences == sorted(fences) and len(set(fences)) == 3
    held[0].extend(20)
    assert 19 < held[0].valid_for() <= 20
    assert held[1].unlock() is True
    assert held[1].unlock() is False  # idempotent
    with pytest.raises(LockLost):
        held[1].extend()
    again = cache.lock("export", 10, limit=3)  # the freed place, and only that one
    assert again.fence > fences[-1]
    with pytest.raises(LockNotAcquired):
        cache.lock("export", 10, limit=3)
    for lk in (held[0], held[2], again):
        assert lk.unlock() is True
    take_all(cache, "export", 3)  # all three places are free again


@on_every_topology
def test_a_permit_is_a_full_lease(cache: Cache) -> None:
    with cache.lock("lease", 5, limit=2) as permit:
        assert permit.key == "lease" and permit.ttl == 5.0
        assert 4.9 < permit.valid_for() <= 5.0
        permit.check()
        assert not permit.lost
    assert permit.valid_for() == 0.0
    take_all(cache, "lease", 2)  # released by the block


def test_limit_one_is_the_plain_lock(cache: Cache) -> None:
    with cache.lock("plain", 5, limit=1):
        with pytest.raises(LockNotAcquired) as info:
            cache.lock("plain", 5)
        assert "held elsewhere" in str(info.value)


def test_limit_one_stores_the_plain_value_and_a_limit_a_hash(rcache: Cache, redis_server: RedisServer) -> None:
    side = redis_server.client()
    plain = rcache.lock("one", 5, limit=1)
    assert side.type(lock_name("one")) == b"string"
    assert side.get(lock_name("one")) == plain._token
    permit = rcache.lock("many", 5, limit=2)
    assert side.type(lock_name("many")) == b"hash"
    assert side.hget(lock_name("many"), permit._token[:16]) is not None
    assert 4000 < side.pttl(lock_name("many")) <= 5000
    plain.unlock()
    permit.unlock()


def test_the_key_lives_as_long_as_its_longest_permit(rcache: Cache, redis_server: RedisServer) -> None:
    side = redis_server.client()
    short = rcache.lock("ttl", 1, limit=3)
    long = rcache.lock("ttl", 20, limit=3)
    assert 19_000 < side.pttl(lock_name("ttl")) <= 20_000
    short.extend(2)  # a shorter extend never shortens the key
    assert side.pttl(lock_name("ttl")) > 19_000
    long.extend(30)
    assert side.pttl(lock_name("ttl")) > 29_000
    assert long.unlock() is True and short.unlock() is True


# -- expiry and extend -------------------------------------------------------------------


@on_every_topology
def test_an_expired_permit_frees_its_place(cache: Cache) -> None:
    cache.lock("crash", 0.2, limit=2)  # a holder that crashed: never released
    keeper = cache.lock("crash", 10, limit=2)
    with pytest.raises(LockNotAcquired):
        cache.lock("crash", 10, limit=2)
    time.sleep(0.4)
    taken = cache.lock("crash", 10, limit=2)  # the crashed holder's place, by its TTL
    assert taken.fence > keeper.fence
    with pytest.raises(LockNotAcquired):
        cache.lock("crash", 10, limit=2)


def test_extend_keeps_a_place(cache: Cache) -> None:
    permit = cache.lock("keep", 0.3, limit=1 + 1)
    other = cache.lock("keep", 10, limit=2)
    permit.extend(10)
    time.sleep(0.5)
    with pytest.raises(LockNotAcquired):
        cache.lock("keep", 10, limit=2)
    assert permit.unlock() is True and other.unlock() is True


def test_an_old_holder_cannot_free_a_new_holders_place(cache: Cache) -> None:
    old = cache.lock("old", 0.2, limit=1 + 1)
    time.sleep(0.4)
    first = cache.lock("old", 10, limit=2)
    second = cache.lock("old", 10, limit=2)  # old's place, taken over
    assert old.unlock() is False
    with pytest.raises(LockLost):
        old.extend(10)
    with pytest.raises(LockNotAcquired):
        cache.lock("old", 10, limit=2)  # old's release and extend changed nothing
    assert first.unlock() is True and second.unlock() is True


def test_auto_extend_keeps_a_permit_past_its_ttl(cache: Cache) -> None:
    with cache.lock("auto", 1, limit=2, auto_extend=True) as permit:
        other = cache.lock("auto", 1, limit=2, auto_extend=True)
        time.sleep(2.5)
        assert not permit.lost and not other.lost
        with pytest.raises(LockNotAcquired):
            cache.lock("auto", 10, limit=2)
        other.unlock()
    take_all(cache, "auto", 2)


# -- fences ------------------------------------------------------------------------------


@on_every_topology
def test_fences_increase_across_permits_and_across_kinds(cache: Cache) -> None:
    fences = []
    for limit in (1, 3, 1, 2, 1):
        for _ in range(4):
            with cache.lock("fenced", 10, limit=limit) as lk:
                fences.append(lk.fence)
    assert fences == sorted(fences) and len(set(fences)) == len(fences)
    held = [cache.lock("burst", 10, limit=50) for _ in range(50)]  # many in one microsecond's reach
    burst = [lk.fence for lk in held]
    assert burst == sorted(burst) and len(set(burst)) == 50


# -- the kinds never mix -----------------------------------------------------------------


@on_every_topology
def test_a_plain_lock_and_a_limit_never_share_a_key(cache: Cache) -> None:
    plain = cache.lock("kinds", 10)
    with pytest.raises(LockNotAcquired) as info:
        cache.lock("kinds", 10, limit=3)
    assert "held as a plain lock" in str(info.value) and not isinstance(info.value, CacheError)
    with pytest.raises(LockNotAcquired):
        cache.lock_wait("kinds", 10, 0.2, limit=3)
    plain.unlock()
    permit = cache.lock("kinds", 10, limit=3)
    with pytest.raises(LockNotAcquired) as info:
        cache.lock("kinds", 10)
    assert "concurrency limit" in str(info.value) and not isinstance(info.value, CacheError)
    with pytest.raises(LockNotAcquired) as info:
        cache.lock_wait("kinds", 10, 0.2)
    assert "concurrency limit" in str(info.value) and "after waiting" in str(info.value)
    assert cache.lock_many(["kinds", "other"], 10)[0] is None
    permit.unlock()


def test_different_limits_on_one_key_each_enforce_their_own(cache: Cache) -> None:
    held = take_all(cache, "mixed", 2)
    third = cache.lock("mixed", 10, limit=3)  # three holders, within its own limit of 3
    with pytest.raises(LockNotAcquired):
        cache.lock("mixed", 10, limit=3)
    for lk in (*held, third):
        lk.unlock()


def test_an_expired_plain_lock_taken_as_permits_is_lost_not_an_error(cache: Cache) -> None:
    """Its old holder's extend and release meet a hash (WRONGTYPE to SET IFEQ and DELIFEQ on
    a Lua-free server): LockLost and False, never CacheError."""
    plain = cache.lock("swap", 0.2)
    time.sleep(0.4)
    permit = cache.lock("swap", 10, limit=2)
    with pytest.raises(LockLost):
        plain.extend(10)
    assert plain.unlock() is False
    assert permit.valid_for() > 9
    permit.unlock()
    permit = cache.lock("swap", 0.2, limit=2)
    time.sleep(0.4)
    plain = cache.lock("swap", 10)
    with pytest.raises(LockLost):
        permit.extend(10)
    assert permit.unlock() is False
    assert plain.unlock() is True


def test_a_key_whose_permits_all_ended_is_free_for_a_plain_lock(cache: Cache) -> None:
    permits = [cache.lock("ended", 10, limit=2) for _ in range(2)]
    cache.unlock_many(permits)
    plain = cache.lock("ended", 10)  # the key's last fence stays above, its kind is gone
    assert plain.fence > max(p.fence for p in permits)
    assert plain.unlock() is True
    expired = cache.lock("ended", 0.2, limit=2)
    time.sleep(0.4)
    assert cache.lock("ended", 10).fence > expired.fence


def test_batches_mix_permits_and_plain_locks(cache: Cache) -> None:
    plain = cache.lock("batch-plain", 10)
    permits = [cache.lock("batch-permit", 10, limit=2) for _ in range(2)]
    assert cache.extend_many([plain, *permits, None], 20) == [True, True, True, False]
    assert all(lk.valid_for() > 19 for lk in (plain, *permits))
    assert cache.unlock_many([plain, *permits]) == [True, True, True]
    take_all(cache, "batch-permit", 2)


# -- lock_wait -----------------------------------------------------------------------------


@on_every_topology
def test_lock_wait_with_a_limit_is_woken_by_a_release(cache: Cache) -> None:
    held = take_all(cache, "wait", 2, ttl=30)
    threading.Timer(0.3, held[0].unlock).start()
    started = time.monotonic()
    got = cache.lock_wait("wait", 30, wait=10, limit=2)
    took = time.monotonic() - started
    assert 0.2 < took < 5.0, took  # woken by the release, long before the holder's TTL
    with pytest.raises(LockNotAcquired) as info:
        cache.lock_wait("wait", 30, wait=0.2, limit=2)
    assert "after waiting" in str(info.value)
    # The module-level form takes the limit too.
    with pytest.raises(LockNotAcquired):
        hotlock.lock_wait(cache, "wait", 30, 0.05, limit=2)
    got.unlock()
    assert hotlock.lock_wait(cache, "wait", 30, 1, limit=2).unlock()
    held[1].unlock()


# -- bad input ----------------------------------------------------------------------------


BAD_LIMITS = [
    (True, TypeError, "limit must be an int"),
    (False, TypeError, "limit must be an int"),
    (2.0, TypeError, "limit must be an int"),
    ("2", TypeError, "limit must be an int"),
    (None, TypeError, "limit must be an int"),
    (0, ValueError, "limit must be at least 1"),
    (-1, ValueError, "limit must be at least 1"),
    (2**31, ValueError, "limit must be below"),
]


@pytest.mark.parametrize(("bad", "exc", "text"), BAD_LIMITS, ids=[repr(b[0]) for b in BAD_LIMITS])
def test_a_bad_limit_is_refused_before_any_io(
    cache: Cache, backend: str, redis_server: RedisServer, bad: Any, exc: type[Exception], text: str
) -> None:
    check_nothing_sent(redis_server, backend, lambda: cache.lock("k", 10, limit=bad), exc, text)
    check_nothing_sent(redis_server, backend, lambda: cache.lock_wait("k", 10, 1, limit=bad), exc, text)


def test_async_bad_limit_is_refused_before_anything_is_awaited() -> None:
    async def main() -> None:
        cache = await hotlock.aio.connect(None)
        with pytest.raises(TypeError):
            cache.lock("k", 10, limit=1.5)  # type: ignore[arg-type]
        with pytest.raises(ValueError):
            cache.lock_wait("k", 10, 1, limit=0)
        await cache.close()

    asyncio.run(main())


# -- async ----------------------------------------------------------------------------------


@on_every_topology
def test_async_n_holders_and_not_one_more(aio: Aio) -> None:
    async def main() -> None:
        cache = await aio.connect()
        held = [await cache.lock("a-export", 10, limit=3) for _ in range(3)]
        with pytest.raises(LockNotAcquired):
            await cache.lock("a-export", 10, limit=3)
        with pytest.raises(LockNotAcquired) as info:
            await cache.lock("a-export", 10)
        assert "concurrency limit" in str(info.value)
        assert [lk.fence for lk in held] == sorted(lk.fence for lk in held)
        await held[0].extend(20)
        assert held[0].valid_for() > 19
        assert await held[1].unlock() is True
        assert await held[1].unlock() is False
        async with cache.lock("a-export", 10, limit=3) as again:
            assert again.fence > held[2].fence
            with pytest.raises(LockNotAcquired):
                await cache.lock("a-export", 10, limit=3)
        assert await cache.unlock_many([held[0], held[2]]) == [True, True]
        await cache.close()

    aio.run(main())


def test_async_lock_wait_with_a_limit_is_woken_by_a_release(aio: Aio) -> None:
    async def main() -> None:
        cache = await aio.connect()
        held = [await cache.lock("a-wait", 30, limit=2) for _ in range(2)]

        async def release_soon() -> None:
            await asyncio.sleep(0.3)
            await held[0].unlock()

        task = asyncio.ensure_future(release_soon())
        started = time.monotonic()
        got = await cache.lock_wait("a-wait", 30, wait=10, limit=2)
        assert 0.2 < time.monotonic() - started < 5.0
        await task
        await got.unlock()
        await held[1].unlock()
        await cache.close()

    aio.run(main())


def test_async_an_old_holder_cannot_free_a_new_holders_place(aio: Aio) -> None:
    async def main() -> None:
        cache = await aio.connect()
        old = await cache.lock("a-old", 0.2, limit=1 + 1)
        await asyncio.sleep(0.4)
        new = [await cache.lock("a-old", 10, limit=2) for _ in range(2)]
        assert await old.unlock() is False
        with pytest.raises(LockNotAcquired):
            await cache.lock("a-old", 10, limit=2)
        await cache.unlock_many(new)
        await cache.close()

    aio.run(main())


def test_async_cancelled_acquire_of_a_permit_frees_its_place(aio: Aio) -> None:
    """A wait cancelled while its acquire may have taken a place: the place is released in
    the background by the bare token, so no place leaks until the TTL."""

    async def main() -> None:
        cache = await aio.connect()
        for _ in range(5):
            task = asyncio.ensure_future(cache.lock_wait("a-cancel", 30, wait=5, limit=1 + 1))
            await asyncio.sleep(0)
            task.cancel()
            try:
                lk = await task
            except asyncio.CancelledError:
                pass
            else:
                await lk.unlock()
        await asyncio.sleep(0.2)  # the background releases land
        held = [await cache.lock("a-cancel", 30, limit=2) for _ in range(2)]
        await cache.unlock_many(held)
        await cache.close()

    aio.run(main())


# -- faults ------------------------------------------------------------------------------------


def permits_stored(server: RedisServer, key: str) -> int:
    return sum(1 for f in server.client().hkeys(lock_name(key)) if len(f) == 16)


def test_a_lost_acquire_reply_never_takes_two_places(
    pcache: Cache, proxy: FaultProxy, redis_server: RedisServer
) -> None:
    other = pcache.lock("lost", 10, limit=2)
    proxy.drop_replies(1)
    mine = pcache.lock("lost", 10, limit=2)  # retried with the same token: its own place
    assert proxy.dropped_replies == 1
    assert permits_stored(redis_server, "lost") == 2
    with pytest.raises(LockNotAcquired):
        pcache.lock("lost", 10, limit=2)
    assert mine.unlock() is True and other.unlock() is True
    assert permits_stored(redis_server, "lost") == 0


def test_a_lost_release_reply_frees_the_place_without_an_error(
    pcache: Cache, proxy: FaultProxy, redis_server: RedisServer
) -> None:
    permit = pcache.lock("lost-release", 10, limit=2)
    proxy.drop_replies(1)
    permit.unlock()
    assert proxy.dropped_replies == 1
    assert permits_stored(redis_server, "lost-release") == 0
    assert permit.unlock() is False


def test_redis_down_is_a_cache_error_not_a_full_limit(pcache: Cache, proxy: FaultProxy) -> None:
    proxy.blackhole(True)
    with pytest.raises(CacheError):
        pcache.lock("down", 10, limit=3)


def test_wait_replicas_undoes_a_permit_too_few_replicas_confirmed(rcache: Cache, redis_server: RedisServer) -> None:
    """The session's server has no replica: WAIT 1 confirms nothing, and the permit taken is
    released again, so its place is not held until its TTL."""
    confirmed = hotlock.connect(redis_server.url, backend=rcache.backend, wait_replicas=1, wait_timeout=0.05)
    with confirmed, pytest.raises(CacheError, match="0 of 1 replicas confirmed"):
        confirmed.lock("undone", 30, limit=2)
    assert permits_stored(redis_server, "undone") == 0


def test_async_wait_replicas_undoes_a_permit(raio: Aio, redis_server: RedisServer) -> None:
    async def main() -> None:
        async with await raio.connect(wait_replicas=1, wait_timeout=0.05) as cache:
            with pytest.raises(CacheError, match="replicas"):
                await cache.lock("a-undone", 30, limit=2)

    raio.run(main())
    assert permits_stored(redis_server, "a-undone") == 0


# -- many processes: never N+1 inside -----------------------------------------------------------

LIMIT = 3


def crowd(url: str, backend: str, limit: int, checker: OverlapChecker, seconds: float) -> None:
    """Threads of this process take places on one key and hold them briefly."""
    cache = hotlock.connect(url, backend=backend)
    deadline = time.monotonic() + seconds

    def worker() -> None:
        while time.monotonic() < deadline:
            try:
                with cache.lock_wait("crowd", ttl=5, wait=2, limit=limit):
                    checker.enter(0)
                    time.sleep(0.001)
                    checker.exit(0)
            except LockNotAcquired:
                pass

    pool = [threading.Thread(target=worker) for _ in range(3)]
    for t in pool:
        t.start()
    for t in pool:
        t.join()
    cache.close()


def run_crowd(url: str, backend: str, limit: int) -> OverlapChecker:
    checker = OverlapChecker(1, allowed=LIMIT)
    ctx = mp.get_context("fork")
    procs = [ctx.Process(target=crowd, args=(url, backend, limit, checker, 1.5)) for _ in range(4)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(60)
        assert p.exitcode == 0
    return checker


def test_never_more_than_the_limit_inside_across_processes(redis_backend: str, redis_url: str) -> None:
    checker = run_crowd(redis_url, redis_backend, LIMIT)
    assert checker.sections > 100, "the crowd did too little to prove anything"
    assert checker.overlaps == 0
    assert checker.most == LIMIT, "the limit was never reached: the test proves nothing"


def test_the_checker_catches_a_limit_that_admits_one_too_many(redis_backend: str, redis_url: str) -> None:
    checker = run_crowd(redis_url, redis_backend, LIMIT + 1)
    assert checker.sections > 100
    assert checker.overlaps > 0, "the checker must see a fourth holder inside"


# -- a state machine against a reference model --------------------------------------------------


class Permits(RuleBasedStateMachine):
    """Acquire, extend and release permits of two keys with long TTLs (nothing expires during
    a run), and check each reply against the model: a set of held permits per key."""

    cache: Cache
    limits = (1, 2, 3)

    def __init__(self) -> None:
        super().__init__()
        self.held: dict[str, list[hotlock.Lock]] = {"a": [], "b": []}
        self.released: list[hotlock.Lock] = []
        self.kind: dict[str, int | None] = {"a": None, "b": None}  # the limit the key is held with
        self.last_fence: dict[str, int] = {"a": 0, "b": 0}

    @rule(key=st.sampled_from(["a", "b"]), limit=st.sampled_from(limits))
    def acquire(self, key: str, limit: int) -> None:
        held = self.held[key]
        kind = self.kind[key]
        conflict = bool(held) and ((kind == 1) != (limit == 1))
        admit = not conflict and len(held) < limit
        try:
            lock = self.cache.lock(f"sm-{key}", 60, limit=limit)
        except LockNotAcquired:
            assert not admit, (key, limit, len(held), kind)
            return
        assert admit, (key, limit, len(held), kind)
        assert lock.fence > self.last_fence[key]
        self.last_fence[key] = lock.fence
        held.append(lock)
        self.kind[key] = limit

    @precondition(lambda self: any(self.held.values()))
    @rule(data=st.data())
    def release(self, data: st.DataObject) -> None:
        key = data.draw(st.sampled_from([k for k, v in self.held.items() if v]))
        lock = self.held[key].pop(data.draw(st.integers(0, len(self.held[key]) - 1)))
        assert lock.unlock() is True
        self.released.append(lock)

    @precondition(lambda self: any(self.held.values()))
    @rule(data=st.data())
    def extend(self, data: st.DataObject) -> None:
        key = data.draw(st.sampled_from([k for k, v in self.held.items() if v]))
        lock = data.draw(st.sampled_from(self.held[key]))
        lock.extend(60)

    @precondition(lambda self: bool(self.released))
    @rule(data=st.data())
    def release_again(self, data: st.DataObject) -> None:
        lock = data.draw(st.sampled_from(self.released))
        assert lock.unlock() is False

    @invariant()
    def every_held_permit_is_valid(self) -> None:
        for locks in self.held.values():
            for lock in locks:
                assert lock.valid_for() > 0

    def teardown(self) -> None:
        for locks in self.held.values():
            for lock in locks:
                lock.unlock()


def test_permits_follow_the_reference_model(cache: Cache) -> None:
    Permits.cache = cache
    run_state_machine_as_test(
        Permits,
        settings=settings(
            max_examples=25, stateful_step_count=25, deadline=None, suppress_health_check=list(HealthCheck)
        ),
    )


# -- operations ---------------------------------------------------------------------------------


def test_metrics_count_permits_as_locks(redis_backend: str, redis_url: str) -> None:
    events: list[str] = []

    class Listener(hotlock.metrics.Listener):
        def acquired(self, key: str | bytes, wait_s: float, attempts: int | None) -> None:
            events.append("acquired")

        def not_acquired(self, key: str | bytes, outcome: Any, wait_s: float) -> None:
            events.append("not_acquired")

        def released(self, key: str | bytes, held_s: float) -> None:
            events.append("released")

    with hotlock.connect(redis_url, backend=redis_backend, metrics=Listener()) as cache:
        held = [cache.lock("metered", 10, limit=2) for _ in range(2)]
        with pytest.raises(LockNotAcquired):
            cache.lock("metered", 10, limit=2)
        for lk in held:
            lk.unlock()
    assert sorted(events) == ["acquired"] * 2 + ["not_acquired"] + ["released"] * 2


def test_server_info_says_permits_go_by_script(rcache: Cache) -> None:
    assert rcache.server_info["limits"] == "script"


def test_a_redis_side_view_of_a_limited_key(rcache: Cache, redis_server: RedisServer) -> None:
    """What an operator sees: a hash with one field per permit, its fence and expiry."""
    held = [rcache.lock("ops", 10, limit=3) for _ in range(2)]
    fields = redis_server.client().hgetall(lock_name("ops"))
    permits = {k: v for k, v in fields.items() if len(k) == 16}
    assert len(permits) == 2
    for lk in held:
        assert permits[lk._token[:16]].split(b":")[0] == b"%d" % lk.fence
    for lk in held:
        lk.unlock()
