"""The wake-up subscriber's protocol without I/O: what it sends, what each reply means, whom it wakes.

``Subscriber`` holds it once for both drivers, hotlock.backends.wakeup.Wakeups (a thread
on a blocking socket) and hotlock.backends.wakeup_async.AsyncWakeups (a task on the
cache's loop); their design is the sync module's docstring. It owns the channel entries,
the commands sent whose replies are due and the connection's parser (hiredis's Reader);
it opens no socket, starts no thread, sleeps never and reads no clock: a driver hands it
the bytes it read and the time, and writes out the bytes it returns. It is not
thread-safe: the sync driver makes every call that changes it under its one lock.

A connection's life, as a driver meets it::

    connecting(commands, names) -> the handshake's bytes; then feed() what is read while
                                   ``greeting`` (Refused when the server refuses one)
    serving(now)                -> from now on every entry is to be subscribed again
    outgoing()                  -> the SUBSCRIBEs due (for the joins since the last call)
    feed(data)                  -> messages wake waiters; ``off`` is set if the server refused
                                   a SUBSCRIBE (then the driver stops)
    due(now), sweep(now)        -> every TICK_S, the UNSUBSCRIBEs of the channels idle LINGER_S
    lost()                      -> the connection is gone: every waiter tries now

and from the waiting side, at any time: subscribed(channel), join(channel, waiter, now),
leave(waiter, acquired, now). Between connections, ConnectTrouble paces the next try and
says what failed.
"""

from __future__ import annotations

import collections
import logging
from collections.abc import Sequence
from typing import Any, Generic, Protocol, TypeVar

__all__ = [
    "LINGER_S",
    "TICK_S",
    "UNREAD",
    "ConnectTrouble",
    "Entry",
    "Refused",
    "Sleeper",
    "Subscriber",
    "Unread",
    "refused",
    "resp_command",
]

log = logging.getLogger("hotlock")

# How long a key's subscription outlives its last waiter: a hot key is subscribed once, not
# once per wait; a key nobody waits on any more is unsubscribed within LINGER_S + TICK_S.
LINGER_S = 5.0
# How often a driver sweeps the lingering subscriptions (and, under Sentinel, asks whether
# the primary changed): its longest wait for the connection's bytes.
TICK_S = 0.5
# The pause before a subscriber's next connect after a failed one, doubling between these.
_FIRST_RETRY_S = 0.05
_LAST_RETRY_S = 1.0
# An error to a SUBSCRIBE that means the channel's slot is not (or not yet) this node's.
_ELSEWHERE = ("MOVED", "ASK", "TRYAGAIN", "CLUSTERDOWN")


class Sleeper(Protocol):
    """What the core needs of a waiter: hotlock.backends.wakeup.Waiter (an fd) and
    hotlock.backends.wakeup_async.AsyncWaiter (an asyncio.Event) have it."""

    entry: Entry[Any] | None  # the channel it waits on, set by join, cleared by leave

    def wake(self) -> None:
        """Wake it (a wake already pending is enough)."""

    def drain(self) -> bool:
        """Take a pending wake; True if there was one."""


W = TypeVar("W", bound=Sleeper)


class Entry(Generic[W]):
    """One channel: its subscription's state and the waiters of this process on it."""

    __slots__ = ("channel", "confirmed", "idle_since", "seq", "waiters")

    def __init__(self, channel: bytes, now: float) -> None:
        self.channel = channel
        # Messages received (and resubscriptions): a waiter compares it with the count read
        # as its attempt was sent, to tell whether a release came meanwhile.
        self.seq = 0
        self.waiters: list[W] = []  # in the order they came: [0] is woken first
        self.confirmed = False
        self.idle_since = now


def resp_command(*args: bytes) -> bytes:
    return b"*%d\r\n" % len(args) + b"".join(b"$%d\r\n%s\r\n" % (len(a), a) for a in args)


class Unread:
    """In the queue of replies due: one to a handshake command sent without waiting
    (CLIENT SETINFO), skipped as it comes, whatever it is."""


UNREAD = Unread()


class Refused(ConnectionError):
    """The server refused the subscriber's handshake (AUTH, CLIENT SETNAME): the next try
    meets the same answer until the server or the url changes."""


def refused(exc: BaseException) -> bool:
    """Whether a subscriber's failed connect will fail the same way until something is
    changed: a handshake the server refused, a certificate that does not verify, a TLS
    alert. A refused or reset TCP connect, a timeout, a TLS stream cut short: passing."""
    import ssl

    if isinstance(exc, Refused):
        return True
    return isinstance(exc, ssl.SSLError) and not isinstance(exc, ssl.SSLEOFError | ssl.SSLZeroReturnError)


