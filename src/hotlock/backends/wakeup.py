"""Waiters woken by the release (docs/architecture.md): one subscriber connection per sync cache.

A waiting attempt (_scripts.ACQUIRE_WAIT) that finds the key held marks the holder's value
with a trailing ``+``; the release of a marked value publishes on the key's wake-up channel
(``<prefix>wake:{K}``, _keys.wake_channel), and only then: an uncontended release sends
and costs what it did. This module is the receiving end, shared by every thread of one
cache and by both sync backends (the native one sleeps in C on the same file descriptors):

- **One connection, one thread.** The subscriber thread does all of the connection's I/O
  (poll() on its socket and on a control pipe, so it never holds the GIL while it
  waits); waiting threads hand it SUBSCRIBE requests through ``_outbox``.
- **Poll first, then ask to be woken.** A wait's first attempts (_waiting.POLL_FIRST) are plain
  polling (many contended waits end after the first short sleep, and a wake-up costs
  more than that sleep); then every attempt marks, and a wait whose first marking
  attempt fails joins its key's channel (the steps are hotlock._waiting's).
- **Subscribe, then try.** join() never blocks. A wait joins once its first marking
  attempt has failed: a release between that attempt and the join shows in the channel's
  message count (``Entry.seq``, read as the attempt was sent), and the wait tries again at
  once; on a channel still being subscribed it sleeps on its backoff, and the server's
  confirmation wakes the channel's first waiter, which tries again, so a release before
  the subscription cannot go unheard past that. A subscription
  outlives its last waiter by LINGER_S, so a hot key pays the SUBSCRIBE round trip once.
- **One wake per message per process.** A message wakes the longest-waiting local waiter
  of its key (``Entry.waiters[0]``), not all of them: the others stay asleep on their
  backoff. A waiter that acquires while others of its process still wait on the key takes
  it with ACQUIRE_CHAIN, which marks the new value at once, so its own release wakes the
  next one. Every message also bumps ``Entry.seq``: a waiter whose attempt was in flight
  when a message came retries at once instead of sleeping.
- **The backoff stays the safety net.** A lost message (dropped, the subscriber
  reconnecting) costs a waiter at most its backoff cap. After a reconnect every channel is
  subscribed again and its first waiter woken, since releases may have gone unheard.
- **Degrades to polling.** An ACL that refuses SUBSCRIBE or the channel turns wake-ups off
  for this cache (said once, WARNING); lock_wait then polls as before. A forked child never
  touches its parent's subscriber: the backends make a new one when the pid changes.
"""

from __future__ import annotations

import collections
import contextlib
import logging
import os
import random
import select
import socket
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

from .._config import ServerConfig, command_name, keepalive, naming_commands, naming_optional, tls_context
from .._credentials import auth_command
from .._scripts import ACQUIRE, Script
from .._sentinel import PrimaryWatch
from .._waiting import FIRST, Step, Waiting, poll

__all__ = [
    "LINGER_S",
    "UNREAD",
    "ClusterWakeups",
    "ConnectTrouble",
    "Entry",
    "Refused",
    "Slot",
    "Unread",
    "Waiter",
    "Wakeups",
    "cluster_slot",
    "handshake",
    "refused",
    "slot",
    "wait",
]

log = logging.getLogger("hotlock")

# How long a key's subscription outlives its last waiter: a hot key is subscribed once, not
# once per wait; a key nobody waits on any more is unsubscribed within LINGER_S + TICK_S.
LINGER_S = 5.0
# The subscriber thread's longest sleep: how often it looks for lingering subscriptions
# to drop and for close().
TICK_S = 0.5
_ONE = (1).to_bytes(8, sys.byteorder)  # an eventfd takes an 8-byte counter


def readable(fds: list[int], seconds: float) -> set[int]:
    """Which of ``fds`` are readable (or hung up) within ``seconds``, the GIL released.
    poll(), not select(): select() refuses a file number of 1024 or more, which any
    process with that many files open (a busy server's sockets) hands out."""
    poller = select.poll()
    for fd in fds:
        poller.register(fd, select.POLLIN)
    return {fd for fd, _ in poller.poll(max(0.0, seconds) * 1000.0)}


