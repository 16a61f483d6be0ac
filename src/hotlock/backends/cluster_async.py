"""Redis Cluster for hotlock.aio: hotlock.backends.cluster's Route and ClusterCore driven from the loop.

Every rule (slots, MOVED, ASK, TRYAGAIN/CLUSTERDOWN, NOSCRIPT, the one lost-reply retry,
WAIT per shard, the acquire as a transaction) is the sync backend's Route; this module only waits differently: each
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

from .._acquire import commands as transaction
from .._acquire import read as read_transaction
from .._acquire import refused_multi
from .._config import ServerConfig
from .._dialect import COMMAND_PROBE, NODE_PROBE
from .._inflight import InFlight
from .._scripts import ACQUIRE, ACQUIRE_POLL, EXTEND, RELEASE_SHARDED, Script, held_value
from ..errors import CacheError, LinkLost, ReplyError, Unreplicated, cache_error
from .cluster import (
    MAP_ERRORS,
    Address,
    ClusterCore,
    Route,
    SlotMap,
    acquired,
    map_ranges,
    needs_slots,
    transaction_form,
)
from .wakeup_async import async_cluster_slot

__all__ = ["AsyncClusterBackend", "AsyncLink"]


class AsyncLink(Protocol):
    """One primary: ``link_call`` writes the commands and reads as many replies (errors in
    place as ReplyError), within ``timeout`` s when given; LinkLost when the reply may
    have been lost, CacheError when the node could not be reached (nothing was sent)."""

    async def link_call(self, commands: list[tuple[bytes, ...]], timeout: float | None) -> list[Any]: ...
    async def link_close(self) -> None: ...
    async def link_drop(self) -> None: ...


# The first round of a call sent outside Route (see Route.handed).
First = tuple[dict[Address, list[int]], list[tuple[Address, Any]]]
# How the transport opens a node's link; and the native one's router of the healthy calls,
# made on the backend and its map (hotlock._native.ClusterRouter).
Opener = Callable[[ServerConfig], Awaitable[AsyncLink]]
Router = Callable[["AsyncClusterBackend", SlotMap], Any]


class AsyncClusterBackend(ClusterCore):
    """The AsyncBackend protocol on a Redis Cluster, over any transport's async links."""

    def __init__(self, config: ServerConfig, name: str, open_link: Opener, router: Router | None = None) -> None:
        super().__init__(config, name)
        self._open_link = open_link
        self._links: dict[Address, asyncio.Task[AsyncLink]] = {}
        # The native transport's node table in C (hotlock._native.ClusterRouter): which
        # open link serves a key while the map is fresh. Not under wait_replicas.
        self._router = None if router is None or config.wait_replicas else router(self, self.map)
        self._numbers: dict[Address, int] = {}  # the router's node number of each address
        if self._router is not None:
            self.map.watch = self._mapped
        # Acquires in flight, by token: a release of that token waits for them (InFlight).
        self._inflight = InFlight()
        # The wake-up subscribers (hotlock.backends.wakeup_async): sharded pub/sub, one per primary,
        # made on the first long lock_wait.
        self.wake_slot = async_cluster_slot(config, self.slot_owner)

    @classmethod
    async def open(
        cls, config: ServerConfig, name: str, open_link: Opener, router: Router | None = None
    ) -> AsyncClusterBackend:
        backend = cls(config, name, open_link, router)
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
        errors: list[str] = []
        for address in self.map_candidates(avoid):
            found: list[tuple[int, int, Address]] | BaseException
            try:
                link = await self._link(address)
                shards = (await link.link_call([(b"CLUSTER", b"SHARDS")], None))[0]
                slots = None
                if needs_slots(shards):
                    slots = (await link.link_call([(b"CLUSTER", b"SLOTS")], None))[0]
                found = map_ranges(shards, lambda slots=slots: slots, self.config.tls, address[0])  # type: ignore[misc]
            except MAP_ERRORS as exc:
                found = exc
            probe = self.took_map(address, found, errors)
            if probe is not None:
                for new in probe:
                    await self._probe(new)
                return
        raise self.no_map(errors)

    async def _probe(self, address: Address) -> None:
        # As in sync: a failed probe leaves the node as it was; no call fails for it.
        try:
            info, commands = await self._node(address, list(NODE_PROBE), None)
        except (LinkLost, CacheError):
            self.unprobed(address)
        else:
            self.probed(address, info, commands)

    async def _link(self, address: Address) -> AsyncLink:
        task = self._links.get(address)
        if task is None or (task.done() and (task.cancelled() or task.exception() is not None)):
            # One connect per node, shared by every task that needs it; a failed one is retried.
            task = self._links[address] = asyncio.ensure_future(self._open_link(self.config.node(*address)))
            if self._router is not None:
                number = self._numbers.setdefault(address, len(self._numbers))
                task.add_done_callback(lambda t: self._opened(number, t))
        return await asyncio.shield(task)

    def _opened(self, number: int, task: asyncio.Task[AsyncLink]) -> None:
        if self._router is not None and not task.cancelled() and task.exception() is None:
            self._router.set_link(number, task.result())

    def _mapped(self, slot_map: SlotMap) -> None:
        # Each address keeps the node number it first got, so the router's links stay put.
        assert self._router is not None
        table = slot_map.node_table(self._numbers)
        links = []
        for address in self._numbers:
            task = self._links.get(address)
            done = task is not None and task.done() and not task.cancelled() and task.exception() is None
            links.append(task.result() if done and task is not None else None)
        self._router.set_map(table, list(self._numbers), links)

    # -- routing ------------------------------------------------------------------------

    async def _node(self, address: Address, batch: list[tuple[bytes, ...]], timeout: float | None) -> list[Any]:
        link = await self._link(address)
        return await link.link_call(batch, timeout)

    async def _run(self, route: Route, first: First | None = None) -> list[Any]:
        """As the sync ClusterBackend._run; ``first``: the first round, when sent outside
        Route by a fast path (_fast, _many)."""
        try:
            while True:
                if first is not None:
                    route.handed(first)
                    first = None
                elif not await self._served(route):
                    continue
                else:
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
                for address in route.reconnect:
                    await (await self._link(address)).link_drop()
                route.reconnect.clear()
                if route.refresh_avoiding is not None:
                    await self._look(route.refresh_avoiding)
                    route.refresh_avoiding = None
                if pause:
                    await asyncio.sleep(pause)
        except CacheError:
            keys, values = route.acquired_values()
            if keys:
                with contextlib.suppress(CacheError):
                    await self.release_many(keys, values)
            raise
        except Unreplicated:
            keys, values = route.unconfirmed_values()
            with contextlib.suppress(CacheError):
                await self.release_many(keys, values)
            raise

    async def _served(self, route: Route) -> bool:
        """As the sync ClusterBackend._served."""
        if self.map.stale:
            await self._look()
        if self.look_again(route):
            await self._look()
        if route.unserved() is not None:
            await asyncio.sleep(route.wait_for_primary())
            return False
        return True

    async def _look(self, avoid: Address | None = None) -> None:
        """As the sync ClusterBackend._look."""
        with contextlib.suppress(CacheError):
            await self.refresh(avoid)

    async def _scripts(
        self, what: str, script: Script, keys: Sequence[bytes], args: Sequence[tuple[bytes, ...]], until: float | None
    ) -> list[Any]:
        return await self._run(self.route(what, script, keys, args, until))

    async def _fast(
        self,
        what: str,
        key: bytes,
        command: tuple[bytes, ...],
        until: float | None,
        wait: bool,
        shield: bytes | None,
        transact: bool = False,
    ) -> Any:
        """One key's command. Where the router knows the key's node and its link, the
        command goes straight to that node's connection (ordered there, as on one server),
        Lua-free where that node has it (ClusterCore.sent_form), an ACQUIRE as the
        transaction where the node takes it (ClusterCore.transacts: SCRIPT sends the script
        there next); a reply that is no error (and, Lua-free, no miss) is the answer.
        Anything else, or no router, goes on under Route, from that first round, behind
        InFlight under the token ``shield``. ``transact``: whether an ACQUIRE may go as the
        transaction (not ACQUIRE_POLL)."""
        first: First | None = None
        sent = command
        found = None if self._router is None else self._router.node(key)
        if found is not None and transact and self.transacts(found[0], command):
            address, link = found
            try:
                four = await link.link_call(list(transaction(key, command[4], int(command[5]))), None)
            except (LinkLost, CacheError) as exc:
                found = None
                sent = transaction_form(key, command[4], command[5])
                first = ({address: [0]}, [(address, exc)])
            else:
                if refused_multi(four, ReplyError):
                    self.refuse_multi(address, str(four[0]))
                outcome = read_transaction(four, ReplyError)
                if isinstance(outcome, BaseException):
                    found = None
                    sent = transaction_form(key, command[4], command[5])
                    first = ({address: [0]}, [(address, four)])
                elif acquired(outcome):
                    return outcome
                # else SCRIPT: the script decides, on the same node, below
        if found is not None:
            address, link = found
            sent = self.sent_form(address, command)
            try:
                reply = await link.link_one(sent)
            except (LinkLost, CacheError) as exc:
                first = ({address: [0]}, [(address, exc)])
            else:
                if sent is command and not isinstance(reply, ReplyError):
                    return reply
                if sent is not command and (reply == b"OK" or reply == 1):
                    return 1  # SET IFEQ's OK, DELIFEQ's or DELEX's 1; a miss goes by script in Route
                first = ({address: [0]}, [(address, [reply])])
        work = self._run(Route(self, what, [key], [sent], until, wait, transact), first)
        return (await (work if shield is None else self._inflight.shielded([shield], work)))[0]

    async def _many(
        self,
        what: str,
        script: Script,
        keys: list[bytes],
        tokens: list[bytes],
        ms: int,
        until: float | None,
        txn: bool = True,
    ) -> list[Any]:
        """A batch of one script (ms -1: no TTL argument): grouped by node in C where the
        router knows every key's node, each node's commands pipelined at once; what is not
        a clean answer goes on under Route from that round. An ACQUIRE goes as the
        transaction where the node takes it (``txn``: not the script's own round after
        it), the keys it answered SCRIPT then as the script, in one more round of this."""
        args = [(t,) if ms < 0 else (t, b"%d" % ms) for t in tokens]
        groups = None if self._router is None else self._router.group(keys)
        if groups is None:
            return await self._scripts(what, script, keys, args, until)
        scripts = [(b"EVALSHA", script.sha, b"1", k, *a) for k, a in zip(keys, args, strict=True)]
        # Each key in the form its node takes (Lua-free extend/release where it can, an
        # acquire as the transaction).
        commands = list(scripts)
        batches = []
        for address, _, idxs in groups:
            batch: list[tuple[bytes, ...]] = []
            for i in idxs:
                if txn and self.transacts(address, scripts[i]):
                    commands[i] = transaction_form(keys[i], tokens[i], args[i][1])
                    batch.extend(transaction(keys[i], tokens[i], ms))
                else:
                    commands[i] = self.sent_form(address, scripts[i])
                    batch.append(commands[i])
            batches.append(batch)
        outcomes = await asyncio.gather(
            *(link.link_call(batch, None) for (_, link, _), batch in zip(groups, batches, strict=True)),
            return_exceptions=True,
        )
        results: list[Any] = [None] * len(keys)
        clean = True
        scripted = []  # the transactions answered SCRIPT
        for (address, _, idxs), outcome in zip(groups, outcomes, strict=True):
            if isinstance(outcome, BaseException):
                if not isinstance(outcome, (LinkLost, CacheError)):
                    raise outcome
                clean = False
                continue
            j = 0
            reply: Any
            for i in idxs:
                if commands[i][0] == b"MULTI":
                    four = outcome[j : j + 4]
                    j += 4
                    if refused_multi(four, ReplyError):
                        self.refuse_multi(address, str(four[0]))
                    reply = read_transaction(four, ReplyError)
                    if not isinstance(reply, BaseException) and not acquired(reply):
                        scripted.append(i)
                        continue
                else:
                    reply = outcome[j]
                    j += 1
                if commands[i] is not scripts[i] and commands[i][0] != b"MULTI":
                    # Lua-free: OK or 1 is done; a miss, or an error, is Route's to finish.
                    clean = clean and (reply == b"OK" or reply == 1)
                    reply = 1
                clean = clean and not isinstance(reply, ReplyError)
                results[i] = reply
        if clean:
            if scripted:
                try:
                    again = await self._many(
                        what, script, [keys[i] for i in scripted], [tokens[i] for i in scripted], ms, until, False
                    )
                except CacheError:
                    # As Route undoes a failed call's acquires: the keys the transactions took.
                    taken = [i for i, r in enumerate(results) if i not in scripted and acquired(r)]
                    if taken:
                        with contextlib.suppress(CacheError):
                            await self.release_many(
                                [keys[i] for i in taken], [held_value(tokens[i], results[i]) for i in taken]
                            )
                    raise
                for i, reply in zip(scripted, again, strict=True):
                    results[i] = reply
            return results
        first = ({a: idxs for a, _, idxs in groups}, [(a, o) for (a, _, _), o in zip(groups, outcomes, strict=True)])
        return await self._run(Route(self, what, keys, commands, until, False), first)

    def _until(self, since: float | None, wait_ms: int) -> float:
        # Route keeps time.monotonic(); the AsyncBackend contract gives loop time.
        ago = 0.0 if since is None else asyncio.get_running_loop().time() - since
        return self.retry_until(wait_ms, time.monotonic() - ago)

    # -- the AsyncBackend interface ---------------------------------------------------

    async def acquire(
        self, key: bytes, token: bytes, ttl_ms: int, since: float | None, wait_ms: int, script: Script
    ) -> int:
        until = self._until(since, wait_ms)
        command = (b"EVALSHA", script.sha, b"1", key, token, b"%d" % ttl_ms)
        transact = script is not ACQUIRE_POLL
        return int(await self._fast("acquire", key, command, until, self.confirms(script), token, transact))

    async def acquire_many(self, keys: list[bytes], tokens: list[bytes], ttl_ms: int) -> list[int]:
        work = self._many("acquire_many", ACQUIRE, keys, tokens, ttl_ms, self.retry_until())
        return [int(r) for r in await self._inflight.shielded(tokens, work)]

    async def extend(self, key: bytes, token: bytes, ttl_ms: int) -> bool:
        command = (b"EVALSHA", EXTEND.sha, b"1", key, token, b"%d" % ttl_ms)
        return bool(await self._fast("extend", key, command, None, self.confirms(EXTEND), None))

    async def extend_many(self, keys: list[bytes], tokens: list[bytes], ttl_ms: int) -> list[bool]:
        return [bool(r) for r in await self._many("extend_many", EXTEND, keys, tokens, ttl_ms, None)]

    async def release(self, key: bytes, token: bytes) -> bool:
        await self._inflight.settled([token])
        until = self.retry_until()
        command = (b"EVALSHA", RELEASE_SHARDED.sha, b"1", key, token)
        return bool(await self._fast("release", key, command, until, False, token))

    async def release_many(self, keys: list[bytes], tokens: list[bytes]) -> list[bool]:
        await self._inflight.settled(tokens)
        work = self._many("release_many", RELEASE_SHARDED, keys, tokens, -1, self.retry_until())
        return [bool(r) for r in await self._inflight.shielded(tokens, work)]

    async def set_nx(self, key: bytes, value: bytes, ttl_ms: int) -> bool:
        command = (b"SET", key, value, b"NX", b"PX", b"%d" % ttl_ms)
        return await self._fast("set_nx", key, command, None, False, None) is not None

    async def incr(self, key: bytes, amount: int) -> int:
        command = (b"INCRBY", key, b"%d" % amount)
        return int(await self._fast("incr", key, command, None, False, None))

    async def command_info(self) -> list[object] | None:
        return None  # as in sync: each primary was asked with its INFO; use_dialect decides per node

    async def info(self) -> dict[str, str] | None:
        replies = []
        for address in self.map.primaries:
            try:
                info, commands = await self._node(address, [(b"INFO",), COMMAND_PROBE], None)
            except LinkLost as exc:
                raise cache_error(f"INFO on {address[0]}:{address[1]} failed: {exc}", self.server) from exc
            replies.append((address, info))
            self.probed(address, info, commands)
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
