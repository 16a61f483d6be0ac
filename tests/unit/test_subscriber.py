"""hotlock._subscriber.Subscriber without a server: the wake-up subscriber's protocol fed
the bytes a server would send, the time handed in. What each reply means, whom it wakes,
what the handshake reads and which idle channels are unsubscribed; the drivers
(hotlock.backends.wakeup and wakeup_async) are run against real servers by
tests/test_wakeups.py."""

from __future__ import annotations

import logging
from typing import Any

import pytest

from hotlock._subscriber import LINGER_S, TICK_S, ConnectTrouble, Entry, Refused, Subscriber, resp_command

CHANNEL = b"hotlock:wake:{k}"
OTHER = b"hotlock:wake:{o}"


class Sleeper:
    """A waiter as the drivers' are: counts its wakes, keeps one pending."""

    def __init__(self) -> None:
        self.entry: Entry[Any] | None = None
        self.wakes = 0
        self.pending = False

    def wake(self) -> None:
        self.wakes += 1
        self.pending = True

    def drain(self) -> bool:
        woken, self.pending = self.pending, False
        return woken


def bulk(value: bytes) -> bytes:
    return b"$%d\r\n%s\r\n" % (len(value), value)


def push(kind: bytes, channel: bytes, last: bytes | int) -> bytes:
    """A pub/sub push: a message (its payload) or a (un)subscribe confirmation (the count)."""
    tail = bulk(last) if isinstance(last, bytes) else b":%d\r\n" % last
    return b"*3\r\n" + bulk(kind) + bulk(channel) + tail


OK = b"+OK\r\n"
SETINFO = (b"CLIENT", b"SETINFO", b"LIB-NAME", b"hotlock")


def serving(sharded: bool = False, now: float = 0.0) -> Subscriber[Sleeper]:
    """A subscriber past a handshake nothing in can refuse (its reply skipped as it comes)."""
    core: Subscriber[Sleeper] = Subscriber("redis://h:1/0", sharded)
    assert core.connecting([SETINFO], [None]) == resp_command(*SETINFO)
    assert not core.greeting
    core.serving(now)
    core.feed(b"-ERR unknown subcommand 'SETINFO'\r\n")  # skipped, whatever it is
    return core


def joined(core: Subscriber[Sleeper], channel: bytes = CHANNEL, now: float = 0.0) -> list[Sleeper]:
    """Two waiters joined on ``channel``, its subscription confirmed."""
    first, second = Sleeper(), Sleeper()
    assert core.join(channel, first, now)
    assert not core.join(channel, second, now)  # one SUBSCRIBE per channel
    assert core.outgoing() == resp_command(b"SUBSCRIBE", channel)
    assert core.outgoing() == b""
    core.feed(push(b"subscribe", channel, 1))
    first.drain()
    return [first, second]


# -- the handshake ------------------------------------------------------------------------


def test_a_handshake_that_can_be_refused_is_read_before_serving() -> None:
    core: Subscriber[Sleeper] = Subscriber("redis://h:1/0")
    auth = (b"AUTH", b"app", b"pw")
    sent = core.connecting([auth, SETINFO], ["AUTH", None])
    assert sent == resp_command(*auth) + resp_command(*SETINFO)
    assert core.greeting
    core.feed(OK)
    assert core.greeting  # one reply of two
    core.feed(b"-ERR unknown subcommand\r\n")  # a refused CLIENT SETINFO is ignored
    assert not core.greeting
    core.serving(0.0)
    # Nothing left to skip: the first reply after it is the SUBSCRIBE's.
    [first, _] = joined(core)
    assert core.subscribed(CHANNEL) is first.entry


def test_a_refused_handshake_command_is_refused_by_name() -> None:
    core: Subscriber[Sleeper] = Subscriber("redis://h:1/0")
    core.connecting([(b"AUTH", b"pw"), (b"CLIENT", b"SETNAME", b"n")], ["AUTH", "CLIENT SETNAME"])
    with pytest.raises(Refused, match=r"^AUTH refused: WRONGPASS invalid password$"):
        core.feed(b"-WRONGPASS invalid password\r\n" + OK)
    assert not core.greeting


def test_replies_split_across_reads_are_put_together() -> None:
    core = serving()
    waiter = Sleeper()
    core.join(CHANNEL, waiter, 0.0)
    core.outgoing()
    reply = push(b"subscribe", CHANNEL, 1)
    core.feed(reply[:7])
    assert core.subscribed(CHANNEL) is None
    core.feed(reply[7:])
    assert core.subscribed(CHANNEL) is waiter.entry