class Waiter:
    """One thread's wake-up file descriptor, reused for each of its waits: the subscriber
    writes it, the wait loop sleeps in poll() on it (the GIL released)."""

    __slots__ = ("_wfd", "entry", "fd", "owner", "pid")

    def __init__(self) -> None:
        if hasattr(os, "eventfd"):
            self.fd = self._wfd = os.eventfd(0, os.EFD_NONBLOCK | os.EFD_CLOEXEC)
        else:  # no eventfd (not Linux): a pipe works the same for poll()
            self.fd, self._wfd = os.pipe()
            os.set_blocking(self.fd, False)
            os.set_blocking(self._wfd, False)
        self.pid = os.getpid()
        self.entry: Entry | None = None
        self.owner: Wakeups | None = None  # the subscriber it is registered with (a cluster has several)

    def wake(self) -> None:
        with contextlib.suppress(BlockingIOError):  # a wake already pending is enough
            os.write(self._wfd, _ONE)

    def drain(self) -> bool:
        """Take a pending wake; True if there was one."""
        try:
            return bool(os.read(self.fd, 64))
        except BlockingIOError:
            return False

    def sleep(self, seconds: float) -> None:
        """Sleep up to ``seconds``, less if woken (the pure-Python loop's; the native one polls in C)."""
        if readable([self.fd], seconds):
            self.drain()

    def __del__(self) -> None:
        with contextlib.suppress(OSError, AttributeError):
            os.close(self.fd)
            if self._wfd != self.fd:
                os.close(self._wfd)


class Entry:
    """One channel: its subscription's state and the waiters of this process on it."""

    __slots__ = ("channel", "confirmed", "idle_since", "seq", "waiters")

    def __init__(self, channel: bytes) -> None:
        self.channel = channel
        self.seq = 0  # messages received (and resubscriptions): see the module docstring
        self.waiters: list[Waiter] = []  # in the order they came: [0] is woken first
        self.confirmed = False
        self.idle_since = time.monotonic()


def resp_command(*args: bytes) -> bytes:
    return b"*%d\r\n" % len(args) + b"".join(b"$%d\r\n%s\r\n" % (len(a), a) for a in args)


class Unread:
    """In a subscriber's queue of replies due: one to a handshake command sent without
    waiting (CLIENT SETINFO), skipped as it comes, whatever it is."""


UNREAD = Unread()


class Refused(ConnectionError):
    """The server refused the subscriber's handshake (AUTH, CLIENT SETNAME): the next try
    meets the same answer until the server or the url changes."""


def handshake(config: ServerConfig, auth: tuple[bytes, ...] | None) -> list[tuple[bytes, ...]]:
    """What a subscriber sends on connecting, in one write: ``auth`` (the AUTH command of
    hotlock._credentials, or None), then the connection's name (_config.naming_commands).
    No SELECT: pub/sub channels are not per database."""
    return ([] if auth is None else [auth]) + naming_commands(config)


def check_handshake(commands: list[tuple[bytes, ...]], replies: list[Any], error_type: type) -> None:
    """Raise Refused for an error reply to any of ``commands`` but CLIENT SETINFO."""
    for command, reply in zip(commands, replies, strict=True):
        if isinstance(reply, error_type) and not naming_optional(command):
            raise Refused(f"{command_name(command)} refused: {reply}")


def refused(exc: BaseException) -> bool:
    """Whether a subscriber's failed connect will fail the same way until something is
    changed: a handshake the server refused, a certificate that does not verify, a TLS
    alert. A refused or reset TCP connect, a timeout, a TLS stream cut short: passing."""
    import ssl

    if isinstance(exc, Refused):
        return True
    return isinstance(exc, ssl.SSLError) and not isinstance(exc, ssl.SSLEOFError | ssl.SSLZeroReturnError)


class ConnectTrouble:
    """How a subscriber's failed connects are logged. It tries again every second at most,
    for as long as the cache lives, so a refusal (a wrong password, a certificate that
    does not verify) is said at WARNING once per distinct error and at DEBUG while it
    repeats; passing failures (the server restarting) at DEBUG; a connect that succeeds
    after a WARNING is said at INFO."""

    __slots__ = ("_server", "_warned")

    def __init__(self, server: str) -> None:
        self._server = server
        self._warned: str | None = None  # the text of the last refusal said at WARNING

    def failed(self, exc: BaseException) -> None:
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

    def connected(self) -> None:
        if self._warned is not None:
            self._warned = None
            log.info("wake-ups: connected to %s again", self._server)


