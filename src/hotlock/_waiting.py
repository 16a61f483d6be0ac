"""lock_wait's decisions, sans-IO: which script the next attempt sends, when to start the
wake-up subscriber, when to join the key's channel, whether to sleep on the wake-up or on a
plain timer and for how long, and when to give up.

``Waiting`` holds them once for every Python driver: hotlock.backends.wakeup.wait (the
sync loop of the redis-py and cluster backends) and AsyncCache._acquire (every async
backend). It sends nothing, sleeps never and reads the clock only through the function
it is given; a driver does what the step it returns says and reports back. The native
backend's loop (NativeBackend.acquire_wait in ext/_sync.pxi) takes the same steps in C;
tests/test_waiting.py holds the three to the same sequence against a real server.

A driver makes the first attempt itself, with FIRST, and makes a ``Waiting`` only when
that attempt fails: before it nothing is known (no subscriber, no channel), so it is
always plain, and an uncontended lock_wait pays for no machine at all.

The steps after a failed attempt, in the order the driver meets them::

    failed(result) -> START     slot.get(), then started(hub is not None)  (after the first attempt)
                   -> JOIN      hub.join(channel), then joined(its entry)  (after the first marking one)
                   -> SLEEP     a plain timer of sleep_s, then slept()
                   -> WAKEABLE  up to sleep_s on the waiter, then slept()
                   -> GIVE_UP   the deadline has passed: the last result stands
    slept()        -> LOOK      hub.subscribed(channel), then looked(entry)  (before the first marking one)
                   -> ATTEMPT   send ``script``

started, joined and looked return the next step too, as failed does.
"""

from __future__ import annotations

import enum
import random
import time
from collections.abc import Callable, Sized
from typing import Any, Generic, Protocol, TypeVar

from ._backoff import CAP_MS, delay_ms
from ._keys import wake_channel
from ._scripts import ACQUIRE, ACQUIRE_CHAIN, ACQUIRE_POLL, ACQUIRE_WAIT, Script
from ._subscriber import Sleeper

__all__ = ["FIRST", "POLL_FIRST", "ChannelEntry", "Joining", "Step", "Waiting", "poll"]

W = TypeVar("W", bound=Sleeper)  # a waiter: a thread's (wakeup.Waiter) or a task's (wakeup_async.AsyncWaiter)

# Attempts a lock_wait makes on its plain backoff before it asks to be woken: the first;
# after one sleep on the backoff's first step (0-1 ms) the next attempt marks. Measured
# against 2 and 3 under contention: the waits that outlast one short sleep are woken
# sooner, which lowers the p99 wait, and split cores keep polling's sections/s. The
# extension reads it from here too (through hotlock.backends.wakeup), so the C loop
# cannot drift from it.
POLL_FIRST = 1

# The first attempt of every wait: nothing is known before it, so it never marks.
FIRST = ACQUIRE


class Step(enum.Enum):
    """What the driver does next (see the module docstring)."""

    ATTEMPT = "attempt"
    START = "start"
    LOOK = "look"
    JOIN = "join"
    SLEEP = "sleep"
    WAKEABLE = "wakeable"
    GIVE_UP = "give up"


class ChannelEntry(Protocol):
    """What the machine reads of a channel's entry (hotlock._subscriber.Entry, the sync and
    the async subscriber's). Read-only here: only the subscriber changes them."""

    @property
    def seq(self) -> int: ...
    @property
    def confirmed(self) -> bool: ...
    @property
    def waiters(self) -> Sized: ...


