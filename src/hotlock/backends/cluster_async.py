"""Redis Cluster for hotlock.aio: hotlock.backends.cluster's Route and ClusterCore driven from the loop.

Every rule (slots, MOVED, ASK, TRYAGAIN/CLUSTERDOWN, NOSCRIPT, the one lost-reply retry,
WAIT per shard) is the sync backend's Route; this module only waits differently: each
round sends every node's commands at once (one pipelined call per node, gathered), so a
batch over three shards costs one round trip. A link is one node as a transport reaches
it: the native one is a NativeAsyncBackend (one protocol per node on the loop), the
redis-py one a redis.asyncio pool per node.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Awaitable, Callable, Sequence
from typing import Any, Protocol

from .._config import ServerConfig
from .._scripts import ACQUIRE, EXTEND, RELEASE_SHARDED, SCRIPTS, Script
from ..errors import CacheError, LinkLost, ReplyError, cache_error
from .cluster import MAP_ERRORS, UNSERVED_REFRESH_S, Address, ClusterCore, Route, map_ranges
from .retry_async import InFlight, retry_until
from .wakeup_async import async_cluster_slot

__all__ = ["AsyncClusterBackend", "AsyncLink"]


class AsyncLink(Protocol):
    """One primary: ``link_call`` writes the commands and reads as many replies (errors in
    place as ReplyError), within ``timeout`` s when given; LinkLost when the reply may
    have been lost, CacheError when the node could not be reached (nothing was sent)."""

    async def link_call(self, commands: list[tuple[bytes, ...]], timeout: float | None) -> list[Any]: ...
    async def link_close(self) -> None: ...


class AsyncClusterBackend(ClusterCore):
    """The AsyncBackend protocol on a Redis Cluster, over any transport's async links."""

    def __init__(
        self, config: ServerConfig, name: str, open_link: Callable[[ServerConfig], Awaitable[AsyncLink]]
    ) -> None:
        super().__init__(config, name)
        self._open_link = open_link
        self._links: dict[Address, asyncio.Task[AsyncLink]] = {}
        # Acquires in flight, by token: a release of that token waits for them (InFlight).
        self._inflight = InFlight()
        # The wake-up subscribers (hotlock.backends.wakeup_async): sharded pub/sub, one per primary,
        # made on the first long lock_wait.
        self.wake_slot = async_cluster_slot(config, self.slot_owner)

    @classmethod
    async def open(
        cls, config: ServerConfig, name: str, open_link: Callable[[ServerConfig], Awaitable[AsyncLink]]
    ) -> AsyncClusterBackend:
        backend = cls(config, name, open_link)
        try:
            await backend.refresh()
            for address in backend.map.primaries:
                await backend._link(address)
        except BaseException:
            await backend.close()
            raise
        return backend

    # -- topology ---------------------------------------------------------------------

    async def refresh(self, avoid: Address | None = None) -> None:
        errors = []
        for address in self.map_candidates(avoid):
            try:
                link = await self._link(address)
                shards = (await link.link_call([(b"CLUSTER", b"SHARDS")], None))[0]
                slots = None
                if isinstance(shards, ReplyError):
                    slots = (await link.link_call([(b"CLUSTER", b"SLOTS")], None))[0]
                ranges = map_ranges(shards, lambda slots=slots: slots, self.config.tls)  # type: ignore[misc]
            except MAP_ERRORS as exc:
                errors.append(f"{address[0]}:{address[1]}: {exc or type(exc).__name__}")
                continue
            if not ranges:
                errors.append(f"{address[0]}:{address[1]}: no slots assigned")
                continue
            self.map.replace(ranges)
            return
        raise self.no_map(errors)

    async def _link(self, address: Address) -> AsyncLink:
        task = self._links.get(address)
        if task is None or (task.done() and (task.cancelled() or task.exception() is not None)):
            # One connect per node, shared by every task that needs it; a failed one is retried.
            task = self._links[address] = asyncio.ensure_future(self._open_link(self.config.node(*address)))
        return await asyncio.shield(task)

    # -- routing ------------------------------------------------------------------------

    async def _node(self, address: Address, batch: list[tuple[bytes, ...]], timeout: float | None) -> list[Any]:
        link = await self._link(address)
        return await link.link_call(batch, timeout)

    async def _run(self, route: Route) -> list[Any]:
        try:
            while True:
                if self.map.stale:
                    with contextlib.suppress(CacheError):
                        await self.refresh()
                if route.unserved() is not None and time.monotonic() - self.map.refreshed >= UNSERVED_REFRESH_S:
                    with contextlib.suppress(CacheError):
                        await self.refresh()
                batches = route.batches()
                outcomes = await asyncio.gather(
                    *(self._node(address, batch, route.override) for address, batch in batches),
                    return_exceptions=True,
                )
                for (address, _), outcome in zip(batches, outcomes, strict=True):
                    if isinstance(outcome, (LinkLost, CacheError)):
                        route.lost(address, outcome)
                    elif isinstance(outcome, BaseException):
                        raise outcome
                    else:
                        route.replies(address, outcome)
                pause = route.advance()
                if pause is None:
                    return route.results
                for address in route.reload:
                    await self._load_scripts(address, route.what)
                route.reload.clear()
                if route.refresh_avoiding is not None:
                    with contextlib.suppress(CacheError):
                        await self.refresh(avoid=route.refresh_avoiding)
                    route.refresh_avoiding = None
                if pause:
                    await asyncio.sleep(pause)
        except CacheError:
            keys, values = route.acquired_values()
            if keys:
                with contextlib.suppress(CacheError):
                    await self.release_many(keys, values)
            raise

    async def _load_scripts(self, address: Address, what: str) -> None:
        try:
            replies = await self._node(address, [(b"SCRIPT", b"LOAD", s.source) for s in SCRIPTS], None)
        except LinkLost as exc:
            raise cache_error(f"{what} failed: SCRIPT LOAD on {address[0]}:{address[1]}: {exc}", self.server) from exc
        for reply in replies:
            if isinstance(reply, ReplyError):
                raise cache_error(f"{what} failed: SCRIPT LOAD: the server replied {reply}", self.server)

    async def _scripts(
        self, what: str, script: Script, keys: Sequence[bytes], args: Sequence[tuple[bytes, ...]], until: float | None
    ) -> list[Any]:
        return await self._run(self.route(what, script, keys, args, until))

    @staticmethod
    def _until(since: float | None, wait_ms: int, timeout: float) -> float:
        # Route keeps time.monotonic(); the AsyncBackend contract gives loop time.
        loop = asyncio.get_running_loop()
        return time.monotonic() + (retry_until(since, wait_ms, timeout) - loop.time())

    # -- the AsyncBackend interface ---------------------------------------------------

    async def acquire(
        self,
        key: bytes,
        token: bytes,
        ttl_ms: int,
        since: float | None = None,
        wait_ms: int = 0,
        script: Script = ACQUIRE,
    ) -> int:
        until = self._until(since, wait_ms, self.timeout)
        work = self._scripts("acquire", script, [key], [(token, b"%d" % ttl_ms)], until)
        return int((await self._inflight.shielded([token], work))[0])

    async def acquire_many(self, keys: list[bytes], tokens: list[bytes], ttl_ms: int) -> list[int]:
        ttl = b"%d" % ttl_ms
        until = self._until(None, 0, self.timeout)
        work = self._scripts("acquire_many", ACQUIRE, keys, [(t, ttl) for t in tokens], until)
        return [int(r) for r in await self._inflight.shielded(tokens, work)]

    async def extend(self, key: bytes, token: bytes, ttl_ms: int) -> bool:
        return bool((await self._scripts("extend", EXTEND, [key], [(token, b"%d" % ttl_ms)], None))[0])

    async def extend_many(self, keys: list[bytes], tokens: list[bytes], ttl_ms: int) -> list[bool]:
        ttl = b"%d" % ttl_ms
        return [bool(r) for r in await self._scripts("extend_many", EXTEND, keys, [(t, ttl) for t in tokens], None)]

    async def release(self, key: bytes, token: bytes) -> bool:
        await self._inflight.settled([token])
        work = self._scripts("release", RELEASE_SHARDED, [key], [(token,)], self._until(None, 0, self.timeout))
        return bool((await self._inflight.shielded([token], work))[0])

    async def release_many(self, keys: list[bytes], tokens: list[bytes]) -> list[bool]:
        await self._inflight.settled(tokens)
        work = self._scripts(
            "release_many", RELEASE_SHARDED, keys, [(t,) for t in tokens], self._until(None, 0, self.timeout)
        )
        return [bool(r) for r in await self._inflight.shielded(tokens, work)]

    async def set_nx(self, key: bytes, value: bytes, ttl_ms: int) -> bool:
        command = (b"SET", key, value, b"NX", b"PX", b"%d" % ttl_ms)
        return (await self._run(Route(self, "set_nx", [key], [command], None, False)))[0] is not None

    async def incr(self, key: bytes, amount: int) -> int:
        return int((await self._run(Route(self, "incr", [key], [(b"INCRBY", key, b"%d" % amount)], None, False)))[0])

    async def command_info(self) -> list[object] | None:
        return None  # as in sync: the version decides, and a cluster keeps the scripts

    async def info(self) -> dict[str, str] | None:
        replies = []
        for address in self.map.primaries:
            try:
                replies.append((address, (await self._node(address, [(b"INFO",)], None))[0]))
            except LinkLost as exc:
                raise cache_error(f"INFO on {address[0]}:{address[1]} failed: {exc}", self.server) from exc
        return self.info_summary(replies)

    async def close(self) -> None:
        if self.wake_slot is not None:
            await self.wake_slot.close()
        await self._inflight.close(self.config.timeout)
        tasks = list(self._links.values())
        self._links.clear()
        for task in tasks:
            if task.done() and not task.cancelled() and task.exception() is None:
                await task.result().link_close()
            elif not task.done():
                task.cancel()