class Wakeups:
    """The subscriber of one cache (see the module docstring). Made by a backend on the
    first lock_wait that finds its key held; ``off`` tells why wake-ups stopped, if they did."""

    def __init__(self, config: ServerConfig, sharded: bool = False) -> None:
        self.pid = os.getpid()
        self.off: str | None = None
        # On a Redis Cluster node: sharded pub/sub (SSUBSCRIBE, the releases' SPUBLISH).
        self._sub, self._unsub = (b"SSUBSCRIBE", b"SUNSUBSCRIBE") if sharded else (b"SUBSCRIBE", b"UNSUBSCRIBE")
        self._kinds = (b"smessage", b"sunsubscribe") if sharded else (b"message", b"unsubscribe")
        self._config = config
        self._server = config.display
        self._timeout = config.timeout
        self._lock = threading.Lock()
        self._entries: dict[bytes, Entry] = {}
        self._outbox: list[Entry] = []  # entries whose SUBSCRIBE the thread is to send
        self._local = threading.local()
        self._closed = False
        # Under Sentinel: the primary to connect to, and the epoch the connection is of (a
        # failover makes the subscriber reconnect, to the new primary, as the lock connections do).
        self._watch = PrimaryWatch(config.primary) if config.sentinels else None
        self._epoch = 0
        self._unread = 0  # handshake replies the next _serve skips (see _connect)
        self._ctl_r, self._ctl_w = os.pipe()
        os.set_blocking(self._ctl_r, False)
        os.set_blocking(self._ctl_w, False)
        self._thread = threading.Thread(target=self._run, name="hotlock-wakeups", daemon=True)
        self._thread.start()

    # -- the waiting side (any thread) --------------------------------------------------

    def subscribed(self, channel: bytes) -> Entry | None:
        """The channel's entry when its subscription is confirmed (a waiter may mark at once)."""
        entry = self._entries.get(channel)
        return entry if entry is not None and entry.confirmed else None

    def join(self, channel: bytes) -> Waiter | None:
        """Register this thread as a waiter on ``channel``, asking for its subscription if
        there is none. Returns at once: on a channel still being subscribed the server's
        confirmation wakes the channel's first waiter, which then tries again (subscribe,
        then try) without having stood still meanwhile. None when wake-ups are off: the
        caller polls."""
        if self.off is not None or self._closed:
            return None
        waiter = getattr(self._local, "waiter", None)
        if waiter is None:
            waiter = self._local.waiter = Waiter()
        waiter.drain()  # a wake left over from this thread's previous wait
        with self._lock:
            entry = self._entries.get(channel)
            if entry is None:
                entry = self._entries[channel] = Entry(channel)
                self._outbox.append(entry)
                self._poke()
            entry.waiters.append(waiter)
            waiter.entry = entry
            waiter.owner = self
        return waiter

    def leave(self, waiter: Waiter, acquired: bool) -> None:
        """The wait is over. A wake it did not use goes to the next waiter of the key."""
        with self._lock:
            entry = waiter.entry
            if entry is None:
                return
            waiter.entry = None
            entry.waiters.remove(waiter)
            if not entry.waiters:
                entry.idle_since = time.monotonic()
            if waiter.drain() and not acquired and entry.waiters:
                entry.waiters[0].wake()

    def close(self) -> None:
        self._closed = True
        self._poke()

    def _poke(self) -> None:
        with contextlib.suppress(BlockingIOError, OSError):
            os.write(self._ctl_w, b"x")

    # -- the subscriber thread ------------------------------------------------------------

    def _run(self) -> None:
        import hiredis  # here, not at import: the native path never pays for it unless it waits

        delay = 0.05
        trouble = ConnectTrouble(self._server)
        while not self._closed and self.off is None:
            try:
                sock, close = self._connect()
            except Exception as exc:  # OSError, a refused handshake: try again
                trouble.failed(exc)
                self._nap(delay)
                delay = min(delay * 2, 1.0)
                continue
            trouble.connected()
            delay = 0.05
            try:
                self._serve(sock)
            except (OSError, hiredis.ProtocolError) as exc:
                log.debug("wake-ups: connection to %s lost: %s", self._server, exc)
            finally:
                with contextlib.suppress(Exception):
                    close()
                self._lost()
        with contextlib.suppress(OSError):
            os.close(self._ctl_r)
            os.close(self._ctl_w)

    def _nap(self, seconds: float) -> None:
        with contextlib.suppress(OSError):
            readable([self._ctl_r], seconds)
            self._drain_ctl()

    def _drain_ctl(self) -> None:
        with contextlib.suppress(BlockingIOError):
            os.read(self._ctl_r, 4096)

    def _connect(self) -> tuple[socket.socket, Callable[[], object]]:
        """A connected, authenticated and named socket and how to close it, opened here rather than
        by redis-py (the native path must not pay its import on the first contended wait
        of a process). Under Sentinel, to whichever primary the sentinels name now."""
        import hiredis

        config = self._config
        host, port = config.host, config.port
        if self._watch is not None:
            host, port = self._watch.address()
            self._epoch = self._watch.epoch
        sock: socket.socket
        if config.unix_path is not None:
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            sock.settimeout(config.connect_timeout)
            try:
                sock.connect(config.unix_path)
            except BaseException:
                sock.close()
                raise
        else:
            sock = socket.create_connection((host, port), timeout=config.connect_timeout)
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            keepalive(sock)
            if config.tls:
                # The url's TLS settings, checked as the backend's connections check them.
                try:
                    name = config.ssl.server_name or host  # checked and sent as SNI
                    sock = tls_context(config.ssl).wrap_socket(sock, server_hostname=name)
                except BaseException:
                    sock.close()
                    raise
        try:
            sock.settimeout(config.timeout)
            # The url's credentials, or the provider's answer now (hotlock._credentials).
            commands = handshake(config, auth_command(config))
            sock.sendall(b"".join(resp_command(*c) for c in commands))
            self._unread = 0
            if all(naming_optional(c) for c in commands):
                # Nothing here can be refused (a refused CLIENT SETINFO is ignored): the
                # replies are skipped as they come, ahead of the first SUBSCRIBE's, and the
                # handshake costs no round trip of its own.
                self._unread = len(commands)
                return sock, sock.close
            reader = hiredis.Reader()
            replies: list[Any] = []
            while len(replies) < len(commands):
                data = sock.recv(65536)
                if not data:
                    raise ConnectionError("the server closed the connection during the handshake")
                reader.feed(data)
                while len(replies) < len(commands) and (reply := reader.gets()) is not False:
                    replies.append(reply)
            check_handshake(commands, replies, hiredis.ReplyError)
        except BaseException:
            sock.close()
            raise
        return sock, sock.close

    def _serve(self, sock: socket.socket) -> None:
        import hiredis

        reader = hiredis.Reader()
        # The commands sent whose reply is due, in order: an Entry for a SUBSCRIBE, a channel
        # (bytes) for an UNSUBSCRIBE. Each has one reply (its push, or an error).
        pending: collections.deque[Entry | bytes | Unread] = collections.deque([UNREAD] * self._unread)
        with self._lock:
            self._outbox = list(self._entries.values())  # after a reconnect: all of them again
        next_tick = time.monotonic() + TICK_S
        tls = hasattr(sock, "pending")
        while not self._closed:
            with self._lock:
                out, self._outbox = self._outbox, []
            if out:
                pending.extend(out)
                sock.sendall(b"".join(resp_command(self._sub, e.channel) for e in out))
            ready: set[int]
            if tls and sock.pending():  # type: ignore[attr-defined]
                ready = {sock.fileno()}
            else:
                ready = readable([sock.fileno(), self._ctl_r], next_tick - time.monotonic())
            if self._ctl_r in ready:
                self._drain_ctl()
            if sock.fileno() in ready:
                data = sock.recv(65536)
                if not data:
                    raise ConnectionError("the server closed the connection")
                reader.feed(data)
                while (reply := reader.gets()) is not False:
                    if not self._on_reply(reply, pending):
                        return
            now = time.monotonic()
            if now >= next_tick:
                next_tick = now + TICK_S
                if self._watch is not None and self._watch.refresh() != self._epoch:
                    raise ConnectionError("the sentinels name another primary")
                idle = self._idle(now)
                if idle:
                    pending.extend(idle)
                    sock.sendall(b"".join(resp_command(self._unsub, ch) for ch in idle))

    def _on_reply(self, reply: Any, pending: collections.deque[Entry | bytes | Unread]) -> bool:
        """Handle one reply or message; False when wake-ups are now off."""
        import hiredis

        if isinstance(reply, list) and len(reply) >= 2 and reply[0] == self._kinds[0]:
            with self._lock:
                entry = self._entries.get(reply[1])
                if entry is not None:
                    entry.seq += 1
                    if entry.waiters:
                        entry.waiters[0].wake()
            return True
        if (
            isinstance(reply, list)
            and len(reply) >= 2
            and reply[0] == self._kinds[1]
            and not (pending and pending[0] == reply[1])
        ):
            # An unsubscription we did not ask for: the slot moved to another node (sharded
            # pub/sub). Its waiters try now and poll; the next wait on it joins the new owner.
            self._forget(reply[1])
            return True
        # Otherwise the reply to the oldest command sent.
        sent = pending.popleft() if pending else None
        if sent is UNREAD:
            return True
        if isinstance(reply, hiredis.ReplyError):
            if isinstance(sent, Entry) and str(reply).startswith(("MOVED", "ASK", "TRYAGAIN", "CLUSTERDOWN")):
                # The channel's slot is not (or not yet) this node's: as a moved slot.
                self._forget(sent.channel)
            elif isinstance(sent, Entry):
                # NOPERM from an ACL without +subscribe or the channel, most likely.
                self._turn_off(f"the server refused SUBSCRIBE {sent.channel.decode('utf-8', 'replace')}: {reply}")
                return False
            # A refused UNSUBSCRIBE: the channel stays subscribed, its messages unheard.
            log.debug("wake-ups: UNSUBSCRIBE refused by %s: %s", self._server, reply)
        elif isinstance(sent, Entry):
            with self._lock:
                # From now on no release goes unheard; one before it may have (a reconnect,
                # or the waiters' attempts made while it was on its way): the first waiter
                # tries again now.
                sent.confirmed = True
                sent.seq += 1
                if sent.waiters:
                    sent.waiters[0].wake()
        return True

    def _forget(self, channel: bytes) -> None:
        with self._lock:
            entry = self._entries.pop(channel, None)
            if entry is not None:
                entry.confirmed = False
                entry.seq += 1
                for waiter in entry.waiters:
                    waiter.wake()

    def _idle(self, now: float) -> list[bytes]:
        """Drop the subscriptions nobody waited on for LINGER_S; their channels."""
        with self._lock:
            idle = [
                ch
                for ch, e in self._entries.items()
                if e.confirmed and not e.waiters and now - e.idle_since >= LINGER_S
            ]
            for ch in idle:
                del self._entries[ch]
        return idle

    def _lost(self) -> None:
        """The connection is gone: every subscription is to be made again (on the next
        connection), and every waiter tries now (a release meanwhile may go unheard)."""
        with self._lock:
            for entry in self._entries.values():  # lingering ones too: a hot key stays subscribed
                entry.confirmed = False
                entry.seq += 1
                for waiter in entry.waiters:
                    waiter.wake()
            self._outbox = []

    def _turn_off(self, why: str) -> None:
        self.off = why
        log.warning("wake-ups are off for %s: %s; lock_wait polls with backoff", self._server, why)


