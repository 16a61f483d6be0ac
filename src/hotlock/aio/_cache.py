"""The async Cache: the calls hotlock._core checks and builds, awaited on one async backend."""

from __future__ import annotations

import asyncio
import functools
import logging
import random
import time
from collections.abc import Awaitable, Callable, Coroutine, Generator, Iterable
from types import TracebackType
from typing import TYPE_CHECKING, Any, ParamSpec, Protocol, TypeVar

from .._cache import Cache
from .._core import ONCE, CacheBase, Extending, Releasing, Request
from .._decorate import Locking
from .._ident import new_token
from .._renewer import warn_unreleased
from .._scripts import permit_ask
from .._twin import takes_method
from .._validate import Seconds
from .._waiting import FIRST, Joining, Step, Waiting
from ..backends.wakeup_async import AsyncSlot, AsyncWaiter
from ..errors import Unreplicated
from ._lock import AsyncLock
from ._renewer import AsyncRenewer

if TYPE_CHECKING:
    from ..backends import AsyncBackend

__all__ = ["Acquiring", "AsyncCache"]

P = ParamSpec("P")
R = TypeVar("R")

log = logging.getLogger("hotlock")


class AsyncDecorate(Protocol):
    """What AsyncCache.locked() returns: a decorator of coroutine functions."""

    def __call__(self, fn: Callable[P, Awaitable[R]], /) -> Callable[P, Coroutine[Any, Any, R]]: ...