class ConnectTrouble:
    """How a subscriber's failed connects are paced and logged. It tries again after 50 ms,
    then twice as long each time up to a second, for as long as the cache lives, so a
    refusal (a wrong password, a certificate that does not verify) is said at WARNING once
    per distinct error and at DEBUG while it repeats; passing failures (the server
    restarting) at DEBUG; a connect that succeeds after a WARNING is said at INFO."""

    __slots__ = ("_delay", "_server", "_warned")

    def __init__(self, server: str) -> None:
        self._server = server
        self._warned: str | None = None  # the text of the last refusal said at WARNING
        self._delay = _FIRST_RETRY_S

    def failed(self, exc: BaseException) -> float:
        """Say it; how long to wait before the next try."""
        delay, self._delay = self._delay, min(self._delay * 2, _LAST_RETRY_S)
        text = str(exc) or type(exc).__name__
        if refused(exc) and text != self._warned:
            self._warned = text
            log.warning(
                "wake-ups: cannot connect to %s: %s; lock_wait polls with backoff meanwhile, "
                "and the subscriber keeps trying (said again only if the error changes)",
                self._server,
                text,
            )
        else:
            log.debug("wake-ups: cannot connect to %s: %s", self._server, text)
        return delay

    def connected(self) -> None:
        self._delay = _FIRST_RETRY_S
        if self._warned is not None:
            self._warned = None
            log.info("wake-ups: connected to %s again", self._server)