_slot_lock = threading.Lock()
_pid = os.getpid()  # this process's, kept at fork: Slot.get runs on every contended wait


def _reinit_after_fork() -> None:
    # A lock another thread held at the fork stays held in the child: make a new one.
    global _slot_lock, _pid
    _slot_lock = threading.Lock()
    _pid = os.getpid()


os.register_at_fork(after_in_child=_reinit_after_fork)


def current_pid() -> int:
    """This process's pid, kept at fork (cheaper than os.getpid() on every contended wait)."""
    return _pid


class Slot:
    """A sync backend's subscriber: made on the first wait that needs it, and made anew in
    a forked child (which never uses or closes its parent's)."""

    __slots__ = ("_hub", "_make")

    def __init__(self, make: Callable[[], Wakeups]) -> None:
        self._make = make
        self._hub: Wakeups | None = None

    def get(self) -> Wakeups | None:
        """The live subscriber, made now if need be; None when wake-ups are off."""
        hub = self._hub
        if hub is None or hub.pid != _pid:
            with _slot_lock:
                hub = self._hub
                if hub is None or hub.pid != _pid:
                    hub = self._hub = self._make()
        return hub if hub.off is None else None

    def close(self) -> None:
        # Under the lock: a get() racing this close must not store a hub nobody closes.
        with _slot_lock:
            hub, self._hub = self._hub, None
        if hub is not None and hub.pid == os.getpid():
            hub.close()

    def __del__(self) -> None:
        # A backend dropped without close(): its subscriber thread stops too (the thread
        # holds the hub, not the slot, so the slot can go). Quietly at interpreter exit.
        with contextlib.suppress(Exception):
            self.close()


