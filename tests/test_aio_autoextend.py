"""Leases that extend themselves, async: hotlock.aio's renewer task,
and the ``async with`` block cancelled at a loss and raising LockLost, while a
cancellation from outside stays a CancelledError. Every backend, on asyncio and uvloop.

The Python 3.10 fallback (no Task.uncancel: the cancellation's message tells ours from
one from outside) is run here too, by switching hotlock.aio._lock.HAS_UNCANCEL off.
"""

# The fixtures come from tests/test_aio.py; pytest's usual re-use of a name as a test
# argument is what ruff calls a redefinition.
# ruff: noqa: F811

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Iterator
from typing import Any

import pytest

import hotlock.aio
from hotlock import LockLost, LockNotAcquired
from hotlock.aio import AsyncCache, _lock

from .conftest import RedisServer, lock_name
from .faultproxy import FaultProxy
from .test_aio import Aio, aio, loop_kind, raio  # noqa: F401  (fixtures)

SLACK = 0.25  # as in tests/test_autoextend.py: loose, for a loaded CI machine
REPLY_TIMEOUT = 0.3
# Far longer than the TTL below (five times it): a known loss must be raised without waiting
# for a reply.
LONG_REPLY_TIMEOUT = 2.5
# The tests marked slow_variants("server_kind") wait on what the client times: the renewer's
# deadlines and batching, reply timeouts, max_hold, cancellation. They run on Redis in make
# test and on Valkey in make test-slow; the ones that show the server's own extend and
# release under the renewer (outliving the TTL, a deletion elsewhere, a release racing
# renewals, close) run on both.


