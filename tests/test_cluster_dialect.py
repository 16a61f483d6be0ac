"""Lua-free extend and release on a Redis Cluster, decided per primary.

Against real clusters of valkey-server and redis-server processes (tests/cluster.py):
three Valkey 9 primaries (every node Lua-free); a mixed cluster of one Redis 7.0, one
Valkey 9 and one Valkey 9 whose DELIFEQ is renamed away (a rolling upgrade as the client
sees it: each node on what its own probe shows); a node that loses DELIFEQ while the
client runs (restarted with the rename, its nodes.conf and AOF kept); and a primary that
joins the cluster after connect. What each node ran is counted by the node (INFO
commandstats), on the sync and the async API, native and redis-py.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Iterator
from typing import Any, TypeVar

import pytest
import redis

import hotlock
import hotlock.aio
from hotlock.backends.cluster import key_slot

from .cluster import Cluster, start_cluster
from .conftest import RedisServer, lock_name, start_redis
from .test_cluster import keys_on
from .test_wakeups import HOLD_S, WOKEN_ROUNDS, assert_woken, async_handoffs, handoffs

BACKENDS = ["native", "redis-py"]
APIS = ["sync", "async"]
T = TypeVar("T")
RENAMED = ("--rename-command", "DELIFEQ", "")
LUA_FREE = "Lua-free extend/release (SET IFEQ, DELIFEQ)"


@pytest.fixture(scope="module")
def valkey_cluster() -> Iterator[Cluster]:
    cluster = start_cluster(3, 0, kinds=["valkey"] * 3)
    yield cluster
    cluster.stop()


@pytest.fixture(scope="module")
def mixed_cluster() -> Iterator[Cluster]:
    """Redis 7.0, Valkey 9, and Valkey 9 without DELIFEQ: one cluster (they form one)."""
    cluster = start_cluster(3, 0, kinds=["redis", "valkey", "valkey"], extra=[(), (), RENAMED])
    yield cluster
    cluster.stop()


def stats(cluster: Cluster, port: int) -> dict[str, int]:
    """The node's calls per command (scripts' own calls included) and its error counts."""
    client = cluster.client(port)
    out = {k.removeprefix("cmdstat_"): int(v["calls"]) for k, v in client.info("commandstats").items()}
    out |= {k: int(v["count"]) for k, v in client.info("errorstats").items()}
    return out


def reset(cluster: Cluster) -> None:
    for port in cluster.primary_ports():
        cluster.client(port).flushall()
        cluster.client(port).config_resetstat()


def wait_for(runner: asyncio.Runner, awaitable: Awaitable[T]) -> T:
    """``awaitable`` on the runner's loop (an Acquiring is awaitable, not a coroutine)."""

    async def main() -> T:
        return await awaitable

    return runner.run(main())


def node_of(cluster: Cluster, port: int) -> RedisServer:
    return next(n for n in cluster.nodes if n.port == port)


def exercise(cache: hotlock.Cache, keys: dict[int, list[str]]) -> None:
    """On every primary: one lock extended and released alone, one in a batch; each
    released twice (the second finds nothing). Results as on one server, any path."""
    for single, _ in keys.values():
        lock = cache.lock(single, ttl=5)
        lock.extend(10)
        assert lock.unlock() is True
        assert lock.unlock() is False
    locks = cache.lock_many([k for _, k in keys.values()], ttl=5)
    assert cache.extend_many(locks, 10) == [True] * len(keys)
    assert cache.unlock_many(locks) == [True] * len(keys)


async def aexercise(cache: hotlock.aio.AsyncCache, keys: dict[int, list[str]]) -> None:
    for single, _ in keys.values():
        lock = await cache.lock(single, ttl=5)
        await lock.extend(10)
        assert await lock.unlock() is True
        assert await lock.unlock() is False
    locks = await cache.lock_many([k for _, k in keys.values()], ttl=5)
    assert await cache.extend_many(locks, 10) == [True] * len(keys)
    assert await cache.unlock_many(locks) == [True] * len(keys)


def run(api: str, backend: str, url: str, keys: dict[int, list[str]], cluster: Cluster, **kw: Any) -> dict[str, Any]:
    """Connect, reset every node's counters, exercise; the cache's server_info."""
    if api == "sync":
        with hotlock.connect(url, backend=backend, **kw) as cache:
            reset(cluster)
            exercise(cache, keys)
            return dict(cache.server_info)

    async def main() -> dict[str, Any]:
        async with await hotlock.aio.connect(url, backend=backend, **kw) as acache:
            reset(cluster)
            await aexercise(acache, keys)
            return dict(acache.server_info)

    return asyncio.run(main())