class Waiting:
    """One lock_wait after its first attempt failed (see the module docstring).

    ``start`` is the clock's time when the wait began (the first attempt was sent):
    the deadline is ``wait_ms`` after it. ``clock`` (time.monotonic for the drivers) is read
    exactly where the loops before this one read it: before joining and before each sleep.
    ``draw`` gives the backoff's uniform draws in [0, 1). ``wakeups`` is False when the
    backend has no subscriber slot: then the wait polls on the plain schedule and sends
    ACQUIRE only."""

    __slots__ = (
        "_attempts",
        "_clock",
        "_draw",
        "_entry",
        "_hub",
        "_key",
        "_result",
        "_wakeups",
        "_watched",
        "channel",
        "deadline",
        "poll_first",
        "script",
        "seq",
        "sleep_s",
    )

    def __init__(
        self,
        key: bytes,
        wait_ms: int,
        start: float,
        clock: Callable[[], float],
        draw: Callable[[], float],
        wakeups: bool = True,
        poll_first: int = POLL_FIRST,
    ) -> None:
        self.deadline = start + wait_ms / 1000.0
        # What the next attempt sends: after a failed one, never the transaction (ACQUIRE_POLL).
        self.script: Script = ACQUIRE_POLL
        self.channel = b""  # the key's wake-up channel, known from the first LOOK on
        self.seq = 0  # the channel's message count as the last attempt went out
        self.sleep_s = 0.0  # the length of the sleep a SLEEP or WAKEABLE step asks for
        self.poll_first = poll_first
        self._key = key
        self._clock = clock
        self._draw = draw
        self._wakeups = wakeups
        self._attempts = 0  # failed attempts so far, the first included
        self._result = 0
        self._hub = False  # the subscriber is live
        self._watched: ChannelEntry | None = None  # the confirmed subscription as the first marking attempt went
        self._entry: ChannelEntry | None = None  # the channel joined, once joined

    @property
    def failures(self) -> int:
        """The attempts that did not acquire so far, the first (the driver's own) included."""
        return self._attempts

    def failed(self, result: int) -> Step:
        """An attempt did not acquire: ``result`` is -(the holder's PTTL), or 0 when unknown."""
        self._attempts += 1
        self._result = result
        if self._attempts == 1:
            if self._wakeups:
                # Started now, so it is connected by the time this wait joins.
                return Step.START
        elif self._attempts == self.poll_first + 1 and self._hub and self._clock() < self.deadline:
            # The first marking attempt failed: most waits never get here, and joining
            # costs more than an attempt.
            return Step.JOIN
        return self._pace()

    def started(self, live: bool) -> Step:
        """After START: whether slot.get() gave a live subscriber (None: wake-ups are off)."""
        self._hub = live
        return self._pace()

    def joined(self, entry: ChannelEntry | None) -> Step:
        """After JOIN: the entry of the waiter hub.join() gave, or None (wake-ups off: poll)."""
        if entry is not None:
            self._entry = entry
            if entry is not self._watched:
                # Subscribed after the marking attempt went out: a release meanwhile may have
                # gone unheard, so the seq is set one behind and the wait tries again at
                # once. Still being subscribed: the server's confirmation wakes the
                # channel's first waiter, which then tries again.
                self.seq = entry.seq - 1 if entry.confirmed else entry.seq
        return self._pace()

    def looked(self, entry: ChannelEntry | None) -> Step:
        """After LOOK: hub.subscribed(channel), the channel's confirmed entry or None."""
        self._watched = entry
        self.seq = 0 if entry is None else entry.seq
        # Other waiters of this process on the key: take it already marked, so its
        # release wakes the next of them.
        self.script = ACQUIRE_CHAIN if entry is not None and entry.waiters else ACQUIRE_WAIT
        return Step.ATTEMPT

    def slept(self) -> Step:
        """After a sleep (or none: a message came while the attempt was out)."""
        entry = self._entry
        if entry is not None:
            self.seq = entry.seq
            self.script = ACQUIRE_CHAIN if len(entry.waiters) > 1 else ACQUIRE_WAIT
        elif self._attempts == self.poll_first and self._hub:
            # The plain attempts are over: the next one marks.
            self.channel = wake_channel(self._key)
            return Step.LOOK
        return Step.ATTEMPT

    def _pace(self) -> Step:
        remaining_ms = (self.deadline - self._clock()) * 1000.0
        if remaining_ms <= 0:
            return Step.GIVE_UP
        # The _backoff schedule: the n-th sleep of the wait follows its n-th failed attempt,
        # never past the deadline nor the holder's TTL.
        self.sleep_s = delay_ms(self._attempts - 1, self._draw(), remaining_ms, -self._result, CAP_MS) / 1000.0
        entry = self._entry
        if entry is None:
            return Step.SLEEP
        if entry.seq == self.seq:  # no message came while the attempt was out
            return Step.WAKEABLE
        return self.slept()


def poll(acquire: Callable[[Script], int], wait_ms: int) -> tuple[int, float, int]:
    """The driver of a wait without wake-ups (the in-process backend, a Redis backend with
    wake-ups off): ``acquire(script)`` on the backoff schedule, FIRST then the machine's
    script, until it returns a fence (> 0) or the deadline passes. Returns the last result,
    the time.monotonic() that attempt was sent and the number of attempts made."""
    sent = time.monotonic()
    result = acquire(FIRST)
    if result > 0:
        return result, sent, 1
    # No channel is ever looked up without wake-ups, so the machine needs no key.
    machine = Waiting(b"", wait_ms, sent, time.monotonic, random.random, wakeups=False)
    step = machine.failed(result)
    while step is not Step.GIVE_UP:
        if step is Step.SLEEP:
            time.sleep(machine.sleep_s)
            step = machine.slept()
            continue
        sent = time.monotonic()
        result = acquire(machine.script)
        if result > 0:
            return result, sent, machine.failures + 1
        step = machine.failed(result)
    return result, sent, machine.failures


class Joining(Generic[W]):
    """Where one lock_wait stands with the wake-ups: the hub it asked (``slot.get()``: a
    backend's subscriber, hotlock._hubs) and the waiter it joined. Waiting's wake-up steps
    (START, LOOK, JOIN) are taken here through the objects given, alike for the sync and the
    async driver; each driver only attempts and sleeps."""

    __slots__ = ("_slot", "hub", "waiter")

    def __init__(self, slot: Any) -> None:
        self._slot = slot  # a Made (Slot, AsyncSlot): get() the hub, or None when wake-ups are off
        self.hub: Any = None
        self.waiter: W | None = None

    def through(self, machine: Waiting, step: Step) -> Step:
        """The wake-up steps from ``step`` on, taken: the first step that is not one."""
        while True:
            if step is Step.START:
                self.hub = self._slot.get()
                step = machine.started(self.hub is not None)
            elif step is Step.LOOK:
                step = machine.looked(self.hub.subscribed(machine.channel))
            elif step is Step.JOIN:
                self.waiter = self.hub.join(machine.channel)
                step = machine.joined(None if self.waiter is None else self.waiter.entry)
            else:
                return step

    def leave(self, acquired: bool) -> None:
        """The wait is over, ``acquired`` or not (a wake it did not use goes on): once."""
        if self.waiter is not None:
            self.hub.leave(self.waiter, acquired)
            self.waiter = None