def slot(config: ServerConfig) -> Slot | None:
    """A backend's Slot, or None under connect(wakeups=False)."""
    return Slot(lambda: Wakeups(config)) if config.wakeups else None


class ClusterWakeups(Wakeups):
    """A Redis Cluster's subscribers: one sharded-pub/sub connection per primary, made when
    a wait first needs it, each channel joined at its slot's owner (``owner(channel)``, the
    cluster backend's slot map). A slot that moves unsubscribes its channel on the old
    node; its waiters then poll, and the next wait on it joins the new owner."""

    def __init__(self, config: ServerConfig, owner: Callable[[bytes], tuple[str, int] | None]) -> None:
        # No thread or connection of its own: only the per-node ones.
        self.pid = os.getpid()
        self.off = None
        self._config = config
        self._owner = owner
        self._nodes: dict[tuple[str, int], Wakeups] = {}
        self._nodes_lock = threading.Lock()
        self._closed = False  # then no node's subscriber is made any more: a waiter polls

    def subscribed(self, channel: bytes) -> Entry | None:
        address = self._owner(channel)
        hub = None if address is None else self._nodes.get(address)
        return None if hub is None else hub.subscribed(channel)

    def join(self, channel: bytes) -> Waiter | None:
        address = self._owner(channel)
        if address is None:
            return None  # no primary for the slot right now: poll
        hub = self._nodes.get(address)
        if hub is None or hub._closed:
            with self._nodes_lock:
                if self._closed:
                    return None  # a wait that raced close(): it polls
                hub = self._nodes.get(address)
                if hub is None or hub._closed:
                    hub = self._nodes[address] = Wakeups(self._config.node(*address), sharded=True)
        if hub.off is not None:
            self.off = hub.off
            return None
        return hub.join(channel)

    def leave(self, waiter: Waiter, acquired: bool) -> None:
        if waiter.owner is not None:
            waiter.owner.leave(waiter, acquired)

    def close(self) -> None:
        with self._nodes_lock:
            self._closed = True
            hubs = list(self._nodes.values())
        for hub in hubs:
            hub.close()


