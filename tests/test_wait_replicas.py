"""wait_replicas confirms renewals too: an extend (by hand or by the renewer) that fewer
than N replicas acknowledge within the wait is a lost lease, told to the work.

A primary with one replica of the test's server kind, started once per kind for the
module. "Cut off" is the replica frozen (SIGSTOP): the primary still counts it as linked,
so each WAIT waits its whole timeout and confirms nothing, as it would for a replica behind
a partition. Every test leaves the replica running and caught up.
"""

from __future__ import annotations

import asyncio
import contextlib
import signal
import sys
import threading
import time
from collections.abc import Callable, Coroutine, Iterator
from typing import Any, TypeVar

import pytest
import redis
import uvloop

import hotlock
import hotlock.aio
from hotlock import LockLost
from hotlock.metrics import BaseListener

from .conftest import lock_name, start_redis

T = TypeVar("T")

WAIT_S = 0.2  # wait_timeout of every confirmed cache here
# A loaded machine (2 cores, several test runs) stretches every step: bounds are loose.
SLACK_S = 3.0


class Pair:
    """A primary and its replica."""

    def __init__(self, kind: str) -> None:
        fast_sync = ("--repl-diskless-sync-delay", "0")
        self.primary = start_redis(*fast_sync, kind=kind)
        self.replica = start_redis(*fast_sync, "--replicaof", "127.0.0.1", str(self.primary.port), kind=kind)
        self.caught_up()

    @property
    def url(self) -> str:
        return self.primary.url

    @property
    def side(self) -> redis.Redis:
        return self.primary.client()

    def caught_up(self) -> None:
        """Until the replica is linked and acknowledges a write (after a diskless sync the
        primary sends it nothing, a WAIT's GETACK included, until its first ACK)."""
        deadline = time.monotonic() + 30
        while True:
            side = self.side
            side.set("pair-ack", 1)
            side.delete("pair-ack")
            if int(side.wait(1, 100)) >= 1:
                return
            if time.monotonic() > deadline:
                pytest.fail("the replica did not acknowledge a write within 30 s")
            time.sleep(0.05)

    def waits(self) -> int:
        """WAIT commands the primary has run so far (INFO commandstats)."""
        return int(self.side.info("commandstats").get("cmdstat_wait", {}).get("calls", 0))

    @contextlib.contextmanager
    def cut_off(self) -> Iterator[None]:
        """While inside: the replica is frozen and acknowledges nothing."""
        proc = self.replica.proc
        assert proc is not None and proc.poll() is None
        proc.send_signal(signal.SIGSTOP)
        try:
            _until_stopped(proc.pid)
            yield
        finally:
            proc.send_signal(signal.SIGCONT)
            self.caught_up()

    def stop(self) -> None:
        self.replica.stop()
        self.primary.stop()


def _until_stopped(pid: int) -> None:
    # A signal is delivered soon after kill(), not within it.
    deadline = time.monotonic() + 10
    while True:
        with open(f"/proc/{pid}/stat") as f:
            if f.read().rsplit(")", 1)[1].split()[0] == "T":
                return
        assert time.monotonic() < deadline, "the replica did not stop"
        time.sleep(0.01)


_pairs: dict[str, Pair] = {}


@pytest.fixture(scope="module")
def _pair_pool() -> Iterator[dict[str, Pair]]:
    yield _pairs
    for pair in _pairs.values():
        pair.stop()
    _pairs.clear()


@pytest.fixture
def pair(server_kind: str, _pair_pool: dict[str, Pair]) -> Pair:
    if server_kind not in _pair_pool:
        _pair_pool[server_kind] = Pair(server_kind)
    pair = _pair_pool[server_kind]
    pair.side.flushall()
    pair.caught_up()
    return pair


def confirmed(pair: Pair, backend: str, **kwargs: Any) -> hotlock.Cache:
    return hotlock.connect(pair.url, backend=backend, wait_replicas=1, wait_timeout=WAIT_S, timeout=2, **kwargs)  # type: ignore[arg-type]


# -- sync ---------------------------------------------------------------------------------


def test_extend_is_confirmed_by_the_replica(redis_backend: str, pair: Pair) -> None:
    with confirmed(pair, redis_backend) as cache:
        lock = cache.lock("job", ttl=5)
        before = pair.waits()
        lock.extend(60)
        assert pair.waits() == before + 1  # one WAIT, behind the extend
        # WAIT returned once the replica had the new TTL.
        assert pair.replica.client().pttl(lock_name("job")) > 30_000
        assert not lock.lost and lock.valid_for() > 30
        assert cache.extend_many([lock], ttl=60) == [True]
        assert lock.unlock() is True