# -- what a reply means ---------------------------------------------------------------------


def test_the_confirmation_wakes_the_first_waiter_only() -> None:
    core = serving()
    first, second = Sleeper(), Sleeper()
    core.join(CHANNEL, first, 0.0)
    core.join(CHANNEL, second, 0.0)
    core.outgoing()
    entry = first.entry
    assert entry is not None and not entry.confirmed and entry.seq == 0
    assert core.subscribed(CHANNEL) is None  # not yet: a waiter does not mark at once
    core.feed(push(b"subscribe", CHANNEL, 1))
    assert entry.confirmed and entry.seq == 1
    assert (first.wakes, second.wakes) == (1, 0)


def test_a_message_wakes_the_longest_waiting_waiter_and_counts() -> None:
    core = serving()
    first, second = joined(core)
    assert first.entry is not None
    seq = first.entry.seq
    core.feed(push(b"message", CHANNEL, b"") * 2)
    assert first.entry.seq == seq + 2
    assert (first.wakes, second.wakes) == (3, 0)
    core.feed(push(b"message", OTHER, b""))  # a channel nobody here waits on
    assert first.entry.seq == seq + 2


def test_an_unsolicited_unsubscribe_forgets_the_channel_and_wakes_all() -> None:
    core = serving(sharded=True)
    first, second = Sleeper(), Sleeper()
    core.join(CHANNEL, first, 0.0)
    core.join(CHANNEL, second, 0.0)
    assert core.outgoing() == resp_command(b"SSUBSCRIBE", CHANNEL)
    core.feed(push(b"ssubscribe", CHANNEL, 1))
    entry = first.entry
    assert entry is not None
    # The slot moved to another node: the old one unsubscribes the channel.
    core.feed(push(b"sunsubscribe", CHANNEL, 0))
    assert CHANNEL not in core.entries and core.subscribed(CHANNEL) is None
    assert not entry.confirmed and entry.seq == 2
    assert (first.wakes, second.wakes) == (2, 1)
    # The next wait on it subscribes again (at the new owner, its driver's choice).
    assert core.join(CHANNEL, Sleeper(), 1.0)


@pytest.mark.parametrize("error", ["MOVED 1234 10.0.0.2:7000", "ASK 1 h:1", "TRYAGAIN x", "CLUSTERDOWN down"])
def test_a_subscribe_sent_to_the_wrong_node_forgets_the_channel(error: str) -> None:
    core = serving(sharded=True)
    waiter = Sleeper()
    core.join(CHANNEL, waiter, 0.0)
    core.outgoing()
    core.feed(b"-%s\r\n" % error.encode())
    assert core.off is None
    assert CHANNEL not in core.entries and waiter.wakes == 1


def test_a_refused_subscribe_turns_wake_ups_off_and_says_so(caplog: pytest.LogCaptureFixture) -> None:
    core = serving()
    waiter = Sleeper()
    core.join(CHANNEL, waiter, 0.0)
    core.join(OTHER, Sleeper(), 0.0)
    core.outgoing()
    caplog.set_level(logging.DEBUG, logger="hotlock")
    core.feed(b"-NOPERM no permissions\r\n" + push(b"subscribe", OTHER, 1))
    assert core.off == "the server refused SUBSCRIBE hotlock:wake:{k}: NOPERM no permissions"
    # The driver stops there: the replies after the refusal are left unread.
    assert core.subscribed(OTHER) is None
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert warnings == [
        "wake-ups are off for redis://h:1/0: the server refused SUBSCRIBE hotlock:wake:{k}: "
        "NOPERM no permissions; lock_wait polls with backoff"
    ]


# -- lingering channels -------------------------------------------------------------------


def test_a_channel_nobody_waits_on_is_unsubscribed_after_lingering() -> None:
    core = serving(now=100.0)
    first, second = joined(core, now=100.0)
    assert core.wait_s(100.0) == TICK_S
    assert not core.due(100.0 + TICK_S / 2)
    assert core.due(100.0 + TICK_S)
    assert not core.due(100.0 + TICK_S)  # the next one is TICK_S later
    assert core.wait_s(100.0 + TICK_S) == TICK_S
    core.leave(first, True, 101.0)
    assert core.sweep(200.0) == b""  # still waited on
    core.leave(second, True, 102.0)
    assert core.sweep(102.0 + LINGER_S - 0.1) == b""  # lingering: a hot key stays subscribed
    assert core.sweep(102.0 + LINGER_S) == resp_command(b"UNSUBSCRIBE", CHANNEL)
    assert CHANNEL not in core.entries
    # Its confirmation is the reply asked for, not a channel moved away.
    waiter = Sleeper()
    core.join(OTHER, waiter, 110.0)
    core.outgoing()
    core.feed(push(b"unsubscribe", CHANNEL, 0) + push(b"subscribe", OTHER, 1))
    assert core.subscribed(OTHER) is waiter.entry


