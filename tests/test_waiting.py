"""The wait state machine (hotlock._waiting.Waiting) alone, and the three wait loops held to it.

The first half feeds the machine scripted replies and walks its steps as a driver would,
with a clock that moves only when the walk sleeps. The second half runs a lock_wait on
each of the three loops (the native backend's in C, the sync pure-Python driver on
redis-py, the async driver) against a real server, records what each sends through a
MONITOR connection, and checks that all three take the steps the machine predicts for the
replies they got: the same plain attempts, marking from then on, the join after the first
marking attempt, and the acquisition right after the release. Timing decides how many
attempts a wait makes, so that count is read from the server, never assumed.
"""

from __future__ import annotations

import asyncio
import re
import socket
import threading
import time
import uuid
from dataclasses import dataclass, field

import pytest
import redis

import hotlock
import hotlock.aio
from hotlock._backoff import CAP_MS, delay_ms
from hotlock._keys import wake_channel
from hotlock._scripts import ACQUIRE, ACQUIRE_CHAIN, ACQUIRE_WAIT, RELEASE
from hotlock._waiting import FIRST, POLL_FIRST, Step, Waiting

from .conftest import lock_name, native_for_module

NAMES = {ACQUIRE.sha: "ACQUIRE", ACQUIRE_WAIT.sha: "WAIT", ACQUIRE_CHAIN.sha: "CHAIN"}


# -- the machine alone --------------------------------------------------------------------


@dataclass
class Entry:
    """A channel's entry as the subscriber keeps it (wakeup.Entry's shape)."""

    seq: int = 0
    confirmed: bool = False
    waiters: list[object] = field(default_factory=lambda: [object()])


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


@dataclass
class Walk:
    """What a simulated driver saw: ``trace`` names each attempt by its script and each
    other step by its name; ``sleeps`` the lengths asked for."""

    trace: list[str] = field(default_factory=list)
    sleeps: list[float] = field(default_factory=list)
    acquired: bool = False


def walk(
    replies: list[int],
    *,
    wait_ms: int = 10_000,
    wakeups: bool = True,
    live: bool = True,
    subscribed: Entry | None = None,
    joined: Entry | None = None,
    poll_first: int = POLL_FIRST,
    draw: float = 0.5,
    during_attempt: dict[int, Entry] | None = None,
    attempt_s: float = 0.0,
) -> Walk:
    """Drive a Waiting as hotlock.backends.wakeup.wait does, over ``replies`` (one per
    attempt: > 0 acquires). ``during_attempt[i]``: an entry whose seq moves while the i-th
    attempt (from 0) is out, as a message would. Each attempt after the first takes
    ``attempt_s`` of the clock."""
    clock = Clock()
    seen = Walk()
    replies = list(replies)
    seen.trace.append(NAMES[FIRST.sha])
    result = replies.pop(0)
    if result > 0:
        seen.acquired = True
        return seen
    machine = Waiting(b"hotlock:lock:{k}", wait_ms, clock(), clock, lambda: draw, wakeups, poll_first)
    step = machine.failed(result)
    attempt = 1
    while True:
        if step is Step.ATTEMPT:
            seen.trace.append(NAMES[machine.script.sha])
            if during_attempt and attempt in during_attempt:
                during_attempt[attempt].seq += 1
            attempt += 1
            clock.now += attempt_s
            result = replies.pop(0)
            if result > 0:
                seen.acquired = True
                return seen
            step = machine.failed(result)
            continue
        seen.trace.append(step.value)
        if step in (Step.SLEEP, Step.WAKEABLE):
            seen.sleeps.append(machine.sleep_s)
            clock.now += machine.sleep_s
            step = machine.slept()
        elif step is Step.START:
            step = machine.started(live)
        elif step is Step.LOOK:
            assert machine.channel == wake_channel(b"hotlock:lock:{k}")
            step = machine.looked(subscribed)
        elif step is Step.JOIN:
            step = machine.joined(joined)
        else:
            assert step is Step.GIVE_UP
            return seen


HELD = -5_000  # a conflict: the holder's PTTL, negated


def test_the_first_attempt_is_plain_and_an_uncontended_wait_makes_no_machine() -> None:
    assert FIRST is ACQUIRE
    assert walk([7]).trace == ["ACQUIRE"]


def test_poll_first_plain_attempts_then_marking_then_joining_after_the_first_failed_mark() -> None:
    seen = walk([HELD] * 4 + [7], joined=Entry())
    assert POLL_FIRST == 1
    assert seen.trace == [
        "ACQUIRE",
        "start",  # the subscriber starts after the first failed attempt
        "sleep",
        "look",
        "WAIT",  # the first marking attempt
        "join",  # joined only because it failed
        "wakeable",
        "WAIT",
        "wakeable",
        "WAIT",
        "wakeable",
        "WAIT",
    ]
    assert seen.acquired