def test_a_marked_lock_is_extended_in_one_write_with_one_wait(redis_backend: str, pair: Pair) -> None:
    """Under wait_replicas extends go by script even where the server has SET IFEQ: a lock
    a waiter marked is extended by the same one write, with one WAIT."""
    with confirmed(pair, redis_backend) as cache, confirmed(pair, redis_backend) as other:
        lock = cache.lock("job", ttl=30)
        with pytest.raises(hotlock.LockNotAcquired):
            other.lock_wait("job", ttl=30, wait=0.2)  # its attempts mark the holder's value
        assert pair.side.get(lock_name("job")).endswith(b"+")  # type: ignore[union-attr]
        stats = pair.side.info("commandstats")
        sets_before = int(stats.get("cmdstat_set", {}).get("calls", 0))
        waits_before = pair.waits()
        lock.extend(60)
        assert cache.extend_many([lock], ttl=60) == [True]
        assert pair.waits() == waits_before + 2
        assert int(pair.side.info("commandstats").get("cmdstat_set", {}).get("calls", 0)) == sets_before
        assert pair.replica.client().pttl(lock_name("job")) > 30_000
        assert lock.unlock() is True


def test_without_wait_replicas_an_extend_sends_no_wait(redis_backend: str, pair: Pair) -> None:
    with hotlock.connect(pair.url, backend=redis_backend) as cache:  # type: ignore[arg-type]
        lock = cache.lock("job", ttl=5)
        before = pair.waits()
        lock.extend(30)
        cache.extend_many([lock], ttl=30)
        assert pair.waits() == before
        assert lock.unlock() is True


def test_an_extend_the_replica_never_confirms_is_a_lost_lease(redis_backend: str, pair: Pair) -> None:
    with confirmed(pair, redis_backend) as cache:
        lock = cache.lock("job", ttl=30)  # confirmed before the cut
        other = cache.lock("other", ttl=30)
        with pair.cut_off():
            started = time.monotonic()
            with pytest.raises(LockLost, match=r"extend undone: 0 of 1 replicas confirmed it within 200 ms") as info:
                lock.extend(30)
            took = time.monotonic() - started
            assert WAIT_S * 0.9 <= took < WAIT_S + SLACK_S
            assert info.value.key == "job"
            assert lock.lost
            with pytest.raises(LockLost, match="replicas"):
                lock.check()
            # Released, as an unconfirmed acquire is undone: nobody waits out a lease no one holds.
            assert pair.side.exists(lock_name("job")) == 0
            # Lost for good: a later extend is refused before anything is sent.
            with pytest.raises(LockLost, match="replicas"):
                lock.extend(30)
            assert cache.extend_many([other], ttl=30) == [False]
            assert other.lost and pair.side.exists(lock_name("other")) == 0
        assert lock.unlock() is False


def test_min_replicas_to_write_alone_lets_the_cut_off_primary_renew(redis_backend: str, pair: Pair) -> None:
    """The server's own guard does not catch it: under min-replicas-to-write 1 a primary
    whose replica stopped acknowledging still takes writes until min-replicas-max-lag (10 s
    by default) has passed, so a plain extend renews the lease on the cut-off primary. Under
    wait_replicas the same extend is a lost lease at once."""
    side = pair.side
    side.config_set("min-replicas-to-write", 1)
    try:
        with (
            hotlock.connect(pair.url, backend=redis_backend, timeout=2) as plain,  # type: ignore[arg-type]
            confirmed(pair, redis_backend) as cache,
        ):
            unguarded, guarded = plain.lock("plain", ttl=30), cache.lock("confirmed", ttl=30)
            with pair.cut_off():
                unguarded.extend(30)  # accepted: the replica's lag is below 10 s
                assert not unguarded.lost
                with pytest.raises(LockLost, match="replicas"):
                    guarded.extend(30)
            assert unguarded.unlock() is True
    finally:
        side.config_set("min-replicas-to-write", 0)


def test_an_unconfirmed_extend_is_counted_as_a_loss(redis_backend: str, pair: Pair) -> None:
    seen: list[tuple[str, object]] = []

    class Listener(BaseListener):
        def extended(self, key: str | bytes, ok: bool) -> None:
            seen.append(("extended", ok))

        def lost(self, key: str | bytes, held_s: float) -> None:
            seen.append(("lost", key))

    with confirmed(pair, redis_backend, metrics=Listener()) as cache:
        lock = cache.lock("job", ttl=30)
        with pair.cut_off(), pytest.raises(LockLost):
            lock.extend(30)
    assert seen == [("extended", False), ("lost", "job")]


def test_an_auto_extended_lease_is_told_lost_within_its_renewal_and_the_wait(redis_backend: str, pair: Pair) -> None:
    ttl = 3.0
    told = threading.Event()
    with confirmed(pair, redis_backend) as cache:
        with (
            pytest.raises(LockLost, match="extend_many undone: 0 of 1 replicas"),
            cache.lock("job", ttl=ttl, auto_extend=True) as lock,
        ):
            lock.on_lost(lambda _: told.set())
            with pair.cut_off():
                started = time.monotonic()
                # The first renewal is due a third of the TTL after the acquire; its WAIT
                # then waits WAIT_S. Told then, not at the lease's deadline.
                assert told.wait(ttl / 3 + WAIT_S + SLACK_S)
                took = time.monotonic() - started
                assert lock.lost
                with pytest.raises(LockLost, match="replicas"):
                    lock.check()
        assert took < ttl, took