def test_a_channel_still_being_subscribed_does_not_linger_out() -> None:
    core = serving()
    waiter = Sleeper()
    core.join(CHANNEL, waiter, 0.0)
    core.outgoing()
    core.leave(waiter, False, 0.0)
    assert core.sweep(LINGER_S * 10) == b""  # unconfirmed: its reply is still due


def test_a_refused_unsubscribe_is_said_at_debug(caplog: pytest.LogCaptureFixture) -> None:
    core = serving()
    [first, second] = joined(core)
    core.leave(first, True, 0.0)
    core.leave(second, True, 0.0)
    core.sweep(LINGER_S)
    caplog.set_level(logging.DEBUG, logger="hotlock")
    core.feed(b"-NOPERM no\r\n")
    assert core.off is None
    said = [(r.levelno, r.getMessage()) for r in caplog.records]
    assert said == [(logging.DEBUG, "wake-ups: UNSUBSCRIBE refused by redis://h:1/0: NOPERM no")]


# -- the waiting side ---------------------------------------------------------------------


def test_a_wake_a_leaving_waiter_did_not_use_goes_to_the_next() -> None:
    core = serving()
    first, second = joined(core)
    core.feed(push(b"message", CHANNEL, b""))
    core.leave(first, False, 0.0)  # woken, then gave up (its deadline, a cancellation)
    assert first.entry is None
    assert second.wakes == 1
    entry = second.entry
    assert entry is not None and entry.waiters == [second]


def test_a_wake_an_acquiring_waiter_took_is_not_passed_on() -> None:
    core = serving()
    first, second = joined(core)
    core.feed(push(b"message", CHANNEL, b""))
    core.leave(first, True, 0.0)
    assert second.wakes == 0
    core.leave(first, True, 0.0)  # a second leave is nothing
    assert second.entry is not None and second.entry.waiters == [second]


def test_the_last_waiter_to_leave_starts_the_linger() -> None:
    core = serving()
    first, second = joined(core, now=1.0)
    entry = first.entry
    assert entry is not None and entry.idle_since == 1.0
    core.leave(first, True, 2.0)
    assert entry.idle_since == 1.0
    core.leave(second, True, 3.0)
    assert entry.idle_since == 3.0


# -- a lost connection --------------------------------------------------------------------


def test_a_lost_connection_wakes_every_waiter_and_subscribes_all_again() -> None:
    core = serving()
    first, second = joined(core)
    lingering = Sleeper()
    core.join(OTHER, lingering, 0.0)
    core.outgoing()
    core.feed(push(b"subscribe", OTHER, 2))
    core.leave(lingering, True, 0.0)
    entry = first.entry
    assert entry is not None
    seq = entry.seq
    core.lost()
    assert not entry.confirmed and entry.seq == seq + 1
    assert (first.wakes, second.wakes) == (2, 1)  # every waiter: a release may have gone unheard
    assert core.subscribed(CHANNEL) is None
    # Joins while disconnected wait for the next connection, which subscribes every entry,
    # the lingering one too.
    assert core.join(b"hotlock:wake:{n}", Sleeper(), 0.0)
    core.connecting([SETINFO], [None])
    core.serving(1.0)
    assert core.outgoing() == b"".join(resp_command(b"SUBSCRIBE", ch) for ch in (CHANNEL, OTHER, b"hotlock:wake:{n}"))
    core.feed(b"+OK\r\n" + push(b"subscribe", CHANNEL, 1))  # the skipped handshake reply first
    assert core.subscribed(CHANNEL) is entry and entry.seq == seq + 2


def test_failed_connects_are_paced_from_50_ms_doubling_to_a_second() -> None:
    trouble = ConnectTrouble("redis://h:1/0")
    assert [trouble.failed(ConnectionRefusedError()) for _ in range(7)] == [0.05, 0.1, 0.2, 0.4, 0.8, 1.0, 1.0]
    trouble.connected()
    assert trouble.failed(Refused("AUTH refused: WRONGPASS")) == 0.05
