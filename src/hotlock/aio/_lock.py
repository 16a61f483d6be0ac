"""The async lease object: one acquisition, owned by whoever holds the object."""

from __future__ import annotations

import asyncio
import logging
import sys
from collections.abc import Callable
from types import TracebackType
from typing import TYPE_CHECKING

from .._lock import TAKEN, Lease, shown
from .._validate import Seconds
from ..errors import CacheError, Unreplicated

if TYPE_CHECKING:
    from ..backends import AsyncBackend

__all__ = ["AsyncLock"]

log = logging.getLogger("hotlock")

# Python 3.11+ counts cancellation requests (Task.cancelling/uncancel), which tells our
# cancellation of a block from one that came from outside, as asyncio.timeout does. On
# 3.10 the cancellation's message tells them apart instead (see AsyncLock._cancel_block).
HAS_UNCANCEL = sys.version_info >= (3, 11)


class AsyncLock(Lease):
    """A held lock (see hotlock.Lease): the twin of hotlock.Lock, with the deadline on the
    event loop's clock and ``async with`` releasing it however the block ends."""

    __slots__ = ("_block", "_cancelled", "_cancelling", "_loop", "_release_later", "_via_waiter")
    _shown_as = "hotlock.aio.AsyncLock"
    _backend: AsyncBackend

    def __init__(
        self,
        backend: AsyncBackend,
        release_later: Callable[[list[bytes], list[bytes]], None],
        loop: asyncio.AbstractEventLoop,
        key: str | bytes,
        name: bytes,
        token: bytes,
        fence: int,
        ttl: int,
        sent_at: float,
    ) -> None:
        super().__init__(backend, key, name, token, fence, ttl, sent_at)
        # The cache's background release, for an unlock cancelled mid-flight.
        self._release_later = release_later
        self._loop = loop
        # auto_extend: the task running the ``async with`` block, which the renewer cancels
        # at a loss; its cancellation count on entry; whether the renewer cancelled it.
        self._block: asyncio.Task[object] | None = None
        self._cancelling = 0
        self._cancelled = False
        self._via_waiter = False

    def _now(self) -> float:
        return self._loop.time()

    async def extend(self, ttl: Seconds | None = None) -> None:
        """Set the TTL to ``ttl`` seconds from now (default: the TTL it was taken with).

        Raises LockLost when the key no longer holds this lock's token, and CacheError
        when Redis cannot answer (a hiccup the caller may retry until valid_for() is 0).
        """
        sent = self._loop.time()
        ms = self._extend_ms(ttl, sent)
        try:
            ok = await self._backend.extend(self._name, self._token, ms)
        except Unreplicated as short:
            raise self._unreplicated(short, sent) from None
        except BaseException as error:
            # Cancelled or failed after the extend may have run: a shorter TTL may now be
            # in force, so trust whichever deadline comes first.
            self._deadline = min(self._deadline, sent + ms / 1000.0)
            if isinstance(error, CacheError):
                self._failed("extend", error)
            raise
        self._extend_replied(ok, ms, sent)

    async def unlock(self) -> bool:
        """Release the lock; True if this call released it, False if it was no longer ours.

        Idempotent, and never raises LockLost. A CacheError (Redis down) keeps the token,
        so a later call can still release it; otherwise the key expires by its TTL.
        Cancelling it still releases: the release is finished in the background.
        """
        if not self._sendable():
            return False
        if self._auto is not None:
            # Before the release is sent, as in hotlock.Lock.unlock.
            self._auto.forget()
        token = self._token
        try:
            released = await self._backend.release(self._name, token)
        except asyncio.CancelledError:
            # The release may or may not have run (or may have hit NOSCRIPT and never been
            # retried): send another behind it, which the caller no longer waits for.
            self._token = b""
            self._release_later([self._name], [token])
            raise
        except CacheError as error:
            self._failed("release", error)
            raise
        return self._released(released)

    async def __aenter__(self) -> AsyncLock:
        if self._auto is not None:
            task = asyncio.current_task()
            if task is not None:
                self._block = task
                self._cancelling = task.cancelling() if HAS_UNCANCEL else 0
        return self

    def _cancel_message(self) -> str:
        return f"hotlock: lease {shown(self.key)!r} lost (id {id(self):x})"

    def _cancel_block(self) -> None:
        """Called by the renewer at the loss: cancel the task running the ``async with`` block."""
        task = self._block
        if task is None or task.done() or self._cancelled:
            return
        waiter = getattr(task, "_fut_waiter", None)
        if not HAS_UNCANCEL and (getattr(task, "_must_cancel", False) or (waiter is not None and waiter.cancelled())):
            # 3.10: a cancellation from outside is already on its way, and ours would be
            # merged into it: let it end the block as what it is.
            return
        self._cancelled = True
        if HAS_UNCANCEL:
            task.cancel()
        else:
            task.cancel(self._cancel_message())
            # Through the future it awaited (the usual case), or flagged for its next step.
            self._via_waiter = not getattr(task, "_must_cancel", False)

    def _after_told(self) -> None:
        """Called by the renewer right after the on_lost callbacks ran (3.10 only matters).

        On 3.10 a cancel() made after ours but before the task runs (a callback cancelling
        it, say) is merged into our CancelledError, message and all; the task then still
        has _must_cancel set. Seen here, the block is left to end as cancelled from outside.
        """
        task = self._block
        if HAS_UNCANCEL or not self._cancelled or not self._via_waiter or task is None:
            return  # (flagged for its next step, a later cancel() overwrites our message: _ours sees it)
        if getattr(task, "_must_cancel", False):
            self._cancelled = False

    def _ours(self, task: asyncio.Task[object] | None, error: BaseException | None) -> bool:
        """Whether the renewer's cancellation (and no other) is what ended the block."""
        if HAS_UNCANCEL:
            # As asyncio.timeout: take our request back; any left are from outside.
            return task is not None and task.uncancel() <= self._cancelling
        # 3.10: a later cancel() overwrites the message, so ours survives only alone.
        return isinstance(error, asyncio.CancelledError) and error.args == (self._cancel_message(),)

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        if self._auto is None:
            await self._release_on_exit()
            return
        task, self._block = self._block, None  # the renewer cancels nothing from here on
        why = self._loss_at(self._now())
        error = exc
        if why is not None:
            self._let_go()  # a known loss is raised at once: the release goes on in the background
        else:
            try:
                await self._release_on_exit()
            except asyncio.CancelledError as cancelled:
                error = cancelled  # a cancellation arriving during the release
        if self._cancelled:
            self._cancelled = False
            ours = self._ours(task, error)
            if isinstance(error, asyncio.CancelledError):
                if ours:
                    raise self._lost(why or TAKEN) from error
                if error is not exc:
                    raise error
                return  # cancelled from outside: that CancelledError goes on
        elif error is not exc:
            raise error  # type: ignore[misc]  # a CancelledError from the release
        if why is not None and exc_type is None:
            # The work was not protected all along, and the caller must know.
            raise self._lost(why)

    async def _release_on_exit(self) -> None:
        try:
            await self.unlock()
        except Exception as error:
            # Never let the release hide the body's own exception or fail a body that
            # succeeded: the key expires by its TTL.
            log.warning("release of lock %r failed; it expires by its TTL: %s", shown(self.key), error)