def test_a_batch_of_auto_extended_leases_sends_one_wait(redis_backend: str, pair: Pair) -> None:
    ttl = 6.0  # renewed every 2 s: one renewal is seen well before the next
    with confirmed(pair, redis_backend) as cache:
        locks = cache.lock_many([f"batch-{i}" for i in range(5)], ttl=ttl, auto_extend=True)
        held = [lock for lock in locks if lock is not None]
        assert len(held) == 5
        # By hand, the five in one extend_many: one WAIT.
        before = pair.waits()
        assert cache.extend_many(held, ttl=ttl) == [True] * 5
        assert pair.waits() == before + 1
        # By the renewer: wait for its next round (every lease's deadline moves on)...
        deadlines = [lock._deadline for lock in held]
        before = pair.waits()
        give_up = time.monotonic() + ttl
        while any(lock._deadline == d for lock, d in zip(held, deadlines, strict=True)):
            assert time.monotonic() < give_up, "the renewer did not renew the leases"
            time.sleep(0.01)
        # ...which sent one WAIT for the five.
        assert pair.waits() == before + 1
        assert not any(lock.lost for lock in held)
        assert cache.unlock_many(held) == [True] * 5


# -- async --------------------------------------------------------------------------------


@pytest.fixture(params=["asyncio", "uvloop"])
def run(request: pytest.FixtureRequest) -> Callable[[Coroutine[Any, Any, T]], T]:
    def runner(coro: Coroutine[Any, Any, T]) -> T:
        if sys.version_info < (3, 11):
            return uvloop.run(coro) if request.param == "uvloop" else asyncio.run(coro)
        factory = uvloop.new_event_loop if request.param == "uvloop" else None
        with asyncio.Runner(loop_factory=factory) as runner:
            return runner.run(coro)

    return runner


async def aconfirmed(pair: Pair, backend: str) -> hotlock.aio.AsyncCache:
    return await hotlock.aio.connect(
        pair.url,
        backend=backend,  # type: ignore[arg-type]
        wait_replicas=1,
        wait_timeout=WAIT_S,
        timeout=2,
    )


def test_async_extend_is_confirmed_and_an_unconfirmed_one_is_lost(
    redis_backend: str, pair: Pair, run: Callable[[Coroutine[Any, Any, None]], None]
) -> None:
    async def main() -> None:
        async with await aconfirmed(pair, redis_backend) as cache:
            lock = await cache.lock("job", ttl=30)
            other = await cache.lock("other", ttl=30)
            before = pair.waits()
            await lock.extend(30)
            assert await cache.extend_many([lock, other], ttl=30) == [True, True]
            assert pair.waits() == before + 2  # one per extend call, batch included
            with pair.cut_off():
                started = time.monotonic()
                with pytest.raises(LockLost, match=r"extend undone: 0 of 1 replicas confirmed it within 200 ms"):
                    await lock.extend(30)
                assert time.monotonic() - started < WAIT_S + SLACK_S
                assert lock.lost and pair.side.exists(lock_name("job")) == 0
                assert await cache.extend_many([other], ttl=30) == [False]
                assert other.lost and pair.side.exists(lock_name("other")) == 0
            assert await lock.unlock() is False

    run(main())


def test_async_auto_extended_lease_is_told_lost(
    redis_backend: str, pair: Pair, run: Callable[[Coroutine[Any, Any, None]], None]
) -> None:
    ttl = 3.0

    async def main() -> None:
        async with await aconfirmed(pair, redis_backend) as cache:
            with pytest.raises(LockLost, match="extend_many undone: 0 of 1 replicas"):
                async with await cache.lock("job", ttl=ttl, auto_extend=True) as lock:
                    with pair.cut_off():
                        started = time.monotonic()
                        # The renewer cancels the block at the loss; the block raises LockLost.
                        await asyncio.sleep(ttl / 3 + WAIT_S + SLACK_S)
            assert time.monotonic() - started < ttl + SLACK_S
            assert lock.lost

    run(main())


def test_async_batch_of_auto_extended_leases_sends_one_wait(
    redis_backend: str, pair: Pair, run: Callable[[Coroutine[Any, Any, None]], None]
) -> None:
    ttl = 6.0

    async def main() -> None:
        async with await aconfirmed(pair, redis_backend) as cache:
            locks = await cache.lock_many([f"batch-{i}" for i in range(5)], ttl=ttl, auto_extend=True)
            held = [lock for lock in locks if lock is not None]
            assert len(held) == 5
            deadlines = [lock._deadline for lock in held]
            before = pair.waits()
            give_up = time.monotonic() + ttl
            while any(lock._deadline == d for lock, d in zip(held, deadlines, strict=True)):
                assert time.monotonic() < give_up, "the renewer did not renew the leases"
                await asyncio.sleep(0.01)
            assert pair.waits() == before + 1
            assert await cache.unlock_many(held) == [True] * 5

    run(main())