@pytest.mark.parametrize("poll_first", [1, 2, 3])
def test_the_plain_attempts_are_poll_first_many(poll_first: int) -> None:
    seen = walk([HELD] * 6 + [7], joined=Entry(), poll_first=poll_first)
    attempts = [t for t in seen.trace if t.isupper()]
    assert attempts == ["ACQUIRE"] * poll_first + ["WAIT"] * (7 - poll_first)
    # Joined right after the first marking attempt failed, and only then.
    assert seen.trace.count("join") == 1
    before_join = seen.trace[: seen.trace.index("join")]
    assert [t for t in before_join if t.isupper()] == ["ACQUIRE"] * poll_first + ["WAIT"]
    assert seen.trace.index("look") == seen.trace.index("WAIT") - 1


def test_a_first_marking_attempt_that_acquires_never_joins() -> None:
    seen = walk([HELD, 7])
    assert seen.trace == ["ACQUIRE", "start", "sleep", "look", "WAIT"]


def test_chain_when_other_waiters_of_the_process_wait_on_the_key() -> None:
    others = Entry(seq=3, confirmed=True, waiters=[object()])
    seen = walk([HELD, 7], subscribed=others)
    assert seen.trace[-1] == "CHAIN"
    # Joined beside another waiter: every attempt after the join chains.
    two = Entry(seq=0, confirmed=False, waiters=[object(), object()])
    seen = walk([HELD, HELD, HELD, 7], joined=two)
    assert [t for t in seen.trace if t.isupper()] == ["ACQUIRE", "WAIT", "CHAIN", "CHAIN"]


def test_it_gives_up_at_the_deadline() -> None:
    seen = walk([HELD] * 1000, wait_ms=200, joined=Entry())
    assert seen.trace[-1] == "give up"
    assert sum(seen.sleeps) == pytest.approx(0.2)
    # wait=0 is one attempt; the subscriber is still started, as the loops always did.
    assert walk([HELD], wait_ms=0).trace == ["ACQUIRE", "start", "give up"]
    assert walk([HELD], wait_ms=0, wakeups=False).trace == ["ACQUIRE", "give up"]


def test_no_join_once_the_deadline_has_passed() -> None:
    # A 1 ms wait: the first sleep takes half of it, the marking attempt the rest.
    seen = walk([HELD] * 3, wait_ms=1, draw=0.5, joined=Entry(), attempt_s=0.0006)
    assert "join" not in seen.trace
    assert seen.trace[-1] == "give up"


def test_a_release_before_the_join_means_try_again_at_once() -> None:
    # The channel's subscription was confirmed after the marking attempt went out (the
    # attempt saw none): a release meanwhile may have gone unheard, so no sleep.
    seen = walk([HELD, HELD, 7], joined=Entry(seq=4, confirmed=True))
    assert seen.trace == ["ACQUIRE", "start", "sleep", "look", "WAIT", "join", "WAIT"]
    # The same subscription already seen by the attempt: nothing missed, it sleeps.
    watched = Entry(seq=4, confirmed=True, waiters=[])
    seen = walk([HELD, HELD, 7], subscribed=watched, joined=watched)
    assert seen.trace == ["ACQUIRE", "start", "sleep", "look", "WAIT", "join", "wakeable", "WAIT"]


def test_a_message_while_the_attempt_was_out_means_try_again_at_once() -> None:
    entry = Entry()
    seen = walk([HELD, HELD, HELD, HELD, 7], joined=entry, during_attempt={3: entry})
    assert seen.trace == [
        "ACQUIRE", "start", "sleep", "look", "WAIT", "join", "wakeable", "WAIT", "wakeable", "WAIT", "WAIT"
    ]  # fmt: skip


def test_without_wakeups_it_polls_plain() -> None:
    for seen in (walk([HELD] * 4 + [7], wakeups=False), walk([HELD] * 4 + [7], live=False)):
        assert [t for t in seen.trace if t.isupper()] == ["ACQUIRE"] * 5
        assert "join" not in seen.trace and "look" not in seen.trace
        assert set(seen.trace) <= {"ACQUIRE", "start", "sleep"}


def test_the_sleeps_are_the_backoff_schedule_and_end_by_the_holders_ttl() -> None:
    seen = walk([HELD] * 8 + [7], draw=0.75, joined=Entry())
    assert seen.sleeps == [delay_ms(n, 0.75, 10_000, 5_000, CAP_MS) / 1000.0 for n in range(8)]
    seen = walk([-2] * 12 + [7], draw=0.99, joined=Entry())
    assert max(seen.sleeps) <= 0.002


# -- the three loops against a server ----------------------------------------------------


