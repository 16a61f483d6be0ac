"""hotlock.leader: one leader among many processes, on an auto-extended lease.

    leader = hotlock.leader.Leader(cache, "reports", ttl=10)
    if leader.campaign(wait=5):          # True: this process leads, with leader.epoch
        while leader.is_leader:          # renewed in the background about every ttl/3
            run_one_round(epoch=leader.epoch)

The lease is an ordinary hotlock lock on ``leader:<name>`` taken with ``auto_extend=True``:
the cache's renewer keeps it, and tells the loss at once (an extend finding another
holder, or the lease's deadline passing while Redis cannot be reached): ``lost`` is set,
the ``on_lost`` callback runs and ``is_leader`` turns False, before any other process can
take the key. ``epoch`` is the lease's fence, larger for every new leader: hand it to
whatever the leader writes so a store can refuse a deposed leader's late writes.
``AsyncLeader`` is the same on hotlock.aio.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
from collections.abc import Callable
from typing import TYPE_CHECKING

from ._validate import Seconds, key_bytes, ttl_ms, wait_ms
from .errors import CacheError, LockLost, LockNotAcquired

if TYPE_CHECKING:
    from ._cache import Cache
    from ._lock import Lease, Lock
    from .aio import AsyncCache, AsyncLock

__all__ = ["AsyncLeader", "Leader"]

log = logging.getLogger("hotlock")

# The leases live beside the other locks, under their own word: a leader of "reports" does
# not exclude a plain lock on "reports".
SPACE = "leader:"


class _Base:
    """What the sync and async leaders share: the arguments, checked, and the loss told."""

    def __init__(
        self,
        name: str,
        ttl: Seconds,
        on_elected: Callable[[int], object] | None,
        on_lost: Callable[[int], object] | None,
        lost: threading.Event | asyncio.Event,
    ) -> None:
        if not isinstance(name, str) or not name:
            raise ValueError(f"name must be a non-empty str, not {name!r}")
        key_bytes(SPACE + name)
        ms = ttl_ms(ttl)
        if ms < 1000:
            # The renewer extends every ttl/3: a shorter lease is lost to one slow reply.
            raise ValueError(f"ttl must be at least 1 s for a leader lease, not {ms / 1000:g} s")
        for what, callback in (("on_elected", on_elected), ("on_lost", on_lost)):
            if callback is not None and not callable(callback):
                raise TypeError(f"{what} must be callable or None, not {type(callback).__name__}")
        self.name = name
        self.key = SPACE + name
        """The lock key of the lease (``leader:<name>``)."""
        self.ttl = ms / 1000
        self._on_elected = on_elected
        self._on_lost = on_lost
        self.lost = lost
        """Set when this process's leadership ends without step_down(); cleared by a won campaign."""
        self._epoch: int | None = None

    @property
    def epoch(self) -> int | None:
        """The fence of the current term (larger than every earlier leader's), or None when not leading."""
        return self._epoch if self.is_leader else None

    @property
    def is_leader(self) -> bool:
        raise NotImplementedError

    def _elected(self, lease: Lease) -> None:
        self._epoch = lease.fence
        self.lost.clear()
        lease.on_lost(self._told)
        log.info("leader %r: elected, epoch %d", self.name, lease.fence)
        if self._on_elected is not None:
            self._on_elected(lease.fence)

    def _told(self, lease: Lease) -> None:
        # From the renewer (its thread, or the loop), once per term.
        log.warning("leader %r: leadership of epoch %d lost", self.name, lease.fence)
        self.lost.set()
        if self._on_lost is not None:
            self._on_lost(lease.fence)


