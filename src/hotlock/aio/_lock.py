"""The async lease object: one acquisition, owned by whoever holds the object."""

from __future__ import annotations

import asyncio
import logging
import os
from types import TracebackType
from typing import TYPE_CHECKING

from .._lock import Lock, shown
from .._validate import Seconds, ttl_ms
from ..errors import LockLost

if TYPE_CHECKING:
    from ._cache import AsyncCache

__all__ = ["AsyncLock"]

log = logging.getLogger("hotlock")


class AsyncLock:
    """A held lock: its key, a hidden token, the pid that took it and a local deadline.

    The twin of hotlock.Lock. The token lives here and nowhere else (never in a
    contextvar or on the cache), so any task holding the object may extend or release
    it and two acquisitions never share state; it is in no repr, log line or message.
    The deadline is on the event loop's clock, from when the acquire was sent.
    """

    __slots__ = ("_backend", "_cache", "_deadline", "_loop", "_name", "_pid", "_token", "_ttl_ms", "key")

    def __init__(
        self,
        cache: AsyncCache,
        loop: asyncio.AbstractEventLoop,
        key: str | bytes,
        name: bytes,
        token: bytes,
        ttl: int,
        sent_at: float,
    ) -> None:
        self._cache = cache  # for the background release of a cancelled unlock
        self._backend = cache._backend
        self._loop = loop
        self.key = key
        self._name = name  # the Redis key, prefix included
        self._token = token  # b"" once released or handed to a background release
        self._ttl_ms = ttl
        self._pid = os.getpid()
        # The TTL runs from when the acquire was sent, not from when its reply came back.
        self._deadline = sent_at + ttl / 1000.0

    @property
    def ttl(self) -> float:
        """The TTL in seconds this lock was taken or last extended with."""
        return self._ttl_ms / 1000.0

    def valid_for(self) -> float:
        """Seconds this lock is known to be ours; 0.0 once the TTL may have run out."""
        if not self._sendable():
            return 0.0
        return max(0.0, self._deadline - self._loop.time())

    async def extend(self, ttl: Seconds | None = None) -> None:
        """Set the TTL to ``ttl`` seconds from now (default: the TTL it was taken with).

        Raises LockLost when the key no longer holds this lock's token, and CacheError
        when Redis cannot answer (a hiccup the caller may retry until valid_for() is 0).
        """
        ms = self._ttl_ms if ttl is None else ttl_ms(ttl)
        if self._pid != os.getpid():
            raise self._lost(f"was taken by process {self._pid}; a forked child cannot extend it")
        if not self._token:
            raise self._lost("was already released")
        sent = self._loop.time()
        try:
            ok = await self._backend.extend(self._name, self._token, ms)
        except BaseException:
            # Cancelled or failed after the extend may have run: a shorter TTL may now be
            # in force, so trust whichever deadline comes first.
            self._deadline = min(self._deadline, sent + ms / 1000.0)
            raise
        if not self._extended(ok, ms, sent):
            raise self._lost("is no longer held: it expired or was taken over")

    def _lost(self, why: str) -> LockLost:
        # The wording is defined once, in Lock; it reads nothing but .key and ._backend.server.
        return Lock._lost(self, why)  # type: ignore[arg-type]

    def _extended(self, ok: bool, ms: int, sent: float) -> bool:
        """Record an extend's outcome: a new deadline, or none left."""
        if ok:
            self._ttl_ms = ms
            self._deadline = sent + ms / 1000.0
        else:
            self._deadline = sent
        return ok

    def _sendable(self) -> bool:
        """Not yet released, and taken by this process (a forked child sends nothing)."""
        return bool(self._token) and self._pid == os.getpid()

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
            self._cache._release_in_background([self._name], [token])
            raise
        self._token = b""
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

    def __repr__(self) -> str:
        key, server = shown(self.key), self._backend.server
        return f"<hotlock.aio.AsyncLock key={key!r} valid_for={self.valid_for():.3f}s server={server}>"
