"""Waiters woken by the release, for the async API: hotlock.backends.wakeup's design on one event
loop (read its docstring first).

One subscriber connection per async cache, read by one task on the cache's loop; waiting
tasks write their SUBSCRIBE on it directly (one thread: no hand-over needed) and sleep on
an asyncio.Event instead of an fd. The rest is the sync design unchanged, with the same
steps (hotlock._waiting.Waiting decides them for both): a wait polls first, then marks
and joins the key's channel if that attempt fails (subscribe, then try); a message wakes
the longest-waiting local waiter; the backoff stays the safety net; an ACL refusing
SUBSCRIBE turns wake-ups off, said once.
On a Redis Cluster, AsyncClusterWakeups keeps one sharded-pub/sub subscriber per primary,
as hotlock.backends.wakeup.ClusterWakeups does for sync.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
import os
import time
from collections.abc import Callable
from typing import Any

from .._config import ServerConfig, keepalive, naming_optional, tls_context
from .._credentials import auth_command_async
from .._sentinel import PrimaryWatch
from ..errors import CacheError
from .retry_async import within
from .wakeup import (
    LINGER_S,
    TICK_S,
    UNREAD,
    ConnectTrouble,
    Unread,
    check_handshake,
    current_pid,
    handshake,
    resp_command,
)

__all__ = [
    "AsyncClusterWakeups",
    "AsyncEntry",
    "AsyncSlot",
    "AsyncWaiter",
    "AsyncWakeups",
    "async_cluster_slot",
    "async_slot",
]

log = logging.getLogger("hotlock")


class AsyncWaiter:
    """One waiting task: the subscriber sets its event."""

    __slots__ = ("entry", "event", "owner")

    def __init__(self, entry: AsyncEntry, owner: AsyncWakeups) -> None:
        self.entry: AsyncEntry | None = entry
        self.event = asyncio.Event()
        self.owner = owner  # the subscriber it is registered with (a cluster has several)

    def wake(self) -> None:
        self.event.set()

    async def sleep(self, seconds: float) -> None:
        """Sleep up to ``seconds``, less if woken; a cancellation always propagates.

        A timer sets the event at the end of the sleep: asyncio.wait_for, up to Python
        3.11, drops a cancellation that lands in the loop turn the wake comes in, and the
        cancelled wait would run on to its deadline.
        """
        event = self.event
        if not event.is_set():
            timer = asyncio.get_running_loop().call_later(seconds, event.set)
            try:
                await event.wait()
            finally:
                timer.cancel()
        event.clear()


class AsyncEntry:
    __slots__ = ("channel", "confirmed", "idle_since", "seq", "waiters")

    def __init__(self, channel: bytes) -> None:
        self.channel = channel
        self.seq = 0
        self.waiters: list[AsyncWaiter] = []
        self.confirmed = False
        self.idle_since = time.monotonic()


class AsyncWakeups:
    """The subscriber of one async cache, on the loop it was made in."""

    def __init__(self, config: ServerConfig, sharded: bool = False) -> None:
        self.pid = os.getpid()
        self.off: str | None = None
        # On a Redis Cluster node: sharded pub/sub (SSUBSCRIBE, the releases' SPUBLISH).
        self._sub, self._unsub = (b"SSUBSCRIBE", b"SUNSUBSCRIBE") if sharded else (b"SUBSCRIBE", b"UNSUBSCRIBE")
        self._kinds = (b"smessage", b"sunsubscribe") if sharded else (b"message", b"unsubscribe")
        self._config = config
        self._server = config.display
        self._entries: dict[bytes, AsyncEntry] = {}
        self._writer: asyncio.StreamWriter | None = None
        self._pending: collections.deque[AsyncEntry | bytes | Unread] = collections.deque()
        self._unread = 0  # handshake replies the next _serve skips (see _connect)
        self._closed = False
        # Under Sentinel, as in sync: reconnect to the new primary after a failover.
        self._watch = PrimaryWatch(config.primary) if config.sentinels else None
        self._epoch = 0
        self._task = asyncio.get_running_loop().create_task(self._run())

    # -- the waiting side -------------------------------------------------------------

    def subscribed(self, channel: bytes) -> AsyncEntry | None:
        entry = self._entries.get(channel)
        return entry if entry is not None and entry.confirmed else None

    def join(self, channel: bytes) -> AsyncWaiter | None:
        """As hotlock.backends.wakeup.Wakeups.join: returns at once."""
        if self.off is not None or self._closed:
            return None
        entry = self._entries.get(channel)
        if entry is None:
            entry = self._entries[channel] = AsyncEntry(channel)
            self._subscribe(entry)
        waiter = AsyncWaiter(entry, self)
        entry.waiters.append(waiter)
        return waiter

    def leave(self, waiter: AsyncWaiter, acquired: bool) -> None:
        entry = waiter.entry
        if entry is None:
            return
        waiter.entry = None
        entry.waiters.remove(waiter)
        if not entry.waiters:
            entry.idle_since = time.monotonic()
        if waiter.event.is_set() and not acquired and entry.waiters:
            entry.waiters[0].wake()  # a wake it did not use goes to the next waiter

    async def close(self) -> None:
        self._closed = True
        self._task.cancel()
        with contextlib.suppress(asyncio.CancelledError, Exception):
            await self._task

    def _subscribe(self, entry: AsyncEntry) -> None:
        # Not connected: the next connection subscribes every entry.
        if self._writer is not None and not self._writer.is_closing():
            self._pending.append(entry)
            self._writer.write(resp_command(self._sub, entry.channel))

    # -- the subscriber task --------------------------------------------------------------

    async def _run(self) -> None:
        delay = 0.05
        trouble = ConnectTrouble(self._server)
        while not self._closed and self.off is None:
            try:
                reader, writer = await within(self._connect(), self._config.connect_timeout + self._config.timeout)
            except (
                OSError,
                TimeoutError,
                ConnectionError,
                CacheError,
            ) as exc:  # a refused handshake, a failed credential provider: try again
                trouble.failed(exc)
                await asyncio.sleep(delay)
                delay = min(delay * 2, 1.0)
                continue
            trouble.connected()
            delay = 0.05
            try:
                await self._serve(reader, writer)
            except (OSError, ConnectionError, asyncio.IncompleteReadError) as exc:
                log.debug("wake-ups: connection to %s lost: %s", self._server, exc)
            finally:
                self._writer = None
                writer.close()
                self._lost()

    async def _connect(self) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
        import hiredis

        config = self._config
        if config.unix_path is not None:
            reader, writer = await asyncio.open_unix_connection(config.unix_path)
        else:
            host, port = config.host, config.port
            if self._watch is not None:
                # The sentinels' answer is a blocking lookup: off the loop.
                host, port = await asyncio.get_running_loop().run_in_executor(None, self._watch.address)
                self._epoch = self._watch.epoch
            # The url's TLS settings, checked as the backend's connections check them.
            tls = tls_context(config.ssl) if config.tls else None
            name = (config.ssl.server_name or host) if tls else None  # checked and sent as SNI
            reader, writer = await asyncio.open_connection(host, port, ssl=tls, server_hostname=name)
            keepalive(writer.get_extra_info("socket"))
        # The url's credentials, or the provider's answer now (hotlock._credentials).
        try:
            auth = await auth_command_async(config)
        except BaseException:
            writer.close()
            raise
        commands = handshake(config, auth)
        try:
            writer.write(b"".join(resp_command(*c) for c in commands))
            self._unread = 0
            if all(naming_optional(c) for c in commands):
                # As in sync: nothing here can be refused; _serve skips the replies.
                self._unread = len(commands)
                return reader, writer
            parse = hiredis.Reader()
            replies: list[Any] = []
            while len(replies) < len(commands):
                data = await within(reader.read(65536), config.timeout)
                if not data:
                    raise ConnectionError("the server closed the connection during the handshake")
                parse.feed(data)
                while len(replies) < len(commands) and (reply := parse.gets()) is not False:
                    replies.append(reply)
            check_handshake(commands, replies, hiredis.ReplyError)
        except BaseException:
            writer.close()
            raise
        return reader, writer

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        import hiredis

        parse = hiredis.Reader()
        self._pending.clear()
        self._pending.extend([UNREAD] * self._unread)
        self._writer = writer
        for entry in self._entries.values():  # after a reconnect: all of them again
            self._subscribe(entry)
        next_tick = time.monotonic() + TICK_S
        while not self._closed:
            try:
                data = await within(reader.read(65536), max(0.0, next_tick - time.monotonic()))
            except TimeoutError:
                data = None
            if data is not None:
                if not data:
                    raise ConnectionError("the server closed the connection")
                parse.feed(data)
                while (reply := parse.gets()) is not False:
                    if not self._on_reply(reply, hiredis.ReplyError):
                        return
            now = time.monotonic()
            if now >= next_tick:
                next_tick = now + TICK_S
                if self._watch is not None and self._watch.due():
                    epoch = await asyncio.get_running_loop().run_in_executor(None, self._watch.refresh)
                    if epoch != self._epoch:
                        raise ConnectionError("the sentinels name another primary")
                idle = [
                    ch
                    for ch, e in self._entries.items()
                    if e.confirmed and not e.waiters and now - e.idle_since >= LINGER_S
                ]
                for ch in idle:
                    del self._entries[ch]
                    self._pending.append(ch)
                    writer.write(resp_command(self._unsub, ch))

    def _on_reply(self, reply: Any, error_type: type[Exception]) -> bool:
        if isinstance(reply, list) and len(reply) >= 2 and reply[0] == self._kinds[0]:
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
            and not (self._pending and self._pending[0] == reply[1])
        ):
            # An unsubscription we did not ask for: the slot moved (sharded pub/sub), as in sync.
            self._forget(reply[1])
            return True
        sent = self._pending.popleft() if self._pending else None
        if sent is UNREAD:
            return True
        if isinstance(reply, error_type):
            if isinstance(sent, AsyncEntry) and str(reply).startswith(("MOVED", "ASK", "TRYAGAIN", "CLUSTERDOWN")):
                self._forget(sent.channel)  # the channel's slot is not (or not yet) this node's
            elif isinstance(sent, AsyncEntry):
                self._turn_off(f"the server refused SUBSCRIBE {sent.channel.decode('utf-8', 'replace')}: {reply}")
                return False
            log.debug("wake-ups: UNSUBSCRIBE refused by %s: %s", self._server, reply)
        elif isinstance(sent, AsyncEntry):
            sent.confirmed = True
            sent.seq += 1
            if sent.waiters:
                sent.waiters[0].wake()
        return True

    def _forget(self, channel: bytes) -> None:
        entry = self._entries.pop(channel, None)
        if entry is not None:
            entry.confirmed = False
            entry.seq += 1
            for waiter in entry.waiters:
                waiter.wake()

    def _lost(self) -> None:
        for entry in self._entries.values():
            entry.confirmed = False
            entry.seq += 1
            for waiter in entry.waiters:
                waiter.wake()

    def _turn_off(self, why: str) -> None:
        self.off = why
        log.warning("wake-ups are off for %s: %s; lock_wait polls with backoff", self._server, why)


class AsyncClusterWakeups(AsyncWakeups):
    """A Redis Cluster's subscribers for one async cache: one sharded-pub/sub connection
    per primary, made when a wait first needs it, each channel joined at its slot's owner
    (``owner(channel)``, the cluster backend's slot map). As the sync ClusterWakeups: a
    slot that moves unsubscribes its channel on the old node, its waiters poll, and the
    next wait on it joins the new owner."""

    def __init__(self, config: ServerConfig, owner: Callable[[bytes], tuple[str, int] | None]) -> None:
        # No task or connection of its own: only the per-node ones.
        self.pid = os.getpid()
        self.off = None
        self._config = config
        self._owner = owner
        self._nodes: dict[tuple[str, int], AsyncWakeups] = {}
        self._closed = False  # then no node's subscriber is made any more: a waiter polls

    def subscribed(self, channel: bytes) -> AsyncEntry | None:
        address = self._owner(channel)
        hub = None if address is None else self._nodes.get(address)
        return None if hub is None else hub.subscribed(channel)

    def join(self, channel: bytes) -> AsyncWaiter | None:
        address = self._owner(channel)
        if address is None or self._closed:
            return None  # no primary for the slot right now, or a wait that raced close(): poll
        hub = self._nodes.get(address)
        if hub is None or hub._closed:
            hub = self._nodes[address] = AsyncWakeups(self._config.node(*address), sharded=True)
        if hub.off is not None:
            self.off = hub.off
            return None
        return hub.join(channel)

    def leave(self, waiter: AsyncWaiter, acquired: bool) -> None:
        waiter.owner.leave(waiter, acquired)

    async def close(self) -> None:
        self._closed = True
        hubs, self._nodes = list(self._nodes.values()), {}
        for hub in hubs:
            await hub.close()


class AsyncSlot:
    """An async backend's subscriber, made on the first wait that needs it."""

    __slots__ = ("_hub", "_make")

    def __init__(self, make: Callable[[], AsyncWakeups]) -> None:
        self._make = make
        self._hub: AsyncWakeups | None = None

    def get(self) -> AsyncWakeups | None:
        """The live subscriber, made now if need be (on the running loop); None when off."""
        hub = self._hub
        if hub is None or hub.pid != current_pid():  # this process's pid, kept at fork (as Slot.get)
            hub = self._hub = self._make()
        return hub if hub.off is None else None

    async def close(self) -> None:
        hub, self._hub = self._hub, None
        if hub is not None and hub.pid == os.getpid():
            await hub.close()


def async_slot(config: ServerConfig) -> AsyncSlot | None:
    """An async backend's AsyncSlot, or None under connect(wakeups=False)."""
    return AsyncSlot(lambda: AsyncWakeups(config)) if config.wakeups else None


def async_cluster_slot(config: ServerConfig, owner: Callable[[bytes], tuple[str, int] | None]) -> AsyncSlot | None:
    """An async cluster backend's AsyncSlot (see AsyncClusterWakeups), or None under
    connect(wakeups=False)."""
    return AsyncSlot(lambda: AsyncClusterWakeups(config, owner)) if config.wakeups else None
