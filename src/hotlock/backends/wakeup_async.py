"""Waiters woken by the release, for the async API: hotlock.backends.wakeup's design on one event
loop (read its docstring first).

One subscriber connection per async cache, read by one task on the cache's loop; waiting
tasks write their SUBSCRIBE on it directly (one thread: no hand-over needed) and sleep on
an asyncio.Event instead of an fd. The rest is the sync design unchanged, with the same
steps (hotlock._waiting.Waiting decides them for both) and the same protocol
(hotlock._subscriber.Subscriber, driven here by the task): a wait polls first, then marks
and joins the key's channel if that attempt fails (subscribe, then try); a message wakes
the longest-waiting local waiter; the backoff stays the safety net; an ACL refusing
SUBSCRIBE turns wake-ups off, said once.
On a Redis Cluster, AsyncClusterWakeups keeps one sharded-pub/sub subscriber per primary,
as hotlock.backends.wakeup.ClusterWakeups does for sync.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable

from .._config import ServerConfig, keepalive, tls_context
from .._credentials import auth_command_async
from .._hubs import Hub, Made, PerNode
from .._inflight import within
from .._subscriber import ConnectTrouble, Entry
from ..errors import CacheError
from .wakeup import handshake

__all__ = [
    "AsyncClusterWakeups",
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

    def __init__(self, owner: AsyncWakeups) -> None:
        self.entry: Entry[AsyncWaiter] | None = None  # set by joining
        self.event = asyncio.Event()
        self.owner = owner  # the subscriber it is registered with (a cluster has several)

    def wake(self) -> None:
        self.event.set()

    def drain(self) -> bool:
        """Take a pending wake; True if there was one."""
        woken = self.event.is_set()
        self.event.clear()
        return woken

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


class AsyncWakeups(Hub[AsyncWaiter]):
    """The subscriber of one async cache, on the loop it was made in."""

    def __init__(self, config: ServerConfig, sharded: bool = False) -> None:
        super().__init__(config, sharded)
        self._writer: asyncio.StreamWriter | None = None
        self._task = asyncio.get_running_loop().create_task(self._run())

    # -- the waiting side -------------------------------------------------------------

    def join(self, channel: bytes) -> AsyncWaiter | None:
        """As hotlock.backends.wakeup.Wakeups.join: returns at once."""
        if self.off is not None or self._closed:
            return None
        waiter = AsyncWaiter(self)
        if self._core.join(channel, waiter, time.monotonic()):
            self._send()
        return waiter

    def leave(self, waiter: AsyncWaiter, acquired: bool) -> None:
        self._core.leave(waiter, acquired, time.monotonic())

    async def close(self) -> None:
        self._closed = True
        self._task.cancel()
        with contextlib.suppress(asyncio.CancelledError, Exception):
            await self._task

    def _send(self) -> None:
        # Not connected: the next connection subscribes every entry.
        if self._writer is not None and not self._writer.is_closing():
            out = self._core.outgoing()
            if out:
                self._writer.write(out)

    # -- the subscriber task --------------------------------------------------------------

    async def _run(self) -> None:
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
                await asyncio.sleep(trouble.failed(exc))
                continue
            trouble.connected()
            try:
                await self._serve(reader, writer)
            except (OSError, ConnectionError, asyncio.IncompleteReadError) as exc:
                log.debug("wake-ups: connection to %s lost: %s", self._server, exc)
            finally:
                self._writer = None
                writer.close()
                self._core.lost()

    async def _connect(self) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
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
        try:
            writer.write(self._core.connecting(*handshake(config, auth)))
            while self._core.greeting:
                data = await within(reader.read(65536), config.timeout)
                if not data:
                    raise ConnectionError("the server closed the connection during the handshake")
                self._core.feed(data)
        except BaseException:
            writer.close()
            raise
        return reader, writer

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        core = self._core
        core.serving(time.monotonic())
        self._writer = writer
        self._send()
        while not self._closed:
            try:
                data = await within(reader.read(65536), core.wait_s(time.monotonic()))
            except TimeoutError:
                data = None
            if data is not None:
                if not data:
                    raise ConnectionError("the server closed the connection")
                core.feed(data)
                if self._stopped():
                    return
            now = time.monotonic()
            if core.due(now):
                if self._watch is not None and self._watch.due():
                    epoch = await asyncio.get_running_loop().run_in_executor(None, self._watch.refresh)
                    if epoch != self._epoch:
                        raise ConnectionError("the sentinels name another primary")
                out = core.sweep(now)
                if out:
                    writer.write(out)


class AsyncClusterWakeups(PerNode[AsyncWakeups, AsyncWaiter], AsyncWakeups):
    """A Redis Cluster's subscribers for one async cache (hotlock._hubs.PerNode): one
    sharded-pub/sub connection per primary, each with its own task; none of its own."""

    def __init__(self, config: ServerConfig, owner: Callable[[bytes], tuple[str, int] | None]) -> None:
        PerNode.__init__(self, owner, lambda address: AsyncWakeups(config.node(*address), sharded=True))

    def leave(self, waiter: AsyncWaiter, acquired: bool) -> None:
        waiter.owner.leave(waiter, acquired)

    async def close(self) -> None:
        for hub in self._closing():
            await hub.close()


class AsyncSlot(Made[AsyncWakeups]):
    """An async backend's subscriber (hotlock._hubs.Made), made on the running loop."""

    __slots__ = ()

    async def close(self) -> None:
        hub = self._taken()
        if hub is not None:
            await hub.close()


def async_slot(config: ServerConfig) -> AsyncSlot | None:
    """An async backend's AsyncSlot, or None under connect(wakeups=False)."""
    return AsyncSlot(lambda: AsyncWakeups(config)) if config.wakeups else None


def async_cluster_slot(config: ServerConfig, owner: Callable[[bytes], tuple[str, int] | None]) -> AsyncSlot | None:
    """An async cluster backend's AsyncSlot (see AsyncClusterWakeups), or None under
    connect(wakeups=False)."""
    return AsyncSlot(lambda: AsyncClusterWakeups(config, owner)) if config.wakeups else None