def expect_lua_free(got: dict[str, int]) -> None:
    # Per node: 2 acquires (transactions: EXEC, with SET and TIME inside), 2 SET IFEQ, 2
    # DELIFEQ; no script at all.
    assert got.get("evalsha", 0) == 0, got
    assert got.get("exec") == got.get("time") == 2, got
    assert got.get("set") == 2 + 2, got
    assert got.get("delifeq") == 2, got
    assert got.get("pexpire", 0) == got.get("del", 0) == 0, got


def expect_scripts(got: dict[str, int], transaction: bool = True) -> None:
    # Per node: extend and release of 2 locks, EVALSHA (PEXPIRE and DEL inside); the 2
    # acquires transactions (EXEC) but under scripts="always" (EVALSHA), a SET each.
    assert got.get("evalsha") == (4 if transaction else 6), got
    assert got.get("exec", 0) == (2 if transaction else 0), got
    assert got.get("set") == 2, got
    assert got.get("pexpire") == got.get("del") == 2, got
    assert got.get("delifeq", 0) == 0, got


@pytest.mark.parametrize("scripts", ["auto", "always"])
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("api", APIS)
def test_every_valkey_primary_takes_the_lua_free_forms(
    valkey_cluster: Cluster, api: str, backend: str, scripts: str
) -> None:
    """Valkey 9 everywhere: the acquire is the transaction, extend SET IFEQ and release
    DELIFEQ on every primary, no EVALSHA at all; scripts="always" keeps every node on the
    scripts."""
    ports = valkey_cluster.primary_ports()
    keys = {p: keys_on(valkey_cluster, p, 2, prefix=f"vk-{api}-{backend}-") for p in ports}
    info = run(api, backend, valkey_cluster.url, keys, valkey_cluster, scripts=scripts)
    named = node_of(valkey_cluster, ports[0]).named
    lua_free = scripts == "auto"
    assert info["lua_free"] is lua_free
    assert (info["extend"], info["release"]) == (("SET IFEQ", "DELIFEQ") if lua_free else ("script", "script"))
    assert set(info["nodes"]) == {f"127.0.0.1:{p}" for p in ports}
    for port in ports:
        described = info["nodes"][f"127.0.0.1:{port}"]
        if lua_free:
            assert described == f"{named}, {LUA_FREE}"
            expect_lua_free(stats(valkey_cluster, port))
        else:
            assert described == f"{named}, extend/release by script (connect(scripts='always'))"
            expect_scripts(stats(valkey_cluster, port), transaction=False)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("api", APIS)