class AsyncCache(CacheBase[AsyncLock, "Acquiring", AsyncDecorate]):
    """Locks, idempotency keys and counters on one async backend. Make one with
    ``await hotlock.aio.connect()``; it belongs to the event loop it was made in."""

    __slots__ = ("_background", "_renewer")
    _lock_type = AsyncLock
    _shown_as = "hotlock.aio.AsyncCache"
    _backend: AsyncBackend

    def __init__(self, backend: AsyncBackend, prefix: bytes, reply_timeout: float = 2.0) -> None:
        super().__init__(backend, prefix, reply_timeout)
        # Releases still running of interrupted acquisitions and releases, and of leases
        # lost in their block; close() waits for them.
        self._background: set[asyncio.Task[None]] = set()
        # The one renewer of this cache's auto-extended leases, made on first use.
        self._renewer: AsyncRenewer | None = None

    def _renew(self, locks: list[AsyncLock], hold: int | None) -> None:
        if self._renewer is None:
            self._renewer = AsyncRenewer(self._backend, asyncio.get_running_loop(), self._release_in_background)
        self._renewer.watch(locks, hold)

    # -- locks ------------------------------------------------------------------------

    @takes_method(Cache.lock)
    def lock(self, *, key: Any, ttl: Any, auto_extend: Any, max_hold: Any, limit: Any) -> Acquiring:
        """Try once: ``await cache.lock(key)`` gives an AsyncLock or raises LockNotAcquired;
        ``async with cache.lock(key):`` also releases it however the block ends.

        The arguments are checked here, before anything is awaited or sent.
        ``auto_extend=True`` hands the lease to the cache's renewer (a task on this loop),
        as in hotlock.Cache.lock(); at a loss the task running the ``async with`` block is
        cancelled and the block raises LockLost. ``limit=N``: up to N holders at once, as
        in hotlock.Cache.lock().
        """
        return Acquiring(self, Request(self._lock_prefix, key, ttl, ONCE, auto_extend, max_hold, limit))

    def _waiting(self, request: Request) -> Acquiring:
        return Acquiring(self, request)

    async def _acquire(self, request: Request, tries: list[int] | None = None) -> AsyncLock:
        # ``tries``: a metered cache's list, given the number of attempts a lock_wait made
        # when it acquires or gives up.
        key, name, ms, wait_for, limit = request.key, request.name, request.ttl_ms, request.wait_ms, request.limit
        loop = asyncio.get_running_loop()
        token = new_token()
        ask = permit_ask(token, limit)
        # The wait's start on the machine's clock (its deadline counts from here); a lock()
        # never waits and reads no clock for it.
        start = 0.0 if wait_for is None else time.monotonic()
        # The backend's wake-up subscriber (hotlock.backends.wakeup_async), for a lock_wait.
        # The steps are hotlock._waiting.Waiting's, made when the first attempt fails; this
        # loop only does them.
        slot: AsyncSlot | None = None if wait_for is None else getattr(self._backend, "wake_slot", None)
        machine: Waiting | None = None
        script = FIRST
        joining: Joining[AsyncWaiter] = Joining(slot)
        # True from the moment an acquire with this token may reach Redis until we know it
        # did not take the key: while it is, an interruption must release the token.
        maybe_held = False
        since = loop.time()
        try:
            while True:
                sent = loop.time()
                maybe_held = True
                result = await self._backend.acquire(name, ask, ms, since, wait_for or 0, script)
                if result > 0:
                    lock = AsyncLock(self._backend, self._release_in_background, loop, key, name, ask, result, ms, sent)
                    if request.auto:
                        self._renew([lock], request.hold_ms)
                    if tries is not None:
                        tries.append(1 if machine is None else machine.failures + 1)
                    joining.leave(True)
                    return lock
                maybe_held = False
                if wait_for is None:
                    raise self._not_acquired(key, result, wait_for, limit)
                if machine is None:
                    machine = Waiting(name, wait_for, start, time.monotonic, random.random, slot is not None)
                step = joining.through(machine, machine.failed(result))
                while step is not Step.ATTEMPT:
                    if step is Step.SLEEP:
                        await asyncio.sleep(machine.sleep_s)
                    elif step is Step.WAKEABLE:
                        assert joining.waiter is not None
                        await joining.waiter.sleep(machine.sleep_s)
                    else:
                        if tries is not None:
                            tries.append(machine.failures)
                        raise self._not_acquired(key, result, wait_for, limit)
                    step = joining.through(machine, machine.slept())
                script = machine.script
        except BaseException:
            # Cancelled (or failed: a timeout is ambiguous) while our acquire may have
            # taken the key: release it behind that acquire, since nobody will hold the
            # lock object. The backend's ordering promise puts the release after it. Its
            # fence is unknown: RELEASE takes the bare token for this.
            if maybe_held:
                self._release_in_background([name], [token])
            raise
        finally:
            joining.leave(False)

    async def with_lock(
        self, key: str | bytes, ttl: Seconds, fn: Callable[P, Awaitable[R]], *args: P.args, **kwargs: P.kwargs
    ) -> R:
        """Acquire once, await ``fn(*args, **kwargs)``, release however it ends; return its result.

        Cancellation included: the lock is released and CancelledError propagates.
        """
        if not callable(fn):
            raise TypeError(f"fn must be a coroutine function, not {type(fn).__name__}")
        async with self.lock(key, ttl):
            return await fn(*args, **kwargs)

    def _decorator(self, locking: Locking) -> AsyncDecorate:
        ttl, wait, options = locking.ttl, locking.wait, locking.options

        def decorate(fn: Callable[P, Awaitable[R]]) -> Callable[P, Coroutine[Any, Any, R]]:
            key_of = locking.keys(fn, coroutine=True)

            @functools.wraps(fn)
            async def locked_call(*args: P.args, **kwargs: P.kwargs) -> R:
                key = key_of(args, kwargs)
                lock = self.lock(key, ttl, **options) if wait is None else self.lock_wait(key, ttl, wait, **options)
                async with lock:
                    return await fn(*args, **kwargs)

            return locked_call

        return decorate

    @takes_method(Cache.lock_many)
    async def lock_many(self, *, keys: Any, ttl: Any, auto_extend: Any, max_hold: Any) -> list[AsyncLock | None]:
        """As hotlock.Cache.lock_many(), awaited: an AsyncLock per key, or None where held
        elsewhere; interrupted (cancelled, or failed), it releases in the background
        whatever it may have taken."""
        taking = self._taking(keys, ttl, auto_extend, max_hold)
        if not taking.names:
            return []
        loop = asyncio.get_running_loop()
        sent = loop.time()
        try:
            results = await self._backend.acquire_many(taking.names, taking.tokens, taking.ttl_ms)
        except BaseException:
            self._release_in_background(taking.names, taking.tokens)
            raise
        locks = taking.leases(
            results, sent, functools.partial(AsyncLock, self._backend, self._release_in_background, loop)
        )
        if auto_extend:
            self._renew([lk for lk in locks if lk is not None], taking.hold_ms)
        return locks

    async def extend_many(self, locks: Iterable[AsyncLock | None], ttl: Seconds) -> list[bool]:
        """As hotlock.Cache.extend_many(), awaited: False where a lock was lost, and for
        ``None``, released or inherited locks (nothing sent for them)."""
        extending = Extending(self._live(locks), ttl)
        if not extending.live:
            return extending.out
        sent = asyncio.get_running_loop().time()
        try:
            results = await self._backend.extend_many(extending.names, extending.tokens, extending.ms)
        except Unreplicated as short:
            return extending.done(short.results, sent, short.why)
        except BaseException:
            # As in AsyncLock.extend: a shorter TTL may be in force now.
            for _, lock in extending.live:
                lock._deadline = min(lock._deadline, sent + extending.ms / 1000.0)
            raise
        return extending.done(results, sent)

    async def unlock_many(self, locks: Iterable[AsyncLock | None]) -> list[bool]:
        """Release each lock in one round trip; True where this call released it. Cancelling
        it still releases them: the release is finished in the background."""
        releasing = Releasing(self._live(locks))
        if not releasing.live:
            return releasing.out
        try:
            results = await self._backend.release_many(releasing.names, releasing.tokens)
        except asyncio.CancelledError:
            releasing.gone()
            self._release_in_background(releasing.names, releasing.tokens)
            raise
        return releasing.done(results)

    # -- idempotency keys and counters -------------------------------------------------

    async def set_nx(self, key: str | bytes, value: str | bytes | int, ttl: Seconds) -> bool:
        """Set ``key`` to ``value`` for ``ttl`` unless it exists; True if this call set it."""
        return await self._backend.set_nx(*self._once(key, value, ttl))

    async def incr(self, key: str | bytes, amount: int = 1) -> int:
        """Add ``amount`` to a counter atomically and return the new value."""
        return await self._backend.incr(*self._counter(key, amount))

    # -- interrupted acquisitions ------------------------------------------------------

    def _release_in_background(self, names: list[bytes], tokens: list[bytes]) -> None:
        """Release tokens without the caller: an interrupted acquire or release, or a
        lease lost in its block (whose LockLost must not wait on the network).

        A task of its own, so the caller's cancellation cannot stop it; kept referenced
        until it ends so it is never collected half-way, and settled by close().
        """
        task = asyncio.get_running_loop().create_task(self._release_quietly(names, tokens))
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    async def _release_quietly(self, names: list[bytes], tokens: list[bytes]) -> None:
        try:
            await self._backend.release_many(names, tokens)
        except Exception as error:
            warn_unreleased(names, error)

    # -- lifetime ---------------------------------------------------------------------

    async def close(self) -> None:
        """Stop the renewer (auto-extended leases then expire by their TTL), give the
        background releases one reply timeout to land, and disconnect."""
        if self._renewer is not None:
            await self._renewer.close()
        if self._background:
            # Let the background releases land before the connection goes, for one reply
            # timeout; those still waiting then (a server that does not answer) are
            # cancelled and their keys left to their TTL.
            pending = set(self._background)
            _, late = await asyncio.wait(pending, timeout=self._reply_timeout)
            for task in late:
                task.cancel()
            if late:
                await asyncio.wait(late)
        await self._backend.close()

    async def __aenter__(self) -> AsyncCache:
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self.close()


class Acquiring:
    """What lock() and lock_wait() return: await it for the AsyncLock, or ``async with`` it.

    Each await is one acquisition with its own token.
    """

    __slots__ = ("_cache", "_held", "_request")

    def __init__(self, cache: AsyncCache, request: Request) -> None:
        self._cache = cache
        self._request = request
        self._held: AsyncLock | None = None

    def __await__(self) -> Generator[Any, None, AsyncLock]:
        return self._cache._acquire(self._request).__await__()

    async def __aenter__(self) -> AsyncLock:
        self._held = await self
        return await self._held.__aenter__()

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        held, self._held = self._held, None
        if held is not None:
            await held.__aexit__(exc_type, exc, tb)