class Leader(_Base):
    """A leader lease on a sync Cache: campaign(), renewal in the background, step_down().

    ``on_elected(epoch)`` runs in the campaigning thread when a campaign wins;
    ``on_lost(epoch)`` runs on the renewer's thread the moment the lease is known lost
    (keep it short: set a flag, stop a loop). ``lost`` is a threading.Event set then too.
    A step_down() is not a loss. Use one Leader per thread of control.
    """

    def __init__(
        self,
        cache: Cache,
        name: str,
        ttl: Seconds = 10.0,
        *,
        on_elected: Callable[[int], object] | None = None,
        on_lost: Callable[[int], object] | None = None,
    ) -> None:
        from ._cache import Cache

        if not isinstance(cache, Cache):
            raise TypeError(f"cache must be a hotlock.Cache (hotlock.connect()), not {type(cache).__name__}")
        super().__init__(name, ttl, on_elected, on_lost, threading.Event())
        self.cache = cache
        self._lease: Lock | None = None

    @property
    def is_leader(self) -> bool:
        """True while this process holds the lease and it is not known lost (no round trip)."""
        lease = self._lease
        return lease is not None and not lease.lost

    def campaign(self, wait: Seconds | None = None) -> bool:
        """Try to become (or stay) the leader: True if this process leads now.

        ``wait=None`` tries once; ``wait=S`` waits up to S seconds for the current leader's
        lease to end (a standby then takes over the moment its TTL runs out, or at once
        when the leader steps down). CacheError propagates: Redis down is not "not elected".
        """
        if wait is not None:
            wait_ms(wait)
        if self.is_leader:
            return True
        self._forget()
        try:
            if wait is None:
                lease = self.cache.lock(self.key, self.ttl, auto_extend=True)
            else:
                lease = self.cache.lock_wait(self.key, self.ttl, wait, auto_extend=True)
        except LockNotAcquired:
            return False
        self._lease = lease
        self._elected(lease)
        return True

    def renew(self) -> None:
        """Extend the lease now, confirmed by Redis (the renewer does this by itself every
        ttl/3). LockLost if it is not ours any more; CacheError if Redis cannot answer."""
        if self._lease is None:
            raise LockLost(f"leader {self.name!r}: not leading", key=self.key, server=self.cache.server)
        self._lease.extend()

    def check(self) -> None:
        """Raise LockLost unless this process still leads (no round trip)."""
        if self._lease is None:
            raise LockLost(f"leader {self.name!r}: not leading", key=self.key, server=self.cache.server)
        self._lease.check()

    def step_down(self) -> bool:
        """Release the lease so a standby takes over at once; True if it was still ours.
        A CacheError is logged and the lease left to expire by its TTL."""
        lease, self._lease = self._lease, None
        if lease is None:
            return False
        try:
            return lease.unlock()
        except CacheError as error:
            log.warning("leader %r: step_down could not release; it expires by its TTL: %s", self.name, error)
            return False

    def _forget(self) -> None:
        # A lost term's lease: stop its renewal and send its release, in case it is ours still.
        lease, self._lease = self._lease, None
        if lease is not None:
            with contextlib.suppress(CacheError):  # it expires by its TTL
                lease.unlock()

    def __enter__(self) -> Leader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.step_down()


class AsyncLeader(_Base):
    """Leader on a hotlock.aio.AsyncCache: ``await campaign()``, ``await step_down()``.

    ``lost`` is an asyncio.Event (``await leader.lost.wait()``); ``on_lost(epoch)`` runs on
    the loop the moment the lease is known lost.
    """

    def __init__(
        self,
        cache: AsyncCache,
        name: str,
        ttl: Seconds = 10.0,
        *,
        on_elected: Callable[[int], object] | None = None,
        on_lost: Callable[[int], object] | None = None,
    ) -> None:
        # CacheBase has two kinds, Cache and AsyncCache: checked without importing hotlock.aio,
        # which would put this module above the package (tests/test_imports.py).
        from ._cache import Cache
        from ._core import CacheBase

        if not isinstance(cache, CacheBase) or isinstance(cache, Cache):
            raise TypeError(
                f"cache must be a hotlock.aio.AsyncCache (hotlock.aio.connect()), not {type(cache).__name__}"
            )
        super().__init__(name, ttl, on_elected, on_lost, asyncio.Event())
        self.cache = cache
        self._lease: AsyncLock | None = None

    @property
    def is_leader(self) -> bool:
        """True while this process holds the lease and it is not known lost (no round trip)."""
        lease = self._lease
        return lease is not None and not lease.lost

    async def campaign(self, wait: Seconds | None = None) -> bool:
        """As Leader.campaign(), awaited."""
        if wait is not None:
            wait_ms(wait)
        if self.is_leader:
            return True
        await self._forget()
        try:
            if wait is None:
                lease = await self.cache.lock(self.key, self.ttl, auto_extend=True)
            else:
                lease = await self.cache.lock_wait(self.key, self.ttl, wait, auto_extend=True)
        except LockNotAcquired:
            return False
        self._lease = lease
        self._elected(lease)
        return True

    async def renew(self) -> None:
        """As Leader.renew(), awaited."""
        if self._lease is None:
            raise LockLost(f"leader {self.name!r}: not leading", key=self.key, server=self.cache.server)
        await self._lease.extend()

    def check(self) -> None:
        """Raise LockLost unless this process still leads (no round trip)."""
        if self._lease is None:
            raise LockLost(f"leader {self.name!r}: not leading", key=self.key, server=self.cache.server)
        self._lease.check()

    async def step_down(self) -> bool:
        """As Leader.step_down(), awaited."""
        lease, self._lease = self._lease, None
        if lease is None:
            return False
        try:
            return await lease.unlock()
        except CacheError as error:
            log.warning("leader %r: step_down could not release; it expires by its TTL: %s", self.name, error)
            return False

    async def _forget(self) -> None:
        lease, self._lease = self._lease, None
        if lease is not None:
            with contextlib.suppress(CacheError):  # it expires by its TTL
                await lease.unlock()

    async def __aenter__(self) -> AsyncLeader:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.step_down()
