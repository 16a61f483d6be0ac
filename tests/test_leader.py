"""hotlock.leader: the lease itself (sync and async), then real celery beats electing one
leader through crashes, stops and a Redis outage (LeaderScheduler)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis

import hotlock
import hotlock.aio
from hotlock.leader import AsyncLeader, Leader

from .conftest import RedisServer, lock_name, start_redis

ROOT = Path(__file__).resolve().parent.parent

# -- the lease ------------------------------------------------------------------------


def test_one_leader_and_a_larger_epoch_for_the_next(redis_url: str) -> None:
    with hotlock.connect(redis_url) as one, hotlock.connect(redis_url) as two:
        a, b = Leader(one, "jobs", ttl=2), Leader(two, "jobs", ttl=2)
        assert a.epoch is None and not a.is_leader
        assert a.campaign() and a.is_leader
        assert a.campaign()  # already leading: stays
        assert not b.campaign() and b.epoch is None
        first = a.epoch
        assert isinstance(first, int)
        a.renew()
        a.check()
        assert a.step_down() and not a.is_leader and a.epoch is None
        assert not a.lost.is_set()  # stepping down is not a loss
        assert b.campaign(wait=1)
        assert b.epoch is not None and b.epoch > first
        with pytest.raises(hotlock.LockLost):
            a.check()
        b.step_down()


def test_the_loss_is_told_at_once_and_a_standby_takes_over(redis_url: str) -> None:
    told: list[int] = []
    elected: list[int] = []
    with hotlock.connect(redis_url) as one, hotlock.connect(redis_url) as two:
        a = Leader(one, "jobs", ttl=1.5, on_lost=told.append, on_elected=elected.append)
        assert a.campaign()
        assert elected == [a.epoch]
        # Someone deletes the key (an operator, a failover that lost it): the next renewal
        # finds it gone, within a third of the TTL.
        redis.Redis.from_url(redis_url).delete(lock_name("leader:jobs"))
        assert a.lost.wait(1.5)
        assert told == elected and not a.is_leader
        with pytest.raises(hotlock.LockLost):
            a.renew()
        b = Leader(two, "jobs", ttl=1.5)
        assert b.campaign()
        # The deposed leader campaigns again: not while b leads.
        assert not a.campaign()
        # b's process stops renewing (its cache closes without a release): a standby
        # waiting on the key takes over as the TTL runs out, not later.
        two.close()
        start = time.monotonic()
        assert a.campaign(wait=5)
        took = time.monotonic() - start
        assert took < 1.5 + 0.5
        assert not a.lost.is_set()
        a.step_down()


def test_async_leader(redis_url: str) -> None:
    async def main() -> None:
        async with await hotlock.aio.connect(redis_url) as one, await hotlock.aio.connect(redis_url) as two:
            told: list[int] = []
            a = AsyncLeader(one, "jobs", ttl=1.5, on_lost=told.append)
            b = AsyncLeader(two, "jobs", ttl=1.5)
            assert await a.campaign()
            assert not await b.campaign()
            epoch = a.epoch
            await a.renew()
            side = redis.asyncio.Redis.from_url(redis_url)
            await side.delete(lock_name("leader:jobs"))
            await side.aclose()
            await asyncio.wait_for(a.lost.wait(), 1.5)
            assert told == [epoch] and not a.is_leader
            assert await b.campaign(wait=1)
            assert b.epoch is not None and epoch is not None and b.epoch > epoch
            assert await b.step_down()
            async with a:
                assert await a.campaign(wait=1)
            assert not a.is_leader

    asyncio.run(main())


def test_bad_arguments_fail_before_any_io(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("CACHE_URL", raising=False)
    with pytest.raises(TypeError, match=r"hotlock\.Cache"):
        Leader("redis://localhost", "x")  # type: ignore[arg-type]
    memory = hotlock.connect()  # the in-process cache: the checks need no server
    with pytest.raises(ValueError, match="name"):
        Leader(memory, "")
    with pytest.raises(ValueError, match="at least 1 s"):
        Leader(memory, "x", ttl=0.5)
    with pytest.raises(TypeError, match="on_lost"):
        Leader(memory, "x", on_lost=3)  # type: ignore[arg-type]
    with pytest.raises(ValueError):
        Leader(memory, "x").campaign(wait=-1)
    with pytest.raises(TypeError, match="AsyncCache"):
        AsyncLeader(memory, "x")  # type: ignore[arg-type]


# -- celery beats ---------------------------------------------------------------------


class Beat:
    """``celery beat -S hotlock.celery:LeaderScheduler`` in a process of its own."""

    def __init__(self, broker: str, locks: str, out: Path, n: int, prefix: str = "hotlock:", ttl: float = 2) -> None:
        self.logpath = out / f"beat-{n}-{time.monotonic_ns()}.log"
        self.log = open(self.logpath, "wb")  # noqa: SIM115 (closed in stop)
        env = {
            **os.environ,
            "HOTLOCK_TEST_BROKER": broker,
            "HOTLOCK_TEST_LOCKS": locks,
            "HOTLOCK_TEST_PREFIX": prefix,
            "HOTLOCK_TEST_TTL": str(ttl),
            "PYTHONPATH": str(ROOT),
        }
        cmd = [
            sys.executable,
            "-m",
            "celery",
            "-A",
            "tests.beat_app",
            "beat",
            "-S",
            "hotlock.celery:LeaderScheduler",
            "-l",
            "info",
            "-s",
            str(out / f"schedule-{n}"),
        ]
        self.proc = subprocess.Popen(cmd, cwd=out, env=env, stdout=self.log, stderr=subprocess.STDOUT)

    def epochs(self) -> list[int]:
        """The epochs this beat was elected with, from its log."""
        text = self.logpath.read_text(errors="replace")
        return [int(line.rsplit(" ", 1)[1]) for line in text.splitlines() if "elected, epoch" in line]

    def alive(self) -> bool:
        return self.proc.poll() is None

    def stop(self) -> None:
        with contextlib.suppress(ProcessLookupError):
            self.proc.send_signal(signal.SIGCONT)
            self.proc.kill()
        self.proc.wait(10)
        self.log.close()


class Ticks:
    """Watches the broker's queue (no worker reads it): each message the beats sent, with
    the moment it was first seen, its epoch and its tick."""

    def __init__(self, url: str) -> None:
        self.client = redis.Redis.from_url(url)
        self.seen: list[tuple[float, int, int]] = []  # (monotonic, epoch, tick)
        self._count = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, daemon=True)
        self._thread.start()

    def _watch(self) -> None:
        while not self._stop.wait(0.02):
            n = self.client.llen("celery")
            if n > self._count:
                # LPUSH: the newest are at the head.
                for raw in reversed(self.client.lrange("celery", 0, n - self._count - 1)):
                    headers = json.loads(raw)["headers"]
                    self.seen.append((time.monotonic(), int(headers["hotlock_epoch"]), int(headers["hotlock_tick"])))
                self._count = n

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(5)

    def duplicates(self) -> int:
        return sum(n - 1 for n in Counter(tick for _, _, tick in self.seen).values())

    def first_of_epoch_after(self, t: float, old: set[int]) -> tuple[float, int]:
        """(when, epoch) of the first tick after ``t`` from an epoch not in ``old``."""
        for when, epoch, _ in self.seen:
            if when > t and epoch not in old:
                return when, epoch
        raise AssertionError(f"no new leader ticked after {t}: {self.seen[-5:]}")

    def wait_new_epoch(self, t: float, old: set[int], timeout: float) -> tuple[float, int]:
        deadline = time.monotonic() + timeout
        while True:
            try:
                return self.first_of_epoch_after(t, old)
            except AssertionError:
                assert time.monotonic() < deadline, f"no new leader within {timeout} s: {self.seen[-5:]}"
                time.sleep(0.05)


@pytest.fixture
def servers() -> Iterator[tuple[RedisServer, RedisServer]]:
    """A broker and, apart from it, the Redis of the lease (stopped and resumed by the test)."""
    broker, locks = start_redis(), start_redis()
    yield broker, locks
    with contextlib.suppress(ProcessLookupError):
        os.kill(locks.pid or 0, signal.SIGCONT)
    broker.stop()
    locks.stop()


def leader_of(beats: list[Beat], epoch: int) -> Beat:
    return next(b for b in beats if epoch in b.epochs())


TTL = 2.0
TICK = 0.5


def test_beats_elect_one_leader_through_kill_stop_and_outage(
    servers: tuple[RedisServer, RedisServer], tmp_path: Path
) -> None:
    broker, locks = servers
    ticks = Ticks(broker.url)
    beats = [Beat(broker.url, locks.url, tmp_path, n) for n in range(2)]
    report: list[str] = []
    try:
        # 1. One of the two leads and ticks.
        when, epoch = ticks.wait_new_epoch(0, set(), timeout=30)
        time.sleep(1.5)
        leader = leader_of(beats, epoch)
        standby = next(b for b in beats if b is not leader)

        # 2. The leader is SIGKILLed: the standby takes over within one TTL (plus one tick).
        leader.proc.kill()
        killed = time.monotonic()
        when, epoch2 = ticks.wait_new_epoch(killed, {epoch}, timeout=10)
        report.append(f"SIGKILL: first tick of the new leader {when - killed:.2f} s after the kill")
        assert when - killed <= TTL + TICK + 0.5
        assert leader_of(beats, epoch2) is standby
        leader.stop()
        killed_beat = leader
        beats.append(Beat(broker.url, locks.url, tmp_path, 2))  # a new standby in its place
        time.sleep(3)

        # 3. The leader is SIGSTOPped: the standby takes over; resumed, the old one sends nothing twice.
        leader, standby = standby, beats[2]
        leader.proc.send_signal(signal.SIGSTOP)
        stopped = time.monotonic()
        when, epoch3 = ticks.wait_new_epoch(stopped, {epoch, epoch2}, timeout=10)
        report.append(f"SIGSTOP: first tick of the new leader {when - stopped:.2f} s after the stop")
        assert when - stopped <= TTL + TICK + 0.5
        time.sleep(max(0.0, stopped + 2 * TTL - time.monotonic()))
        leader.proc.send_signal(signal.SIGCONT)
        time.sleep(2)
        assert max(e for _, e, _ in ticks.seen) == epoch3, "the resumed beat did not lead again"
        assert [e for w, e, _ in ticks.seen if w > stopped + 0.1].count(epoch2) == 0

        # 4. The lease's Redis is unreachable for 3 TTLs: nobody ticks without it, and a
        # leader is elected again once it is back.
        os.kill(locks.pid or 0, signal.SIGSTOP)
        down = time.monotonic()
        time.sleep(3 * TTL)
        os.kill(locks.pid or 0, signal.SIGCONT)
        back = time.monotonic()
        during = [w for w, _, _ in ticks.seen if down + TTL + 0.5 < w < back]
        assert during == [], "a beat ticked without its lease"
        when, epoch4 = ticks.wait_new_epoch(back, {epoch, epoch2, epoch3}, timeout=15)
        report.append(f"Redis down {3 * TTL:.0f} s: first tick {when - back:.2f} s after it came back")
        time.sleep(1.5)

        # 5. The leader stops cleanly (SIGTERM): it steps down, and a standby leads at once.
        leaving = leader_of(beats, epoch4)
        leaving.proc.terminate()
        stopped = time.monotonic()
        when, _ = ticks.wait_new_epoch(stopped, {epoch, epoch2, epoch3, epoch4}, timeout=10)
        report.append(f"SIGTERM: first tick of the new leader {when - stopped:.2f} s after it")
        assert when - stopped <= 1.0 + TICK
        assert leaving.proc.wait(10) == 0
        time.sleep(1)
        report.append(f"ticks {len(ticks.seen)}, duplicates {ticks.duplicates()}, epochs {epoch}..{epoch4}+1")
        print("\n" + "\n".join(report))

        assert ticks.duplicates() == 0
        assert all(b.alive() for b in beats if b not in (killed_beat, leaving)), "a beat exited"
    finally:
        ticks.stop()
        for b in beats:
            b.stop()


def test_the_tick_checker_catches_two_leaders(servers: tuple[RedisServer, RedisServer], tmp_path: Path) -> None:
    # The broken lock: each beat under its own prefix leads alone and claims its own ticks.
    broker, locks = servers
    ticks = Ticks(broker.url)
    beats = [Beat(broker.url, locks.url, tmp_path, n, prefix=f"p{n}:") for n in range(2)]
    try:
        deadline = time.monotonic() + 30
        while ticks.duplicates() < 2:
            assert time.monotonic() < deadline, f"no duplicates seen: {ticks.seen}"
            time.sleep(0.1)
    finally:
        ticks.stop()
        for b in beats:
            b.stop()


@pytest.mark.slow
def test_beats_take_over_within_the_default_ttl(servers: tuple[RedisServer, RedisServer], tmp_path: Path) -> None:
    # The long form: the default 10 s lease, the leader SIGKILLed, then the next SIGSTOPped.
    broker, locks = servers
    ttl = 10.0
    ticks = Ticks(broker.url)
    beats = [Beat(broker.url, locks.url, tmp_path, n, ttl=ttl) for n in range(3)]
    report = []
    try:
        _, epoch = ticks.wait_new_epoch(0, set(), timeout=30)
        seen = {epoch}
        for how in (signal.SIGKILL, signal.SIGSTOP):
            time.sleep(3)
            leader_of(beats, epoch).proc.send_signal(how)
            at = time.monotonic()
            when, epoch = ticks.wait_new_epoch(at, seen, timeout=2 * ttl)
            seen.add(epoch)
            report.append(f"{how.name}: first tick of the new leader {when - at:.2f} s after it (ttl {ttl:g} s)")
            assert when - at <= ttl + TICK + 0.5
        time.sleep(2)
        print("\n" + "\n".join(report) + f"\nticks {len(ticks.seen)}, duplicates {ticks.duplicates()}")
        assert ticks.duplicates() == 0
    finally:
        ticks.stop()
        for b in beats:
            b.stop()


@pytest.mark.parametrize("page", ["leader.md", "celery.md"])
def test_the_recipes_compile(page: str) -> None:
    # The APScheduler and FastAPI recipes are not run (neither framework is a dependency):
    # at least each Python block of the page is valid Python.
    text = (ROOT / "docs" / page).read_text()
    blocks = re.findall(r"```python\n(.*?)```", text, re.DOTALL)
    assert blocks
    for block in blocks:
        compile(block, f"docs/{page}", "exec")
