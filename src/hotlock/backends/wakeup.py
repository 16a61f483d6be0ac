"""Waiters woken by the release (docs/architecture.md): one subscriber connection per sync cache.

A waiting attempt (_scripts.ACQUIRE_WAIT) that finds the key held marks the holder's value
with a trailing ``+``; the release of a marked value publishes on the key's wake-up channel
(``<prefix>wake:{K}``, _keys.wake_channel), and only then: an uncontended release sends
and costs what it did. This module is the receiving end, shared by every thread of one
cache and by both sync backends (the native one sleeps in C on the same file descriptors):

- **One connection, one thread.** The subscriber thread does all of the connection's I/O
  (poll() on its socket and on a control pipe, so it never holds the GIL while it
  waits); a waiting thread that joins a new channel queues its SUBSCRIBE and pokes it.
  What is sent and what each reply means is hotlock._subscriber's (the async subscriber
  shares it): this module only drives it.
- **Poll first, then ask to be woken.** A wait's first attempts (_waiting.POLL_FIRST) are plain
  polling (many contended waits end after the first short sleep, and a wake-up costs
  more than that sleep); then every attempt marks, and a wait whose first marking
  attempt fails joins its key's channel (the steps are hotlock._waiting's).
- **Subscribe, then try.** join() never blocks. A wait joins once its first marking
  attempt has failed: a release between that attempt and the join shows in the channel's
  message count (``Entry.seq``, read as the attempt was sent), and the wait tries again at
  once; on a channel still being subscribed it sleeps on its backoff, and the server's
  confirmation wakes the channel's first waiter, which tries again, so a release before
  the subscription cannot go unheard past that. A subscription outlives its last waiter
  by LINGER_S (hotlock._subscriber), so a hot key pays the SUBSCRIBE round trip once.
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

from .._config import ServerConfig, command_name, keepalive, naming_commands, naming_optional, tls_context
from .._credentials import auth_command
from .._hubs import Hub, Made, PerNode, current_pid
from .._scripts import Script
from .._subscriber import ConnectTrouble, Entry, Refused
from .._waiting import FIRST, Joining, Step, Waiting, poll

__all__ = [
    "ClusterWakeups",
    "ConnectTrouble",
    "Refused",
    "Slot",
    "Waiter",
    "Wakeups",
    "cluster_slot",
    "handshake",
    "slot",
    "wait",
]

log = logging.getLogger("hotlock")

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
        self.entry: Entry[Waiter] | None = None
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


def handshake(config: ServerConfig, auth: tuple[bytes, ...] | None) -> tuple[list[tuple[bytes, ...]], list[str | None]]:
    """What a subscriber sends on connecting, in one write: ``auth`` (the AUTH command of
    hotlock._credentials, or None), then the connection's name (_config.naming_commands).
    No SELECT: pub/sub channels are not per database. With each command, how its refusal
    is reported, or None where a refusal is ignored (CLIENT SETINFO): what
    Subscriber.connecting takes."""
    commands = ([] if auth is None else [auth]) + naming_commands(config)
    return commands, [None if naming_optional(c) else command_name(c) for c in commands]


class Wakeups(Hub[Waiter]):
    """The subscriber of one cache (see the module docstring). Made by a backend on the
    first lock_wait that finds its key held; ``off`` tells why wake-ups stopped, if they did."""

    def __init__(self, config: ServerConfig, sharded: bool = False) -> None:
        super().__init__(config, sharded)
        # The protocol's state (_core) is shared by the waiting threads and the subscriber
        # thread: every call to it is made under _lock.
        self._lock = threading.Lock()
        self._local = threading.local()
        self._ctl_r, self._ctl_w = os.pipe()
        os.set_blocking(self._ctl_r, False)
        os.set_blocking(self._ctl_w, False)
        self._thread = threading.Thread(target=self._run, name="hotlock-wakeups", daemon=True)
        self._thread.start()

    # -- the waiting side (any thread) --------------------------------------------------

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
            if self._core.join(channel, waiter, time.monotonic()):
                self._poke()  # the subscriber thread sends the SUBSCRIBE
            waiter.owner = self
        return waiter

    def leave(self, waiter: Waiter, acquired: bool) -> None:
        """The wait is over. A wake it did not use goes to the next waiter of the key."""
        with self._lock:
            self._core.leave(waiter, acquired, time.monotonic())

    def close(self) -> None:
        self._closed = True
        self._poke()

    def _poke(self) -> None:
        with contextlib.suppress(BlockingIOError, OSError):
            os.write(self._ctl_w, b"x")

    # -- the subscriber thread ------------------------------------------------------------

    def _run(self) -> None:
        import hiredis  # here, not at import: the native path never pays for it unless it waits

        trouble = ConnectTrouble(self._server)
        while not self._closed and self.off is None:
            try:
                sock, close = self._connect()
            except Exception as exc:  # OSError, a refused handshake: try again
                self._nap(trouble.failed(exc))
                continue
            trouble.connected()
            try:
                self._serve(sock)
            except (OSError, hiredis.ProtocolError) as exc:
                log.debug("wake-ups: connection to %s lost: %s", self._server, exc)
            finally:
                with contextlib.suppress(Exception):
                    close()
                with self._lock:
                    self._core.lost()
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
            hello = handshake(config, auth_command(config))
            with self._lock:
                data = self._core.connecting(*hello)
            sock.sendall(data)
            while self._core.greeting:  # only this thread feeds the core: read without the lock
                data = sock.recv(65536)
                if not data:
                    raise ConnectionError("the server closed the connection during the handshake")
                with self._lock:
                    self._core.feed(data)
        except BaseException:
            sock.close()
            raise
        return sock, sock.close

    def _serve(self, sock: socket.socket) -> None:
        core = self._core
        with self._lock:
            core.serving(time.monotonic())
        tls = hasattr(sock, "pending")
        while not self._closed:
            with self._lock:
                out = core.outgoing()
            if out:
                sock.sendall(out)
            ready: set[int]
            if tls and sock.pending():  # type: ignore[attr-defined]
                ready = {sock.fileno()}
            else:
                ready = readable([sock.fileno(), self._ctl_r], core.wait_s(time.monotonic()))
            if self._ctl_r in ready:
                self._drain_ctl()
            if sock.fileno() in ready:
                data = sock.recv(65536)
                if not data:
                    raise ConnectionError("the server closed the connection")
                with self._lock:
                    core.feed(data)
                if self._stopped():
                    return
            now = time.monotonic()
            if core.due(now):
                if self._watch is not None and self._watch.refresh() != self._epoch:
                    raise ConnectionError("the sentinels name another primary")
                with self._lock:
                    out = core.sweep(now)
                if out:
                    sock.sendall(out)


_slot_lock = threading.Lock()


def _reinit_after_fork() -> None:
    # A lock another thread held at the fork stays held in the child: make a new one.
    global _slot_lock
    _slot_lock = threading.Lock()


os.register_at_fork(after_in_child=_reinit_after_fork)


class Slot(Made[Wakeups]):
    """A sync backend's subscriber (hotlock._hubs.Made), made under a lock: two threads'
    first waits make one."""

    __slots__ = ()

    def _made(self) -> Wakeups:
        with _slot_lock:
            hub = self._hub
            if hub is None or hub.pid != current_pid():
                hub = super()._made()
        return hub

    def close(self) -> None:
        # Under the lock: a get() racing this close must not store a hub nobody closes.
        with _slot_lock:
            hub = self._taken()
        if hub is not None:
            hub.close()

    def __del__(self) -> None:
        # A backend dropped without close(): its subscriber thread stops too (the thread
        # holds the hub, not the slot, so the slot can go). Quietly at interpreter exit.
        with contextlib.suppress(Exception):
            self.close()


def slot(config: ServerConfig) -> Slot | None:
    """A backend's Slot, or None under connect(wakeups=False)."""
    return Slot(lambda: Wakeups(config)) if config.wakeups else None


