"""What the async Redis backends share: a timeout that keeps cancellations, and the
ordering promise of a pooled backend (InFlight)."""

from __future__ import annotations

import asyncio
import sys
from collections.abc import Awaitable
from typing import Any, TypeVar

from ._ident import TOKEN_BYTES
from .errors import cache_error

__all__ = [
    "InFlight",
    "within",
]


T = TypeVar("T")

if sys.version_info >= (3, 11):

    async def within(aw: Awaitable[T], seconds: float) -> T:
        """``await aw``, or TimeoutError after ``seconds``; a cancellation always propagates.

        Not asyncio.wait_for: up to Python 3.11 it returns the result, and drops the
        cancellation, when the caller is cancelled in the loop turn that ``aw`` completes
        in, so a cancelled wait could run on to its deadline. asyncio.timeout counts
        cancellation requests and keeps them.
        """
        async with asyncio.timeout(seconds):
            return await aw

else:

    async def within(aw: Awaitable[T], seconds: float) -> T:
        """As above, on 3.10 (no asyncio.timeout): ``aw`` runs as a task of its own."""
        task = asyncio.ensure_future(aw)
        try:
            done, _ = await asyncio.wait((task,), timeout=seconds)
        except asyncio.CancelledError:
            task.cancel()
            task.add_done_callback(_retrieve)
            raise
        if not done:
            task.cancel()
            task.add_done_callback(_retrieve)
            raise TimeoutError
        return task.result()

    def _retrieve(task: asyncio.Future[Any]) -> None:
        # An abandoned task's outcome, taken so that asyncio does not log it as never retrieved.
        if not task.cancelled():
            task.exception()


class InFlight:
    """AsyncBackend's ordering promise, kept by a backend whose connections are pooled (or
    per node): calls run to completion behind a shield, recorded under their tokens, and a
    release of a token first waits for them.

    Cancelling a redis.asyncio call mid-command drops its connection while the command may
    still run on the server; a release sent meanwhile on another connection could overtake
    it and leave the acquire standing. Finishing the acquire first, and having releases of
    its tokens wait for it, keeps the promise. Releases run shielded too: redis.asyncio
    swallows a cancellation that lands in some of its steps, and behind the shield the
    caller's cancel always lands at once.
    """

    __slots__ = ("_server", "_tasks")

    def __init__(self, server: str = "") -> None:
        self._server = server
        self._tasks: dict[bytes, asyncio.Future[Any]] = {}

    def shielded(self, tokens: list[bytes], work: Awaitable[T]) -> Awaitable[T]:
        """Run ``work`` to completion even if its caller is cancelled, recorded under ``tokens``."""
        task = asyncio.ensure_future(work)
        bare = [token[:TOKEN_BYTES] for token in tokens]  # a permit's acquire sends token '#' limit
        for token in bare:
            self._tasks[token] = task

        def done(finished: asyncio.Future[Any]) -> None:
            for token in bare:
                if self._tasks.get(token) is finished:
                    del self._tasks[token]
            if not finished.cancelled():
                finished.exception()  # retrieved: a caller that was cancelled will never see it

        task.add_done_callback(done)
        return self._outcome(task)

    async def _outcome(self, task: asyncio.Future[T]) -> T:
        """The shielded ``task``'s result. Cancelled by close() (not by this caller), the
        call ends in CacheError: a cancellation the caller never asked for is not its own."""
        try:
            return await asyncio.shield(task)
        except asyncio.CancelledError:
            current = asyncio.current_task()
            cancelling = getattr(current, "cancelling", None)  # 3.11+: this caller's own requests
            if not task.cancelled() or (cancelling is not None and cancelling()):
                raise
            raise cache_error("the call was ended by close()", self._server) from None

    async def close(self, timeout: float) -> None:
        """The backend is closing: cancel the calls still in flight (a caller who gave up
        on them, such as a background release that close() stopped waiting for), so none
        opens a connection after the pool is gone; they get ``timeout`` s to end.

        Cancelled again every 10 ms until they end: on uvloop, a cancellation that lands
        as redis.asyncio's own reply timeout fires can be lost inside it, and the call
        would run on to its next timeout."""
        give_up = asyncio.get_running_loop().time() + timeout
        pending = set(self._tasks.values())
        while pending:
            for task in pending:
                task.cancel()
            left = give_up - asyncio.get_running_loop().time()
            if left <= 0:
                return
            _, pending = await asyncio.wait(pending, timeout=min(0.01, left))

    async def settled(self, tokens: list[bytes]) -> None:
        """Wait for the calls in flight under ``tokens``. A release gives the held value
        (token + fence) or, for an interrupted acquire, the bare token: calls are recorded
        under the bare token."""
        pending = {task for token in tokens if (task := self._tasks.get(token[:TOKEN_BYTES])) is not None}
        if pending:
            await asyncio.wait(pending)
