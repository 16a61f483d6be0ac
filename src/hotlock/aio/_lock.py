"""The async lease object: one acquisition, owned by whoever holds the object."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from types import TracebackType
from typing import TYPE_CHECKING

from .._lock import Lease, shown
from .._validate import Seconds
from ..errors import CacheError

if TYPE_CHECKING:
    from ._backend import AsyncBackend

__all__ = ["AsyncLock"]

log = logging.getLogger("hotlock")


class AsyncLock(Lease):
    """A held lock (see hotlock.Lease): the twin of hotlock.Lock, with the deadline on the
    event loop's clock and ``async with`` releasing it however the block ends."""

    __slots__ = ("_loop", "_release_later")
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

    def _now(self) -> float:
        return self._loop.time()

    async def extend(self, ttl: Seconds | None = None) -> None:
        """Set the TTL to ``ttl`` seconds from now (default: the TTL it was taken with).

        Raises LockLost when the key no longer holds this lock's token, and CacheError
        when Redis cannot answer (a hiccup the caller may retry until valid_for() is 0).
        """
        ms = self._extend_ms(ttl)
        sent = self._loop.time()
        try:
            ok = await self._backend.extend(self._name, self._token, ms)
        except BaseException as error:
            # Cancelled or failed after the extend may have run: a shorter TTL may now be
            # in force, so trust whichever deadline comes first.
            self._deadline = min(self._deadline, sent + ms / 1000.0)
            if self._meter is not None and isinstance(error, CacheError):  # metrics hook
                self._meter.failed(self, "extend", error)
            raise
        if self._meter is not None:  # metrics hook
            self._meter.extended(self, ok)
        if not self._extended(ok, ms, sent):
            raise self._lost("is no longer held: it expired or was taken over")

    async def unlock(self) -> bool:
        """Release the lock; True if this call released it, False if it was no longer ours.

        Idempotent, and never raises LockLost. A CacheError (Redis down) keeps the token,
        so a later call can still release it; otherwise the key expires by its TTL.
        Cancelling it still releases: the release is finished in the background.
        """
        if not self._sendable():
            return False
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
            if self._meter is not None:  # metrics hook
                self._meter.failed(self, "release", error)
            raise
        self._token = b""
        if self._meter is not None:  # metrics hook
            self._meter.released(self, released)
        return released

    async def __aenter__(self) -> AsyncLock:
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        try:
            await self.unlock()
        except Exception as error:
            # Never let the release hide the body's own exception or fail a body that
            # succeeded: the key expires by its TTL.
            log.warning("release of lock %r failed; it expires by its TTL: %s", shown(self.key), error)