def cluster_slot(config: ServerConfig, owner: Callable[[bytes], tuple[str, int] | None]) -> Slot | None:
    """A cluster backend's Slot (see ClusterWakeups), or None under connect(wakeups=False)."""
    return Slot(lambda: ClusterWakeups(config, owner)) if config.wakeups else None


def wait(slot: Slot | None, key: bytes, acquire: Callable[[Script], int], wait_ms: int) -> tuple[int, float, int]:
    """_backoff.poll with wake-ups: ``acquire(script)`` attempts with ACQUIRE or one of its
    waiting forms until it returns a fence (> 0) or ``wait_ms`` has passed. Returns the last
    result, the time.monotonic() that attempt was sent and the number of attempts. The sync driver of
    hotlock._waiting.Waiting, which decides every step; this function only does them (the
    attempts, the sleeps, the subscriber's start, join and leave).
    NativeBackend.acquire_wait runs the same steps in C."""
    if slot is None:
        return poll(lambda: acquire(ACQUIRE), wait_ms)
    sent = time.monotonic()
    result = acquire(FIRST)
    if result > 0:
        return result, sent, 1  # uncontended: no machine made, nothing more to do
    machine = Waiting(key, wait_ms, sent, time.monotonic, random.random)
    hub: Wakeups | None = None
    waiter: Waiter | None = None
    acquired = False
    step = machine.failed(result)
    try:
        while True:
            if step is Step.ATTEMPT:
                sent = time.monotonic()
                result = acquire(machine.script)
                if result > 0:
                    acquired = True
                    return result, sent, machine.failures + 1
                step = machine.failed(result)
            elif step is Step.SLEEP:
                time.sleep(machine.sleep_s)
                step = machine.slept()
            elif step is Step.WAKEABLE:
                assert waiter is not None
                waiter.sleep(machine.sleep_s)
                step = machine.slept()
            elif step is Step.START:
                hub = slot.get()
                step = machine.started(hub is not None)
            elif step is Step.LOOK:
                assert hub is not None
                step = machine.looked(hub.subscribed(machine.channel))
            elif step is Step.JOIN:
                assert hub is not None
                waiter = hub.join(machine.channel)
                step = machine.joined(None if waiter is None else waiter.entry)
            else:
                return result, sent, machine.failures
    finally:
        if waiter is not None:
            assert hub is not None
            hub.leave(waiter, acquired)