def test_a_mixed_cluster_goes_lua_free_only_where_the_node_can(mixed_cluster: Cluster, api: str, backend: str) -> None:
    """A rolling upgrade half done: the Valkey 9 node gets SET IFEQ and DELIFEQ, the Redis
    7.0 node and the Valkey 9 whose COMMAND INFO has no DELIFEQ get the scripts; the same
    calls give the same results on all three, and server_info says which node does what."""
    redis7, valkey, renamed = (n.port for n in mixed_cluster.nodes)
    keys = {p: keys_on(mixed_cluster, p, 2, prefix=f"mix-{api}-{backend}-") for p in (redis7, valkey, renamed)}
    info = run(api, backend, mixed_cluster.url, keys, mixed_cluster)
    assert info["lua_free"] is False
    assert info["extend"] == info["release"] == "per node"
    assert "1 of 3 primaries Lua-free" in str(info["reason"])
    nodes = info["nodes"]
    assert nodes[f"127.0.0.1:{valkey}"] == f"{node_of(mixed_cluster, valkey).named}, {LUA_FREE}"
    assert nodes[f"127.0.0.1:{redis7}"].startswith(f"{node_of(mixed_cluster, redis7).named}, extend/release by script")
    assert nodes[f"127.0.0.1:{renamed}"] == (
        f"{node_of(mixed_cluster, renamed).named}, extend/release by script (no DELIFEQ, from COMMAND INFO)"
    )
    expect_lua_free(stats(mixed_cluster, valkey))
    expect_scripts(stats(mixed_cluster, redis7))
    renamed_stats = stats(mixed_cluster, renamed)
    expect_scripts(renamed_stats)
    assert renamed_stats.get("errorstat_ERR", 0) == 0  # never tried there: the probe said so


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("api", APIS)
def test_a_lua_free_release_still_wakes_the_waiters_on_a_cluster(
    valkey_cluster: Cluster, api: str, backend: str
) -> None:
    """A waiter marks the lock: DELIFEQ misses the marked value, the release goes again as
    the sharded script, which deletes it and SPUBLISHes on the lock's shard: the waiter is
    woken (a handoff well under the backoff's cap), as with scripts alone."""
    reset(valkey_cluster)
    port = valkey_cluster.primary_ports()[0]
    key = keys_on(valkey_cluster, port, 1, prefix=f"wake-{api}-{backend}-")[0]
    before: dict[str, int] = {}
    if api == "sync":
        with hotlock.connect(valkey_cluster.url, backend=backend) as cache:
            assert cache.server_info["lua_free"] is True
            handoffs(cache, cache, key, 1, 0.05)
            before |= stats(valkey_cluster, port)
            took = handoffs(cache, cache, key, WOKEN_ROUNDS, HOLD_S)
    else:

        async def main() -> list[float]:
            async with await hotlock.aio.connect(valkey_cluster.url, backend=backend) as acache:
                assert acache.server_info["lua_free"] is True
                await async_handoffs(acache, acache, key, 1, 0.05)
                before.update(stats(valkey_cluster, port))
                return await async_handoffs(acache, acache, key, WOKEN_ROUNDS, HOLD_S)

        took = asyncio.run(main())
    assert_woken(took, (api, backend))
    after = stats(valkey_cluster, port)
    # Each round: the holder's release of a marked lock (a DELIFEQ miss, then the script
    # that announces it) and the waiter's own unmarked release (DELIFEQ, done).
    assert after["spublish"] - before.get("spublish", 0) >= WOKEN_ROUNDS
    assert after["delifeq"] - before.get("delifeq", 0) >= 2 * WOKEN_ROUNDS
    assert after.get("publish", 0) == 0


def test_a_node_that_loses_delifeq_in_place_goes_back_to_the_scripts() -> None:
    """A node detected Lua-free is restarted (nodes.conf and AOF kept: the locks on it
    survive) with DELIFEQ renamed away. The next release there is refused as an unknown
    command once per cache, goes again by script with the same value (released: True,
    never "not held"), and from then on that node gets the scripts; the others stay
    Lua-free. On every backend, sync and async."""
    durable = ("--appendonly", "yes", "--appendfsync", "always")
    cluster = start_cluster(3, 0, kinds=["valkey"] * 3, extra=[durable] * 3)
    runner = asyncio.Runner()
    caches: list[hotlock.Cache] = []
    acaches: list[hotlock.aio.AsyncCache] = []
    try:
        target, other = cluster.primary_ports()[:2]
        where = f"127.0.0.1:{target}"
        for backend in BACKENDS:
            caches.append(hotlock.connect(cluster.url, backend=backend))
            acaches.append(wait_for(runner, hotlock.aio.connect(cluster.url, backend=backend)))
        names = keys_on(cluster, target, 2 * (len(caches) + len(acaches)), prefix="dg-")
        on_other = keys_on(cluster, other, len(caches) + len(acaches), prefix="dg-other-")
        held = [c.lock(names[i], ttl=60) for i, c in enumerate(caches)]
        aheld = [wait_for(runner, a.lock(names[len(caches) + i], ttl=60)) for i, a in enumerate(acaches)]
        infos = [c.server_info for c in caches] + [a.server_info for a in acaches]
        assert all(LUA_FREE in str(info["nodes"][where]) for info in infos)  # type: ignore[index]

        node = node_of(cluster, target)
        assert node.proc is not None
        node.proc.terminate()
        node.proc.wait(10)
        cluster.restart(target, *RENAMED)
        cluster.wait_ok()
        with pytest.raises(redis.ResponseError, match="unknown command"):
            node.client().execute_command("DELIFEQ", "dg-probe", "x")
        node.client().config_resetstat()
        assert all(node.client().exists(lock_name(k)) for k in names[: len(held) + len(aheld)])

        # The release the node refuses: by script, the same value, released.
        assert [lk.unlock() for lk in held] == [True] * len(held)
        assert [wait_for(runner, lk.unlock()) for lk in aheld] == [True] * len(aheld)
        assert not any(node.client().exists(lock_name(k)) for k in names[: len(held) + len(aheld)])
        refused = stats(cluster, target)
        assert refused.get("errorstat_ERR") == len(held) + len(aheld)  # one unknown DELIFEQ per cache
        for info in [c.server_info for c in caches] + [a.server_info for a in acaches]:
            nodes: Any = info["nodes"]
            assert "downgraded in place" in nodes[where]
            assert LUA_FREE in nodes[f"127.0.0.1:{other}"]

        # From then on, the scripts there: no SET IFEQ, no DELIFEQ tried, no error.
        start = len(held) + len(aheld)
        for i, c in enumerate(caches):
            lock = c.lock(names[start + i], ttl=5)
            lock.extend(10)
            assert lock.unlock() is True
        for i, a in enumerate(acaches):

            async def cycle(a: hotlock.aio.AsyncCache = a, name: str = names[start + len(caches) + i]) -> bool:
                lock = await a.lock(name, ttl=5)
                await lock.extend(10)
                return await lock.unlock()

            assert runner.run(cycle()) is True
        later = stats(cluster, target)
        n = len(caches) + len(acaches)
        assert later.get("errorstat_ERR") == n  # none more
        assert later.get("set", 0) - refused.get("set", 0) == n  # the acquires' own SET only
        assert later.get("pexpire", 0) - refused.get("pexpire", 0) == n  # each extend by script
        assert later.get("del", 0) - refused.get("del", 0) == n  # each release by script

        # The other nodes stay Lua-free.
        before = stats(cluster, other)
        for i, c in enumerate(caches):
            lock = c.lock(on_other[i], ttl=5)
            lock.extend(10)
            assert lock.unlock() is True
        after = stats(cluster, other)
        assert after.get("delifeq", 0) - before.get("delifeq", 0) == len(caches)
        assert after.get("pexpire", 0) == before.get("pexpire", 0)
    finally:
        for c in caches:
            c.close()
        for a in acaches:
            wait_for(runner, a.close())
        runner.close()
        cluster.stop()