class ClusterWakeups(PerNode[Wakeups, Waiter], Wakeups):
    """A Redis Cluster's subscribers (hotlock._hubs.PerNode): one sharded-pub/sub connection
    per primary, each with its own thread; none of its own."""

    def __init__(self, config: ServerConfig, owner: Callable[[bytes], tuple[str, int] | None]) -> None:
        PerNode.__init__(self, owner, lambda address: Wakeups(config.node(*address), sharded=True))

    def leave(self, waiter: Waiter, acquired: bool) -> None:
        if waiter.owner is not None:
            waiter.owner.leave(waiter, acquired)

    def close(self) -> None:
        for hub in self._closing():
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
        return poll(acquire, wait_ms)
    sent = time.monotonic()
    result = acquire(FIRST)
    if result > 0:
        return result, sent, 1  # uncontended: no machine made, nothing more to do
    machine = Waiting(key, wait_ms, sent, time.monotonic, random.random)
    joining: Joining[Waiter] = Joining(slot)
    acquired = False
    step = machine.failed(result)
    try:
        while True:
            step = joining.through(machine, step)
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
                assert joining.waiter is not None
                joining.waiter.sleep(machine.sleep_s)
                step = machine.slept()
            else:
                return result, sent, machine.failures
    finally:
        joining.leave(acquired)
