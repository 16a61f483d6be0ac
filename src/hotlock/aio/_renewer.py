"""The async cache's renewer: hotlock._renewer's Schedule, driven by a task on the loop.

One task keeps time: it sleeps until the next renewal, deadline or max_hold end (a
loop timer, so it wakes at a lease's deadline even while a round trip hangs), tells
losses (callbacks, and the cancellation of the ``async with`` block) and hands due
leases to a second task that does the round trips, one at a time, so a blackholed server
never piles them up. A block left with its lease lost hands the release to the cache's
background releases.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from typing import TYPE_CHECKING

from .._renewer import Held, Schedule, metered, outcome, sendable, split_live, tell, warn_failed
from ._lock import AsyncLock

if TYPE_CHECKING:
    from .._lock import Lease
    from ..backends import AsyncBackend

__all__ = ["AsyncRenewer"]

log = logging.getLogger("hotlock")

# uvloop's timers have millisecond resolution: a wake-up earlier than this from now
# would fire again at once, so it waits at least this long (lateness at most 1 ms).
_MIN_SLEEP = 0.001


class AsyncRenewer:
    def __init__(
        self,
        backend: AsyncBackend,
        loop: asyncio.AbstractEventLoop,
        release_later: Callable[[list[bytes], list[bytes]], None],
    ) -> None:
        self._backend = backend
        self._loop = loop
        self._release_later = release_later  # the cache's background release
        self._schedule = Schedule()
        self._outbox: list[Held] = []
        self._task: asyncio.Task[None] | None = None
        self._io: asyncio.Task[None] | None = None
        self._poke: asyncio.Future[None] | None = None  # the time-keeping task waits on it

    def watch(self, leases: list[AsyncLock], max_hold_ms: int | None) -> None:
        """Keep ``leases`` alive from now on (until released, lost, max_hold or close())."""
        for lease in leases:
            rec = Held(self, lease, max_hold_ms)
            lease._auto = rec
            self._schedule.add(rec)
        if self._task is None or self._task.done():
            self._task = self._loop.create_task(self._keep_time(), name="hotlock-renewer")
        self._wake()

    def _wake(self) -> None:
        if self._poke is not None and not self._poke.done():
            self._poke.set_result(None)

    def _forget(self, rec: Held) -> None:
        rec.gone = True

    def _let_go(self, rec: Held, token: bytes) -> None:
        rec.gone = True
        if token:
            self._release_later([rec.lease._name], [token])

    def _touch(self, rec: Held) -> None:
        self._schedule.touch(rec, self._loop.time())
        self._wake()

    def _on_lost(self, rec: Held, callback: Callable[[Lease], object]) -> None:
        if not rec.told:
            rec.callbacks.append(callback)
        else:
            tell(rec.lease, [callback])  # already told: at once, here

    async def _keep_time(self) -> None:
        loop = self._loop
        while True:
            now = loop.time()
            send, lost = self._schedule.take(now)
            if send:
                self._outbox.extend(send)
                if self._io is None or self._io.done():
                    self._io = loop.create_task(self._send(), name="hotlock-renewer-io")
            for rec in lost:
                lease = rec.lease
                if isinstance(lease, AsyncLock):
                    lease._cancel_block()
                tell(lease, rec.callbacks)
                if isinstance(lease, AsyncLock):
                    lease._after_told()
            wake = self._schedule.next_wake()
            self._poke = poke = loop.create_future()
            timer = None if wake is None else loop.call_at(max(wake, now + _MIN_SLEEP), _resolve, poke)
            try:
                await poke
            finally:
                if timer is not None:
                    timer.cancel()

    async def _send(self) -> None:
        loop = self._loop
        while self._outbox:
            batch, self._outbox = self._outbox, []
            for chunk in sendable(batch):
                calls = split_live(chunk, loop.time())
                for i, (ms, live, names, tokens) in enumerate(calls):
                    sent = loop.time()
                    results: list[bool] | None
                    why: dict[int, str] | None = None
                    failure: Exception | None = None
                    try:
                        results = await self._backend.extend_many(names, tokens, ms)
                    except asyncio.CancelledError:
                        for _, unsent, _, _ in calls[i:]:
                            for rec in unsent:
                                rec.sending = False
                        raise
                    except Exception as error:
                        results, why, failure = outcome(error)
                        if failure is not None:
                            warn_failed(live, failure)
                    self._schedule.applied(live, results, ms, sent, loop.time(), why)
                    self._wake()
                    metered(live, results, failure)

    async def close(self) -> None:
        """Stop renewing: the leases still held then expire by their TTL."""
        self._schedule.clear()
        self._outbox.clear()
        tasks = [t for t in (self._task, self._io) if t is not None and not t.done()]
        self._task = self._io = None
        for task in tasks:
            task.cancel()
        if tasks and asyncio.current_task() not in tasks:
            await asyncio.wait(tasks)


def _resolve(future: asyncio.Future[None]) -> None:
    if not future.done():
        future.set_result(None)
