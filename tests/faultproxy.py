"""A TCP fault proxy between a client and redis-server, switchable while a test runs.

    with FaultProxy(server.port) as proxy:
        cache = hotlock.connect(proxy.url, timeout=0.5)
        proxy.drop_replies(1)          # the next reply chunk never reaches the client
        proxy.blackhole(True)          # nothing passes either way; connects still succeed
        proxy.reset()                  # every open connection gets a TCP RST

It runs an asyncio loop in a daemon thread of its own, so the client under test can be
a plain blocking one in the test's thread. Every switch is a plain attribute read by the
pumps on each chunk, so a fault takes effect on the next chunk, mid-connection. stop()
aborts every connection, closes the listener and joins the thread within a few seconds.

One "chunk" is what one recv() returned. Redis replies to one small command, or to one
pipelined batch written at once, arrive as one chunk on loopback, which is what makes
"drop the next reply" mean one reply.
"""

from __future__ import annotations

import asyncio
import contextlib
import random
import socket
import struct
import threading
from collections.abc import Callable
from types import TracebackType

__all__ = ["FaultProxy"]

_CHUNK = 65536


class FaultProxy:
    def __init__(self, upstream_port: int, upstream_host: str = "127.0.0.1", db: int = 0) -> None:
        self.upstream = (upstream_host, upstream_port)
        self.db = db
        self.port = 0
        # Switches, read by the pumps on every chunk (plain attributes: the GIL makes each
        # read and write atomic, and a fault only has to apply from the next chunk on).
        self.delay_s = 0.0  # added before forwarding each chunk, both ways
        self.jitter_s = 0.0  # plus uniform(0, jitter_s)
        self._blackhole = False  # drop everything both ways (connections stay open)
        self._drop_requests = 0  # client->server chunks still to drop
        self._drop_replies = 0  # server->client chunks still to drop
        self._reset_after_request = 0  # forward the next request, then RST the client
        # Counters a test can assert on.
        self.connections = 0
        self.dropped_requests = 0
        self.dropped_replies = 0
        self.resets = 0
        self._pairs: set[tuple[asyncio.StreamWriter, asyncio.StreamWriter]] = set()
        # Every connection either side ever had, so that stopping closes them all (one
        # accepted while the proxy stops is in no pair yet).
        self._writers: set[asyncio.StreamWriter] = set()
        # Pairs about to be reset: their replies are swallowed meanwhile, so the reply to
        # the request that doomed them is surely lost.
        self._doomed: set[tuple[asyncio.StreamWriter, asyncio.StreamWriter]] = set()
        self._loop = asyncio.new_event_loop()
        self._server: asyncio.base_events.Server | None = None
        self._thread = threading.Thread(target=self._run, name="faultproxy", daemon=True)
        self._started = threading.Event()
        self._mutex = threading.Lock()  # guards the counted switches above

    # -- lifetime ----------------------------------------------------------------------

    def start(self) -> FaultProxy:
        self._thread.start()
        if not self._started.wait(5):
            raise RuntimeError("fault proxy did not start within 5 s")
        return self

    def stop(self) -> None:
        if not self._thread.is_alive():
            return

        async def shutdown() -> None:
            if self._server is not None:
                self._server.close()
            self._abort_all()

        fut = asyncio.run_coroutine_threadsafe(shutdown(), self._loop)
        fut.result(5)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(5)

    def __enter__(self) -> FaultProxy:
        return self.start()

    def __exit__(self, et: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None) -> None:
        self.stop()

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/{self.db}"

    # -- switches ---------------------------------------------------------------------

    def delay(self, seconds: float, jitter: float = 0.0) -> None:
        """Hold every chunk, both ways, for ``seconds`` plus up to ``jitter`` more."""
        self.delay_s, self.jitter_s = seconds, jitter

    def blackhole(self, on: bool) -> None:
        """Swallow every byte both ways: the peer neither answers nor hangs up."""
        self._blackhole = on

    def drop_requests(self, n: int = 1) -> None:
        """Swallow the next ``n`` request chunks: the server never sees them."""
        with self._mutex:
            self._drop_requests = n

    def drop_replies(self, n: int = 1) -> None:
        """Swallow the next ``n`` reply chunks: the server ran the command, the client never hears."""
        with self._mutex:
            self._drop_replies = n

    def reset_after_request(self, n: int = 1) -> None:
        """Forward the next ``n`` requests to the server, then RST their client connection."""
        with self._mutex:
            self._reset_after_request = n

    def reset(self) -> None:
        """RST every open connection now (both sides)."""
        asyncio.run_coroutine_threadsafe(self._reset_now(), self._loop).result(5)

    def clear(self) -> None:
        """Every switch off (counters kept)."""
        self.delay(0.0)
        self._blackhole = False
        with self._mutex:
            self._drop_requests = self._drop_replies = self._reset_after_request = 0

    # -- the loop ---------------------------------------------------------------------

    def _run(self) -> None:
        asyncio.set_event_loop(self._loop)

        async def listen() -> None:
            self._server = await asyncio.start_server(self._accept, "127.0.0.1", 0)
            self.port = self._server.sockets[0].getsockname()[1]

        self._loop.run_until_complete(listen())
        self._started.set()
        try:
            self._loop.run_forever()
        finally:
            # Let the pumps see their connections aborted, then close the loop.
            pending = asyncio.all_tasks(self._loop)
            for task in pending:
                task.cancel()
            self._loop.run_until_complete(asyncio.gather(*pending, return_exceptions=True))
            for writer in self._writers:
                writer.transport.abort()
            self._loop.run_until_complete(asyncio.sleep(0))  # the aborts' connection_lost
            self._loop.close()

    async def _reset_now(self) -> None:
        self._abort_all()

    def _abort_all(self) -> None:
        for client, upstream in list(self._pairs):
            self._rst(client)
            self._rst(upstream)
            self.resets += 1
        self._pairs.clear()

    @staticmethod
    def _rst(writer: asyncio.StreamWriter) -> None:
        sock = writer.get_extra_info("socket")
        if sock is not None:
            # Linger 0: close() sends RST, as a crashed peer or a middlebox does.
            with contextlib.suppress(OSError):
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        writer.transport.abort()

    async def _accept(self, creader: asyncio.StreamReader, cwriter: asyncio.StreamWriter) -> None:
        self.connections += 1
        self._writers.add(cwriter)
        try:
            ureader, uwriter = await asyncio.wait_for(asyncio.open_connection(*self.upstream), 5)
        except (OSError, asyncio.TimeoutError):
            self._rst(cwriter)
            return
        self._writers.add(uwriter)
        pair = (cwriter, uwriter)
        self._pairs.add(pair)
        to_server = asyncio.ensure_future(self._pump(creader, uwriter, self._on_request, pair))
        to_client = asyncio.ensure_future(self._pump(ureader, cwriter, self._on_reply, pair))
        await asyncio.wait([to_server, to_client], return_when=asyncio.FIRST_COMPLETED)
        for task in (to_server, to_client):
            task.cancel()
        if pair in self._pairs:
            self._pairs.discard(pair)
            for w in pair:
                w.transport.abort()

    def _on_request(self) -> tuple[bool, bool]:
        """(forward this request chunk?, reset the client right after?)"""
        if self._blackhole:
            return False, False
        with self._mutex:
            if self._drop_requests > 0:
                self._drop_requests -= 1
                self.dropped_requests += 1
                return False, False
            if self._reset_after_request > 0:
                self._reset_after_request -= 1
                return True, True
        return True, False

    def _on_reply(self) -> tuple[bool, bool]:
        if self._blackhole:
            return False, False
        with self._mutex:
            if self._drop_replies > 0:
                self._drop_replies -= 1
                self.dropped_replies += 1
                return False, False
        return True, False

    async def _pump(
        self,
        reader: asyncio.StreamReader,
        writer: asyncio.StreamWriter,
        decide: Callable[[], tuple[bool, bool]],
        pair: tuple[asyncio.StreamWriter, asyncio.StreamWriter],
    ) -> None:
        try:
            while True:
                data = await reader.read(_CHUNK)
                if not data:
                    return
                wait = self.delay_s + (random.uniform(0, self.jitter_s) if self.jitter_s else 0.0)
                if wait > 0:
                    # Sleeping in the pump keeps this direction's chunks in order.
                    await asyncio.sleep(wait)
                forward, reset = decide()
                if pair in self._doomed and decide == self._on_reply:
                    continue
                if not forward:
                    continue
                if reset:
                    self._doomed.add(pair)
                writer.write(data)
                await writer.drain()
                if reset:
                    # Give the server time to run the command, so the reply is what is lost.
                    await asyncio.sleep(0.05)
                    self._doomed.discard(pair)
                    if pair in self._pairs:
                        self._pairs.discard(pair)
                        self.resets += 1
                        self._rst(pair[0])
                        self._rst(pair[1])
                    return
        except (OSError, asyncio.IncompleteReadError):
            return