def test_a_primary_that_joins_after_connect_gets_its_own_dialect() -> None:
    """A cluster of Redis 7.0 primaries (scripts) gains a Valkey 9 primary after the cache
    connected, and a slot moves to it: the MOVED refreshes the map, the new node is
    probed, and the locks in that slot go Lua-free there while the old nodes keep the
    scripts."""
    cluster = start_cluster(3, 0)
    joined: RedisServer | None = None
    try:
        with (
            hotlock.connect(cluster.url, backend="native") as cache,
            hotlock.connect(cluster.url, backend="redis-py") as pycache,
        ):
            assert cache.server_info["lua_free"] is False
            old = cluster.primary_ports()[0]
            joined = start_redis(
                "--cluster-enabled", "yes", "--cluster-node-timeout", "2000", "--cluster-require-full-coverage",
                "no", kind="valkey",
            )  # fmt: skip
            cluster.nodes.append(joined)
            cluster.client(old).execute_command("CLUSTER", "MEET", "127.0.0.1", joined.port)
            deadline = time.monotonic() + 20
            joined_id = cluster.node_id(joined.port).encode()
            # Every node must know it before a slot can move to it (SETSLOT NODE names its id).
            while len(joined.client().execute_command("CLUSTER", "NODES").decode().splitlines()) < 4 or not all(
                joined_id in n.client().execute_command("CLUSTER", "NODES") for n in cluster.nodes
            ):
                assert time.monotonic() < deadline, "the new node never joined"
                time.sleep(0.05)
            key = keys_on(cluster, old, 1, prefix="joins-")[0]
            slot = key_slot(lock_name(key))
            cluster.move_slot(slot, joined.port)
            cluster.wait_ok()
            for c in (cache, pycache):
                lock = c.lock(key, ttl=5)  # MOVED: the map is asked again, the new node probed
                before = stats(cluster, joined.port)
                lock.extend(10)
                assert lock.unlock() is True
                after = stats(cluster, joined.port)
                assert after.get("delifeq", 0) - before.get("delifeq", 0) == 1
                assert after.get("evalsha", 0) == before.get("evalsha", 0)
                nodes: Any = c.server_info["nodes"]
                assert nodes[f"127.0.0.1:{joined.port}"] == f"{joined.named}, {LUA_FREE}"
                assert "by script" in nodes[f"127.0.0.1:{old}"]
    except redis.RedisError as exc:
        pytest.fail(f"setting up the joining node failed: {exc}")
    finally:
        cluster.stop()