@pytest.fixture(params=["uncancel", "py310"])
def cancel_kind(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Both ways of telling our cancellation from an outside one (3.11+'s counts, 3.10's message)."""
    if request.param == "py310":
        monkeypatch.setattr(_lock, "HAS_UNCANCEL", False)
    return str(request.param)


@pytest.fixture
def proxy(redis_server: RedisServer, redis_url: str) -> Iterator[FaultProxy]:
    with FaultProxy(redis_server.port) as p:
        yield p


async def delete_key(aio: Aio, cache: AsyncCache, key: str) -> None:
    """Delete a lock's key as another client would (in-process: straight from the data)."""
    if cache.backend == "memory":
        assert cache._backend._data._data.pop(lock_name(key), None) is not None  # type: ignore[attr-defined]
    else:
        assert aio.side.delete(lock_name(key)) == 1


def test_an_auto_extended_lease_outlives_its_ttl_until_unlocked(aio: Aio) -> None:
    async def main() -> None:
        async with await aio.connect() as cache:
            lock = await cache.lock("long", ttl=0.6, auto_extend=True)
            many = await cache.lock_many(["m1", "m2"], ttl=0.6, auto_extend=True)
            waited = await cache.lock_wait("w", ttl=0.6, wait=1, auto_extend=True)
            await asyncio.sleep(1.8)
            for lk in [lock, *many, waited]:
                assert lk is not None and not lk.lost, lk._loss if lk else None
                lk.check()
                with pytest.raises(LockNotAcquired):
                    await cache.lock(lk.key, ttl=5)
            assert await cache.unlock_many([lock, *many, waited]) == [True] * 4

    aio.run(main())


def test_bad_arguments_fail_before_anything_is_awaited(aio: Aio) -> None:
    async def main() -> None:
        async with await aio.connect() as cache:
            with pytest.raises(ValueError, match="max_hold needs auto_extend=True"):
                cache.lock("k", 5, max_hold=3)
            with pytest.raises(TypeError, match="auto_extend must be True or False"):
                cache.lock_wait("k", 5, 1, auto_extend=None)  # type: ignore[arg-type]
            with pytest.raises(ValueError, match="max_hold must be at least 1 ms"):
                await cache.lock_many(["k"], 5, auto_extend=True, max_hold=0)
            assert cache._renewer is None

    aio.run(main())


def test_deletion_elsewhere_cancels_the_block_which_raises_lock_lost(aio: Aio, cancel_kind: str) -> None:
    async def main() -> float:
        async with await aio.connect() as cache:
            ttl = 0.9
            told: list[Any] = []
            started = 0.0
            with pytest.raises(LockLost, match="no longer held"):
                async with cache.lock("sync:account-7", ttl=ttl, auto_extend=True) as lock:
                    lock.on_lost(told.append)
                    await asyncio.sleep(0.1)
                    await delete_key(aio, cache, "sync:account-7")
                    started = time.monotonic()
                    await asyncio.sleep(10)  # the work: cancelled at the loss
                    pytest.fail("not cancelled")
            elapsed = time.monotonic() - started
            assert told == [lock] and lock.lost
            assert elapsed < ttl / 3 + SLACK, elapsed
            # The task itself is not left cancelled: it goes on awaiting normally.
            await asyncio.sleep(0.01)
            task = asyncio.current_task()
            assert task is not None and (not _lock.HAS_UNCANCEL or task.cancelling() == 0)
            return elapsed

    aio.run(main())


@pytest.mark.slow_variants("server_kind")
def test_a_cancellation_from_outside_stays_a_cancelled_error(aio: Aio, cancel_kind: str) -> None:
    async def main() -> None:
        async with await aio.connect() as cache:
            entered = asyncio.Event()

            async def work() -> None:
                async with cache.lock("outside", ttl=0.6, auto_extend=True):
                    entered.set()
                    await asyncio.sleep(10)

            task = asyncio.create_task(work())
            await entered.wait()
            await asyncio.sleep(0.5)  # renewed meanwhile
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
            await cache.lock("outside", ttl=5)  # and released

    aio.run(main())


@pytest.mark.slow_variants("server_kind")
def test_a_cancellation_from_outside_at_the_loss_stays_a_cancelled_error(aio: Aio, cancel_kind: str) -> None:
    """Both at once: the renewer cancels the block for the loss, and (in the on_lost
    callback, right after) somebody cancels the task from outside. The outside one wins."""

    async def main() -> None:
        async with await aio.connect() as cache:
            entered = asyncio.Event()
            outcome: list[str] = []

            async def work() -> None:
                try:
                    async with cache.lock("both", ttl=0.6, auto_extend=True) as lock:
                        lock.on_lost(lambda lk: task.cancel())
                        entered.set()
                        await asyncio.sleep(10)
                except LockLost:
                    outcome.append("LockLost")
                    raise
                except asyncio.CancelledError:
                    outcome.append("CancelledError")
                    raise

            task = asyncio.create_task(work())
            await entered.wait()
            await delete_key(aio, cache, "both")
            with pytest.raises(asyncio.CancelledError):
                await task
            assert outcome == ["CancelledError"]

    aio.run(main())


@pytest.mark.slow_variants("server_kind")
def test_a_lost_block_that_swallows_the_cancellation_still_raises_lock_lost(aio: Aio, cancel_kind: str) -> None:
    async def main() -> None:
        async with await aio.connect() as cache:
            with pytest.raises(LockLost):
                async with cache.lock("swallow", ttl=0.6, auto_extend=True):
                    await delete_key(aio, cache, "swallow")
                    with contextlib.suppress(asyncio.CancelledError):
                        await asyncio.sleep(10)  # careless work: the block still ends in LockLost
            # The block's own exception propagates unchanged.
            with pytest.raises(KeyError):
                async with cache.lock("own-error", ttl=0.6, auto_extend=True):
                    await delete_key(aio, cache, "own-error")
                    try:
                        await asyncio.sleep(10)
                    except asyncio.CancelledError:
                        raise KeyError("mine") from None

    aio.run(main())


@pytest.mark.slow_variants("server_kind")
@pytest.mark.parametrize(("ttl", "max_hold"), [(0.6, 1.2), (1.0, 1.5)])
def test_max_hold_cancels_the_block_and_the_key_expires_with_the_loss(aio: Aio, ttl: float, max_hold: float) -> None:
    """The renewals max_hold allows extend only up to it, so the key is free when the
    block raises LockLost, not a TTL later."""

    async def main() -> None:
        async with await aio.connect() as cache:
            started = time.monotonic()
            with pytest.raises(LockLost, match="max_hold"):
                async with cache.lock("capped", ttl=ttl, auto_extend=True, max_hold=max_hold):
                    await asyncio.sleep(10)
            # uvloop's loop.time(), which the lease and its timers read, counts whole
            # milliseconds: max_hold may end up to one before it on time.monotonic().
            assert max_hold - 0.002 <= time.monotonic() - started < max_hold + SLACK
            while True:
                try:
                    await (await cache.lock("capped", ttl=5)).unlock()
                    break
                except LockNotAcquired:
                    await asyncio.sleep(0.01)
            assert time.monotonic() - started < max_hold + SLACK

    aio.run(main())


@pytest.mark.slow_variants("server_kind")
def test_a_manual_extend_is_capped_by_max_hold(raio: Aio) -> None:
    async def main() -> None:
        async with await raio.connect() as cache:
            lock = await cache.lock("capped-by-hand", ttl=5, auto_extend=True, max_hold=1.0)
            await lock.extend(30)
            ms = raio.side.pttl(lock_name("capped-by-hand"))
            assert 0 < ms <= 1000, ms
            await asyncio.sleep(1.0)
            with pytest.raises(LockLost, match="max_hold"):
                await lock.extend(30)

    raio.run(main())


@pytest.mark.slow_variants("server_kind")
def test_a_lost_block_raises_lock_lost_at_once_while_redis_is_blackholed(raio: Aio, proxy: FaultProxy) -> None:
    """With a reply timeout five times the TTL: the block is cancelled at the deadline and
    LockLost reaches the caller then, not after the release's reply timeouts (the release
    goes on in the background); close() waits at most one reply timeout for it."""

    async def main() -> None:
        cache = await hotlock.aio.connect(
            proxy.url, backend=raio.backend, timeout=LONG_REPLY_TIMEOUT, connect_timeout=LONG_REPLY_TIMEOUT
        )
        loop = asyncio.get_running_loop()
        try:
            deadline = 0.0
            with pytest.raises(LockLost, match="TTL ran out"):
                async with cache.lock("bh-exit", ttl=0.5, auto_extend=True) as lock:
                    await asyncio.sleep(0.1)
                    proxy.blackhole(True)
                    deadline = lock._deadline  # no renewal gets through from here on
                    await asyncio.sleep(10)
            late = loop.time() - deadline
            assert late < SLACK, late
            started = time.monotonic()
            await cache.close()
            assert time.monotonic() - started < LONG_REPLY_TIMEOUT + SLACK
        finally:
            proxy.clear()
            await cache.close()

    raio.run(main())


def test_the_release_of_a_lost_block_still_happens_in_the_background(raio: Aio) -> None:
    async def main() -> None:
        async with await raio.connect() as cache:
            name = lock_name("bg-release")
            with pytest.raises(LockLost):
                async with cache.lock("bg-release", ttl=0.6, auto_extend=True) as lock:
                    held = raio.side.get(name)
                    raio.side.delete(name)
                    while not lock.lost:
                        await asyncio.sleep(0.005)
                    # As a server that had not yet expired it would still hold it.
                    raio.side.set(name, held, px=30_000)
                    await asyncio.sleep(10)  # cancelled already; the loss is told
            for _ in range(200):
                if raio.side.exists(name) == 0:
                    break
                await asyncio.sleep(0.01)
            assert raio.side.exists(name) == 0

    raio.run(main())


# Eight tasks of ``rounds`` leases each: 64 in make test, 160 in make test-slow.
@pytest.mark.parametrize("rounds", [8, pytest.param(20, marks=pytest.mark.slow)])
def test_a_release_racing_renewals_leaves_no_key_behind(raio: Aio, rounds: int) -> None:
    async def main() -> None:
        async with await raio.connect() as cache:
            lies: list[Any] = []
            released: set[Any] = set()

            async def worker(n: int) -> None:
                for i in range(rounds):
                    lock = await cache.lock(f"race-{n}-{i}", ttl=0.3, auto_extend=True)
                    lock.on_lost(lambda lk: lies.append(lk) if lk in released else None)
                    await asyncio.sleep((n * 7 + i * 13) % 25 / 100)  # 0..0.24 s: renewals in flight
                    released.add(lock)
                    await lock.unlock()
                    assert raio.side.exists(lock_name(f"race-{n}-{i}")) == 0

            await asyncio.gather(*(worker(n) for n in range(8)))
            await asyncio.sleep(0.3)
            assert raio.side.keys("hotlock:*") == []
            assert lies == []

    raio.run(main())


def test_close_stops_the_renewer_and_the_leases_expire(raio: Aio) -> None:
    async def main() -> None:
        cache = await raio.connect()
        lock = await cache.lock("closing", ttl=0.3, auto_extend=True)
        await asyncio.sleep(0.4)
        assert raio.side.exists(lock_name("closing")) == 1
        renewer = cache._renewer
        assert renewer is not None and renewer._task is not None
        task = renewer._task
        await cache.close()
        assert task.done()
        closed = time.monotonic()
        while raio.side.exists(lock_name("closing")):
            await asyncio.sleep(0.01)
        assert time.monotonic() - closed < 0.3 + SLACK
        assert lock.lost

    raio.run(main())


@pytest.mark.slow_variants("server_kind")
def test_blackholed_renewer_cancels_the_work_when_valid_for_reaches_zero(
    raio: Aio, proxy: FaultProxy, cancel_kind: str
) -> None:
    async def main() -> float:
        cache = await hotlock.aio.connect(
            proxy.url, backend=raio.backend, timeout=REPLY_TIMEOUT, connect_timeout=REPLY_TIMEOUT
        )
        try:
            deadline = cancelled_at = 0.0
            loop = asyncio.get_running_loop()
            with pytest.raises(LockLost, match="TTL ran out"):
                async with cache.lock("blackholed", ttl=1.0, auto_extend=True) as lock:
                    await asyncio.sleep(0.1)
                    proxy.blackhole(True)
                    while lock.valid_for() > 0.02:
                        assert not lock.lost
                        await asyncio.sleep(0.01)
                    deadline = lock._deadline
                    try:
                        await asyncio.sleep(10)  # cancelled at the deadline
                    except asyncio.CancelledError:
                        cancelled_at = loop.time()
                        raise
            # On the loop's clock (the lease's): how late the cancellation came (the
            # block then still waits for its release, which the blackhole times out).
            late = cancelled_at - deadline
            assert late < SLACK, late
            return late
        finally:
            proxy.clear()
            await cache.close()

    raio.run(main())


@pytest.mark.slow_variants("server_kind")
def test_renewals_of_one_ttl_share_a_round_trip(aio: Aio) -> None:
    async def main() -> None:
        async with await aio.connect() as cache:
            calls: list[int] = []
            inner = cache._backend.extend_many

            async def counted(names: list[bytes], tokens: list[bytes], ms: int) -> list[bool]:
                calls.append(len(names))
                return await inner(names, tokens, ms)

            cache._backend.extend_many = counted  # type: ignore[method-assign]
            ttl = 0.6
            locks = []
            for i in range(5):
                locks += [
                    lk for lk in await cache.lock_many([f"b{i}-{j}" for j in range(40)], ttl, auto_extend=True) if lk
                ]
                await asyncio.sleep(ttl / 15)
            await asyncio.sleep(ttl)
            before = len(calls)
            await asyncio.sleep(4 * ttl)
            rounds = calls[before:]
            assert all(not lk.lost for lk in locks)
            assert 8 <= len(rounds) <= 20, rounds
            assert sum(n == 200 for n in rounds) >= len(rounds) - 3, rounds
            await cache.unlock_many(locks)

    aio.run(main())