class Monitor:
    """The commands the server runs, in its order, read from a MONITOR connection."""

    def __init__(self, url: str) -> None:
        client = redis.Redis.from_url(url)
        kwargs = client.connection_pool.connection_kwargs
        self._sock = socket.create_connection((kwargs["host"], kwargs["port"]), timeout=30)
        self._sock.sendall(b"MONITOR\r\n")
        self._stop = f"stop-{uuid.uuid4().hex}"
        self._buf = b""
        assert self._line() == "+OK"
        self.commands: list[list[str]] = []
        self._thread = threading.Thread(target=self._read, daemon=True)
        self._thread.start()
        self._client = client

    def _line(self) -> str:
        while b"\r\n" not in self._buf:
            data = self._sock.recv(65536)
            if not data:
                raise ConnectionError("MONITOR connection closed")
            self._buf += data
        line, self._buf = self._buf.split(b"\r\n", 1)
        return line.decode("latin-1")

    def _read(self) -> None:
        while True:
            line = self._line()
            args = [m.group(1) for m in re.finditer(r'"((?:[^"\\]|\\.)*)"', line.partition("]")[2])]
            if args[:2] == ["ECHO", self._stop]:
                return
            self.commands.append(args)

    def stop(self) -> list[list[str]]:
        self._client.echo(self._stop)
        self._thread.join(30)
        assert not self._thread.is_alive(), "MONITOR never saw its stop"
        self._sock.close()
        self._client.close()
        return self.commands


@dataclass
class Shape:
    attempts: list[str]  # the scripts of the waiter's attempts, in order
    join_after: int  # attempts the server ran before the channel's SUBSCRIBE
    after_release: int  # attempts the server ran after the release


def shape_of(commands: list[list[str]], key: bytes) -> Shape:
    name, channel = key.decode(), wake_channel(key).decode()
    attempts: list[str] = []
    join_after = after_release = -1
    for args in commands:
        if args[0] in ("SUBSCRIBE", "SSUBSCRIBE") and channel in args[1:] and join_after < 0:
            join_after = len(attempts)
        if args[0] == "EVALSHA" and len(args) > 3 and args[3] == name:
            sha = args[1].encode()
            if sha in NAMES:
                attempts.append(NAMES[sha])
                if after_release >= 0:
                    after_release += 1
            elif sha == RELEASE.sha and after_release < 0:  # the holder's; the waiter's own unlock comes later
                after_release = 0
    return Shape(attempts, join_after, after_release)


def predicted(attempts: int) -> list[str]:
    """The machine's scripts for a lone waiter whose ``attempts``-th attempt acquires."""
    seen = walk([HELD] * (attempts - 1) + [7], joined=Entry())
    return [t for t in seen.trace if t.isupper()]


def hold_then_release(url: str, key: str, wait_for: object, hold_s: float) -> Shape:
    """Hold ``key``, run ``wait_for(key)`` (a lock_wait on one loop) in a thread, release
    after ``hold_s``; the shape of what the waiter sent."""
    side = redis.Redis.from_url(url)
    for script in (ACQUIRE, ACQUIRE_WAIT, ACQUIRE_CHAIN, RELEASE):
        side.script_load(script.source)  # no NOSCRIPT resends to tell apart
    side.close()
    holder = hotlock.connect(url, backend="redis-py", wakeups=False)
    held = holder.lock(key, ttl=30)
    monitor = Monitor(url)
    outcome: list[object] = []

    def run() -> None:
        try:
            outcome.append(wait_for(key))  # type: ignore[operator]
        except BaseException as exc:  # reported by the main thread
            outcome.append(exc)

    waiter = threading.Thread(target=run)
    waiter.start()
    time.sleep(hold_s)
    assert held.unlock()
    waiter.join(30)
    commands = monitor.stop()
    holder.close()
    assert outcome and outcome[0] is True, outcome
    return shape_of(commands, lock_name(key))


def sync_loop(backend: str) -> object:
    """The sync lock_wait on ``backend``: the C loop on "native", the Python driver on "redis-py"."""

    def factory(url: str) -> object:
        def run(key: str) -> bool:
            cache = hotlock.connect(url, backend=backend)
            try:
                cache.lock_wait(key, ttl=5, wait=20).unlock()
                return True
            finally:
                cache.close()

        return run

    return factory


def native_async(url: str) -> object:
    def run(key: str) -> bool:
        async def main() -> bool:
            cache = await hotlock.aio.connect(url, backend="native")
            try:
                lock = await cache.lock_wait(key, ttl=5, wait=20)
                await lock.unlock()
                return True
            finally:
                await cache.close()

        return asyncio.run(main())

    return run


def test_the_three_loops_take_the_steps_the_machine_predicts(redis_url: str) -> None:
    native_for_module()  # the C loop is one of the three: a failure where make test requires it
    loops = {"native": sync_loop("native"), "redis-py": sync_loop("redis-py"), "async": native_async}
    shapes = {}
    for name, make in loops.items():
        shapes[name] = hold_then_release(redis_url, f"diff-{name}", make(redis_url), 0.3)
    for name, shape in shapes.items():
        n = len(shape.attempts)
        # A 0.3 s hold outlasts the plain attempts and the first marking one on any load.
        assert n >= POLL_FIRST + 2, (name, shape)
        assert shape.attempts == predicted(n), (name, shape)
        # Joined (its SUBSCRIBE ran) only after the first marking attempt failed.
        assert shape.join_after >= POLL_FIRST + 1, (name, shape)
        # The release is followed by exactly one attempt: the one that acquires.
        assert shape.after_release == 1, (name, shape)
    # And the three agree with each other, as far as timing lets them.
    plain = {name: s.attempts.index("WAIT") for name, s in shapes.items()}
    assert set(plain.values()) == {POLL_FIRST}, plain
