"""The wait state machine (hotlock._waiting.Waiting) alone: fed scripted replies and walked
as a driver would, with a clock that moves only when the walk sleeps. tests/test_waiting.py
holds the three wait loops (C, sync Python, async) to what this machine predicts."""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest

from hotlock._backoff import CAP_MS, delay_ms
from hotlock._keys import wake_channel
from hotlock._scripts import ACQUIRE, ACQUIRE_CHAIN, ACQUIRE_WAIT
from hotlock._waiting import FIRST, POLL_FIRST, Step, Waiting

NAMES = {ACQUIRE.sha: "ACQUIRE", ACQUIRE_WAIT.sha: "WAIT", ACQUIRE_CHAIN.sha: "CHAIN"}


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