class Subscriber(Generic[W]):
    """One subscriber's protocol (see the module docstring). ``server`` names it in the log;
    ``sharded``: on a Redis Cluster node, sharded pub/sub (SSUBSCRIBE, the releases'
    SPUBLISH)."""

    def __init__(self, server: str, sharded: bool = False) -> None:
        self.off: str | None = None  # why the server turned wake-ups off, once it has
        self.entries: dict[bytes, Entry[W]] = {}
        self._server = server
        self._sub, self._unsub = (b"SSUBSCRIBE", b"SUNSUBSCRIBE") if sharded else (b"SUBSCRIBE", b"UNSUBSCRIBE")
        self._message, self._unsubscribed = (b"smessage", b"sunsubscribe") if sharded else (b"message", b"unsubscribe")
        self._outbox: list[Entry[W]] = []  # entries whose SUBSCRIBE is to be sent
        # The commands sent whose reply is due, in order: an Entry for a SUBSCRIBE, a channel
        # (bytes) for an UNSUBSCRIBE, UNREAD for a handshake command not waited for. Each has
        # one reply (its push, or an error).
        self._pending: collections.deque[Entry[W] | bytes | Unread] = collections.deque()
        self._reader: Any = None  # the connection's hiredis.Reader
        self._error: type[Exception] = Exception  # hiredis.ReplyError, once imported
        self._names: Sequence[str | None] = ()  # the handshake's, while its replies are read
        self._replies: list[Any] = []
        self._unread = 0  # handshake replies serving() queues to skip
        self._tick_at = 0.0

    # -- the waiting side ---------------------------------------------------------------

    def subscribed(self, channel: bytes) -> Entry[W] | None:
        """The channel's entry when its subscription is confirmed (a waiter may mark at once)."""
        entry = self.entries.get(channel)
        return entry if entry is not None and entry.confirmed else None

    def join(self, channel: bytes, waiter: W, now: float) -> bool:
        """Register ``waiter`` on ``channel``; True when the channel is new, so a SUBSCRIBE
        is now due (outgoing())."""
        entry = self.entries.get(channel)
        new = entry is None
        if entry is None:
            entry = self.entries[channel] = Entry(channel, now)
            self._outbox.append(entry)
        entry.waiters.append(waiter)
        waiter.entry = entry
        return new

    def leave(self, waiter: W, acquired: bool, now: float) -> None:
        """The wait is over. A wake it did not use goes to the next waiter of the key."""
        entry = waiter.entry
        if entry is None:
            return
        waiter.entry = None
        entry.waiters.remove(waiter)
        if not entry.waiters:
            entry.idle_since = now
        if waiter.drain() and not acquired and entry.waiters:
            entry.waiters[0].wake()

    # -- the connection side --------------------------------------------------------------

    @property
    def greeting(self) -> bool:
        """Whether the handshake's replies are still to be read (fed) before serving()."""
        return bool(self._names)

    def connecting(self, commands: Sequence[tuple[bytes, ...]], names: Sequence[str | None]) -> bytes:
        """A new connection: the handshake to send, in one write. ``names[i]`` says how a
        refusal of ``commands[i]`` is reported (AUTH, CLIENT SETNAME: it fails the connect),
        or is None where a refusal is ignored (CLIENT SETINFO)."""
        import hiredis  # here, not at import: the native path never pays for it unless it waits

        self._reader = hiredis.Reader()
        self._error = hiredis.ReplyError
        self._replies = []
        if all(name is None for name in names):
            # Nothing here can be refused: the replies are skipped as they come, ahead of the
            # first SUBSCRIBE's, and the handshake costs no round trip of its own.
            self._names, self._unread = (), len(commands)
        else:
            self._names, self._unread = names, 0
        return b"".join(resp_command(*c) for c in commands)

    def serving(self, now: float) -> None:
        """The handshake is over: every entry is to be subscribed (again, after a
        reconnect), and the first sweep is TICK_S from ``now``."""
        self._pending = collections.deque([UNREAD] * self._unread)
        self._outbox = list(self.entries.values())
        self._tick_at = now + TICK_S

    def outgoing(self) -> bytes:
        """The SUBSCRIBEs due, to send now (b"" for none)."""
        out, self._outbox = self._outbox, []
        self._pending.extend(out)
        return b"".join(resp_command(self._sub, e.channel) for e in out)

    def feed(self, data: bytes) -> None:
        """Bytes read from the connection. While ``greeting``: Refused for a refused
        handshake command. Then each reply is handled, until ``off`` is set."""
        self._reader.feed(data)
        while self.off is None and (reply := self._reader.gets()) is not False:
            if self._names:
                self._replies.append(reply)
                if len(self._replies) == len(self._names):
                    names, self._names = self._names, ()
                    for name, answer in zip(names, self._replies, strict=True):
                        if name is not None and isinstance(answer, self._error):
                            raise Refused(f"{name} refused: {answer}")
            else:
                self._on_reply(reply)

    def wait_s(self, now: float) -> float:
        """How long a driver may wait for bytes before the next due()."""
        return max(0.0, self._tick_at - now)

    def due(self, now: float) -> bool:
        """Whether a sweep is due (every TICK_S); then the next is TICK_S from ``now``."""
        if now < self._tick_at:
            return False
        self._tick_at = now + TICK_S
        return True

    def sweep(self, now: float) -> bytes:
        """Drop the subscriptions nobody waited on for LINGER_S: their UNSUBSCRIBEs, to send
        now (b"" for none)."""
        idle = [
            ch for ch, e in self.entries.items() if e.confirmed and not e.waiters and now - e.idle_since >= LINGER_S
        ]
        for ch in idle:
            del self.entries[ch]
        self._pending.extend(idle)
        return b"".join(resp_command(self._unsub, ch) for ch in idle)

    def lost(self) -> None:
        """The connection is gone: every subscription is to be made again (on the next
        connection, serving()), and every waiter tries now (a release meanwhile may go
        unheard)."""
        for entry in self.entries.values():  # lingering ones too: a hot key stays subscribed
            entry.confirmed = False
            entry.seq += 1
            for waiter in entry.waiters:
                waiter.wake()
        self._outbox = []
        self._pending.clear()
        self._names = ()

    def _on_reply(self, reply: Any) -> None:
        if isinstance(reply, list) and len(reply) >= 2 and reply[0] == self._message:
            entry = self.entries.get(reply[1])
            if entry is not None:
                entry.seq += 1
                if entry.waiters:
                    entry.waiters[0].wake()
            return
        pending = self._pending
        if (
            isinstance(reply, list)
            and len(reply) >= 2
            and reply[0] == self._unsubscribed
            and not (pending and pending[0] == reply[1])
        ):
            # An unsubscription we did not ask for: the slot moved to another node (sharded
            # pub/sub). Its waiters try now and poll; the next wait on it joins the new owner.
            self._forget(reply[1])
            return
        # Otherwise the reply to the oldest command sent.
        sent = pending.popleft() if pending else None
        if sent is UNREAD:
            return
        if isinstance(reply, self._error):
            if isinstance(sent, Entry) and str(reply).startswith(_ELSEWHERE):
                # The channel's slot is not (or not yet) this node's: as a moved slot.
                self._forget(sent.channel)
            elif isinstance(sent, Entry):
                # NOPERM from an ACL without +subscribe or the channel, most likely.
                self.off = f"the server refused SUBSCRIBE {sent.channel.decode('utf-8', 'replace')}: {reply}"
                log.warning("wake-ups are off for %s: %s; lock_wait polls with backoff", self._server, self.off)
            else:
                # A refused UNSUBSCRIBE: the channel stays subscribed, its messages unheard.
                log.debug("wake-ups: UNSUBSCRIBE refused by %s: %s", self._server, reply)
        elif isinstance(sent, Entry):
            # From now on no release goes unheard; one before it may have (a reconnect, or
            # the waiters' attempts made while it was on its way): the first waiter tries
            # again now.
            sent.confirmed = True
            sent.seq += 1
            if sent.waiters:
                sent.waiters[0].wake()

    def _forget(self, channel: bytes) -> None:
        entry = self.entries.pop(channel, None)
        if entry is not None:
            entry.confirmed = False
            entry.seq += 1
            for waiter in entry.waiters:
                waiter.wake()
