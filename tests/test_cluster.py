"""Redis Cluster beyond the behaviour suite (which runs on the cluster too: test_behaviour's
[backend-cluster-redis] and [backend-cluster-valkey] ids): routing, batches over every
shard, MOVED, ASK, a lost reply, a killed primary and exclusion across shards, on every
sync backend, against the real clusters of tests/cluster.py: the session's cluster of each
server kind (Redis 7.0 nodes: every call a script; Valkey 9 nodes: extend and release
Lua-free, SET IFEQ and DELIFEQ), which the ids name (test_x[native-cluster-valkey]).

The fault tests reach one node through tests/faultproxy.py: the slot map keeps the
node's real address (what the cluster announces) and the test's link opener connects to
the proxy in its place, so the routing under test is the real one.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
import signal
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import redis

import hotlock
import hotlock.aio
from hotlock import Cache, CacheError, LockNotAcquired
from hotlock._config import ServerConfig, parse_url
from hotlock._dialect import commands_from, detect, probe_needed
from hotlock.aio import AsyncCache
from hotlock.backends.cluster import ClusterBackend, Link, crc16, key_slot
from hotlock.backends.cluster_async import AsyncClusterBackend, AsyncLink
from hotlock.backends.native import native_aio, native_module

from .cluster import Cluster, start_cluster
from .conftest import RedisServer, lock_name
from .faultproxy import FaultProxy
from .overlap import OverlapChecker

# rcache here is always the cluster's (ids test_x[native-cluster]).
pytestmark = pytest.mark.topologies("cluster")


def opener(backend: str) -> Callable[[ServerConfig], Link]:
    if backend.startswith("native"):
        native, why = native_module()
        if native is None:
            pytest.fail(f"the native backend is not live: {why}")
        return native.NativeBackend  # type: ignore[no-any-return]
    from hotlock.backends.redispy import RedisPyLink

    return RedisPyLink


def routed_cache(url: str, backend: str, proxies: dict[int, FaultProxy], timeout: float = 0.5) -> Cache:
    """A cache on the cluster whose links to the nodes in ``proxies`` go through them."""
    config = parse_url(url, connect_timeout=timeout, timeout=timeout)
    base = opener(backend)

    def open_link(node: ServerConfig) -> Link:
        proxy = proxies.get(node.port)
        return base(node if proxy is None else node.node("127.0.0.1", proxy.port))

    opened = ClusterBackend(
        config, backend[:6] if backend.startswith("native") else backend, open_link, router(backend)
    )
    # Each primary's dialect, asked as connect() asks it: on Valkey nodes extend and release
    # then go Lua-free, the path a real cache takes there (a backend nobody told keeps every
    # node on the scripts).
    info = opened.info()
    opened.use_dialect(
        detect(info, commands_from(opened.command_info()) if probe_needed(info, "auto") else None, "auto")
    )
    return Cache(opened, b"hotlock:")


def router(backend: str) -> object:
    """'native-c': the native links with the extension's fast path (what connect() makes);
    'native': the same links routed by Route alone."""
    if backend != "native-c":
        return None
    native, why = native_module()
    if native is None:
        pytest.fail(f"the native backend is not live: {why}")
    return native.ClusterRouter


def keys_on(cluster: Cluster, port: int, n: int, prefix: str = "k") -> list[str]:
    """``n`` user keys whose locks live on the primary at ``port``."""
    found = []
    i = 0
    while len(found) < n:
        key = f"{prefix}{i}"
        if cluster.owner_of(lock_name(key)) == port:
            found.append(key)
        i += 1
    return found


def calls(client: redis.Redis, command: str) -> int:
    """How many times the node ran ``command`` (a script's own calls included)."""
    stats = client.info("commandstats")
    return int(stats.get(f"cmdstat_{command}", {}).get("calls", 0))


def node_calls(client: redis.Redis, *commands: str) -> tuple[int, ...]:
    """How many times the node ran each of ``commands``, read at once."""
    stats = client.info("commandstats")
    return tuple(int(stats.get(f"cmdstat_{c}", {}).get("calls", 0)) for c in commands)


def evalsha_calls(client: redis.Redis) -> int:
    return calls(client, "evalsha")


def release_command(cluster: Cluster) -> str:
    """What a release runs on this cluster's primaries: DELIFEQ on Valkey 9, the script on Redis 7.0."""
    return "delifeq" if cluster.nodes[0].lua_free else "evalsha"


# -- the transaction acquire (hotlock._acquire) ---------------------------------------


def test_a_free_key_is_taken_without_a_script(rcache: Cache, redis_cluster: Cluster) -> None:
    """On every primary the acquire of a free key is one transaction on the key's own node
    (EXEC once, no EVALSHA), alone and in a batch over every shard (one pipeline of
    transactions per node); the fence is that node's clock, the stored value the token."""
    for port in redis_cluster.primary_ports():
        client = redis_cluster.client(port)
        key = keys_on(redis_cluster, port, 1, "txn")[0]
        before = node_calls(client, "evalsha", "exec")
        seconds, micros = client.time()
        lock = rcache.lock(key, ttl=10)
        assert node_calls(client, "evalsha", "exec") == (before[0], before[1] + 1), port
        assert client.get(lock_name(key)) == lock._token and len(lock._token) == 16
        assert 0 <= lock.fence - (seconds * 1_000_000 + micros) < 5_000_000
        assert lock.unlock() is True
    keys = {p: keys_on(redis_cluster, p, 3, "txnb") for p in redis_cluster.primary_ports()}
    before = {p: node_calls(redis_cluster.client(p), "evalsha", "exec") for p in keys}
    locks = rcache.lock_many([k for ks in keys.values() for k in ks], ttl=10)
    assert all(lock is not None for lock in locks)
    for port in keys:
        evalsha, execs = node_calls(redis_cluster.client(port), "evalsha", "exec")
        assert (evalsha, execs) == (before[port][0], before[port][1] + 3), port
    assert all(rcache.unlock_many(locks))  # type: ignore[arg-type]


@pytest.mark.parametrize("backend", ["native", "redis-py"])
def test_async_a_free_key_is_taken_without_a_script(backend: str, cluster_url: str, redis_cluster: Cluster) -> None:
    """As the sync test, on hotlock.aio: one key (the router's fast path on the native
    backend, Route on redis-py) and a batch over every shard."""
    keys = {p: keys_on(redis_cluster, p, 2, "atxn") for p in redis_cluster.primary_ports()}
    before = {p: node_calls(redis_cluster.client(p), "evalsha", "exec") for p in keys}

    async def main() -> None:
        async with await hotlock.aio.connect(cluster_url, backend=backend) as cache:
            singles = [await cache.lock(ks[0], ttl=10) for ks in keys.values()]
            locks = await cache.lock_many([ks[1] for ks in keys.values()], ttl=10)
            assert all(lock is not None for lock in locks)
            for port in keys:
                evalsha, execs = node_calls(redis_cluster.client(port), "evalsha", "exec")
                assert (evalsha, execs) == (before[port][0], before[port][1] + 2), port
            for lock in singles:
                assert await lock.unlock() is True
            assert await cache.unlock_many(locks) == [True] * len(locks)  # type: ignore[arg-type]

    asyncio.run(main())


def test_a_held_key_goes_on_to_the_script(rcache: Cache, redis_cluster: Cluster) -> None:
    """A key held by another: the transaction finds it (SET NX), and the script on the same
    node decides, as before: -its TTL (LockNotAcquired with retry_after), alone and in a
    batch whose other keys are taken; a key held as permits is the kind conflict."""
    port = redis_cluster.primary_ports()[0]
    client = redis_cluster.client(port)
    key, permits = keys_on(redis_cluster, port, 2, "held")
    holder = rcache.lock(key, ttl=10)
    before = node_calls(client, "evalsha", "exec")
    with pytest.raises(LockNotAcquired) as caught:
        rcache.lock(key, ttl=5)
    assert caught.value.retry_after is not None and 9 < caught.value.retry_after <= 10
    assert node_calls(client, "evalsha", "exec") == (before[0] + 1, before[1] + 1)  # the transaction, then the script
    ttl = rcache._backend.acquire(lock_name(key), b"r" * 16, 5000)  # type: ignore[attr-defined]
    assert -10_000 <= ttl < -9_000
    others = [keys_on(redis_cluster, p, 1, "heldb")[0] for p in redis_cluster.primary_ports() if p != port]
    locks = rcache.lock_many([key, *others], ttl=5)
    assert locks[0] is None and all(lock is not None for lock in locks[1:])
    assert all(rcache.unlock_many(locks[1:]))  # type: ignore[arg-type]
    assert holder.unlock() is True
    with rcache.lock(permits, ttl=10, limit=2), pytest.raises(LockNotAcquired, match="held with a concurrency limit"):
        rcache.lock(permits, ttl=5)
    assert client.exists(lock_name(key)) == 0  # (the permits' hash keeps its last fence until its TTL)


@pytest.mark.parametrize("api", ["sync", "async"])
def test_a_node_that_refuses_multi_takes_its_acquires_by_script(
    redis_backend: str, api: str, cluster_url: str, redis_cluster: Cluster, caplog: pytest.LogCaptureFixture
) -> None:
    """A user whose ACL has no MULTI and EXEC: the first acquire on each node finds MULTI
    refused (its SET ran alone), goes by script, which finds its own token, and holds the
    lock; a WARNING names the node once per cache; later acquires there send no MULTI at
    all. The first call a single acquire on each node, or a batch over every shard."""
    from .test_security import PASSWORD, USER, acl_line, listed

    # The script that finds its own token (the SET ran alone) refreshes its TTL: PEXPIRE,
    # which the Lua-free list leaves out (a Lua-free extend is SET IFEQ).
    listing = listed(redis_cluster.nodes[0].kind, "auto") + CLUSTER_COMMANDS + ["+pexpire"]
    commands = [c for c in dict.fromkeys(listing) if c not in ("+multi", "+exec")]
    for node in redis_cluster.nodes:
        node.client().execute_command("ACL", "SETUSER", USER, "reset", *acl_line(commands))
    url = cluster_url.replace("redis+cluster://", f"redis+cluster://{USER}:{PASSWORD}@")
    ports = redis_cluster.primary_ports()
    keys = {p: keys_on(redis_cluster, p, 4, f"nomulti-{api}-") for p in ports}
    batched = {p: keys_on(redis_cluster, p, 2, f"nomultib-{api}-") for p in ports}

    def stored(port: int, key: str) -> bytes | None:
        return redis_cluster.client(port).get(lock_name(key))  # type: ignore[no-any-return]

    try:
        with caplog.at_level(logging.WARNING, logger="hotlock"):
            if api == "sync":
                with hotlock.connect(url, backend=redis_backend) as cache:
                    for port, (first, _, _, _) in keys.items():
                        with cache.lock(first, ttl=10) as lock:
                            assert stored(port, first) == lock._token
                    refused = {p: errors(redis_cluster.client(p)) for p in ports}
                    for _, second, _, _ in keys.values():
                        with cache.lock(second, ttl=10):
                            pass
                    locks = cache.lock_many([k for ks in keys.values() for k in ks[2:]], ttl=10)
                    assert all(lock is not None for lock in locks)
                    assert all(cache.unlock_many(locks))  # type: ignore[arg-type]
                    assert {p: errors(redis_cluster.client(p)) for p in ports} == refused  # no MULTI again
                with hotlock.connect(url, backend=redis_backend) as cache:
                    locks = cache.lock_many([k for ks in batched.values() for k in ks], ttl=10)
                    assert all(lock is not None for lock in locks)
                    assert all(cache.unlock_many(locks))  # type: ignore[arg-type]
            else:

                async def main() -> None:
                    async with await hotlock.aio.connect(url, backend=redis_backend) as cache:
                        for port, (first, _, _, _) in keys.items():
                            lock = await cache.lock(first, ttl=10)
                            assert stored(port, first) == lock._token
                            assert await lock.unlock() is True
                        refused = {p: errors(redis_cluster.client(p)) for p in ports}
                        for _, second, _, _ in keys.values():
                            assert await (await cache.lock(second, ttl=10)).unlock() is True
                        locks = await cache.lock_many([k for ks in keys.values() for k in ks[2:]], ttl=10)
                        assert all(lock is not None for lock in locks)
                        assert all(await cache.unlock_many(locks))  # type: ignore[arg-type]
                        assert {p: errors(redis_cluster.client(p)) for p in ports} == refused
                    async with await hotlock.aio.connect(url, backend=redis_backend) as cache:
                        locks = await cache.lock_many([k for ks in batched.values() for k in ks], ttl=10)
                        assert all(lock is not None for lock in locks)
                        assert all(await cache.unlock_many(locks))  # type: ignore[arg-type]

                asyncio.run(main())
        warned = [r.getMessage() for r in caplog.records if "refused MULTI" in r.getMessage()]
        assert sorted(int(w.split(" ")[0].rpartition(":")[2]) for w in warned) == sorted(ports * 2), warned
    finally:
        for node in redis_cluster.nodes:
            node.client().execute_command("ACL", "DELUSER", USER)


@pytest.mark.parametrize("api", ["sync", "async"])
def test_a_lock_waits_polls_go_by_script(
    redis_backend: str, api: str, cluster_url: str, redis_cluster: Cluster
) -> None:
    """lock_wait without wake-ups on a held key: the first attempt is the transaction, every
    poll after it the script alone (a key found held is likely held still)."""
    port = redis_cluster.primary_ports()[0]
    client = redis_cluster.client(port)
    key = keys_on(redis_cluster, port, 1, f"poll-{api}-")[0]
    with hotlock.connect(cluster_url, backend=redis_backend) as holder, holder.lock(key, ttl=10):
        before = node_calls(client, "exec", "evalsha")
        if api == "sync":
            with (
                hotlock.connect(cluster_url, backend=redis_backend, wakeups=False) as cache,
                pytest.raises(LockNotAcquired),
            ):
                cache.lock_wait(key, ttl=5, wait=0.3)
        else:

            async def main() -> None:
                async with await hotlock.aio.connect(cluster_url, backend=redis_backend, wakeups=False) as cache:
                    with pytest.raises(LockNotAcquired):
                        await cache.lock_wait(key, ttl=5, wait=0.3)

            asyncio.run(main())
        execs, scripts = (a - b for a, b in zip(node_calls(client, "exec", "evalsha"), before, strict=True))
        assert execs == 1 and scripts >= 3, (execs, scripts)  # the first attempt's script after its EXEC, then polls


def errors(client: redis.Redis) -> int:
    """Every error reply the node has given (INFO errorstats)."""
    return sum(int(v["count"]) for v in client.info("errorstats").values())


# -- routing ---------------------------------------------------------------------------


def test_key_slot_matches_the_server(redis_cluster: Cluster) -> None:
    client = redis_cluster.client(redis_cluster.primary_ports()[0])
    keys = [b"", b"a", b"foo", b"{user1000}.following", b"foo{}{bar}", b"foo{{bar}}zap", b"foo{bar}{zap}"]
    keys += [b"{}", b"}{", b"x}{y}", bytes(range(256)), "ключ".encode(), lock_name("tenant-7}:job")]
    keys += [b"hotlock:lock:{k%d}" % i for i in range(200)]
    for key in keys:
        assert key_slot(key) == client.execute_command("CLUSTER", "KEYSLOT", key), key


def test_the_extension_hashes_slots_as_python_and_the_server(redis_cluster: Cluster) -> None:
    """The C CRC16 and key slot (hotlock._native) against the Python ones and CLUSTER
    KEYSLOT: random bytes, and random keys built around braces (tags, empty tags, a '}'
    before the '{', nested and unclosed ones)."""
    native, why = native_module()
    if native is None:
        pytest.fail(f"the native backend is not live: {why}")
    client = redis_cluster.client(redis_cluster.primary_ports()[0])
    rng = random.Random(1021)
    parts = [b"{", b"}", b"{}", b"}{", b"a", b"tag", b"\x00", b"\xff", "ключ".encode(), b""]
    keys = [rng.randbytes(rng.randrange(0, 64)) for _ in range(300)]
    keys += [b"".join(rng.choice(parts) for _ in range(rng.randrange(1, 8))) for _ in range(700)]
    keys += [b"", b"{", b"}", b"{}", b"}{", b"{a", b"a}", b"{{}}", b"}{a}", b"x}{y}z", b"{a}{b}", b"a{b{c}d}"]
    for key in keys:
        assert native.crc16(key) == crc16(key), key
        assert native.key_slot(key) == key_slot(key) == client.execute_command("CLUSTER", "KEYSLOT", key), key


def test_healthy_calls_stay_in_the_extension(redis_cluster: Cluster, cluster_url: str) -> None:
    """On a healthy cluster the native backend's single-key calls and batches never reach
    Route (ClusterBackend.routed), an acquire that the transaction leaves to the script
    included; after a slot moves, the MOVED is handed to it, and the
    call still succeeds on the new owner."""
    cache = hotlock.connect(cluster_url, backend="native")
    backend = cache._backend
    assert isinstance(backend, ClusterBackend) and backend._router is not None
    handed: list[str] = []
    route = backend.routed

    def counted(what: str, *rest: Any) -> list[Any]:
        handed.append(what)
        return route(what, *rest)

    backend.routed = counted  # type: ignore[method-assign]
    port = redis_cluster.primary_ports()[0]
    key = keys_on(redis_cluster, port, 1, "fast")[0]
    lock = cache.lock(key, ttl=10)
    lock.extend(ttl=20)
    assert redis_cluster.client(port).pttl(lock_name(key)) > 15000
    assert lock.unlock() is True
    keys = [f"fastb-{i}" for i in range(60)]
    locks = cache.lock_many(keys, ttl=10)
    assert all(lock is not None for lock in locks)
    assert cache.extend_many(locks, ttl=20) == [True] * 60  # type: ignore[arg-type]
    assert all(cache.unlock_many(locks))  # type: ignore[arg-type]
    assert cache.set_nx("fast-once", "v", ttl=10) is True and cache.set_nx("fast-once", "v", ttl=10) is False
    assert cache.incr("fast-count", 3) == 3
    with cache.lock_wait(key, ttl=5, wait=1):
        pass
    # A held key: the transaction finds it, and the script is sent from C too.
    holder = cache.lock("fast-held", ttl=10)
    with pytest.raises(LockNotAcquired):
        cache.lock("fast-held", ttl=5)
    mixed = cache.lock_many(["fast-held", *keys[:5]], ttl=10)
    assert mixed[0] is None and all(lock is not None for lock in mixed[1:])
    assert all(cache.unlock_many([holder, *mixed[1:]]))  # type: ignore[list-item]
    assert handed == []
    slot = key_slot(lock_name(key))
    target = _other_primary(redis_cluster, port)
    redis_cluster.move_slot(slot, target)
    try:
        lock = cache.lock(key, ttl=10)
        assert handed == ["acquire"]
        assert redis_cluster.client(target).exists(lock_name(key)) == 1
        assert lock.unlock() is True  # the map was refreshed after the MOVED: C again
        assert handed == ["acquire"]
    finally:
        redis_cluster.move_slot(slot, port)
        redis_cluster.wait_ok()
    cache.close()


def test_connect_names_the_cluster(
    redis_backend: str, cluster_url: str, redis_cluster: Cluster, caplog: pytest.LogCaptureFixture
) -> None:
    node = redis_cluster.nodes[0]
    with caplog.at_level(logging.INFO, logger="hotlock"), hotlock.connect(cluster_url, backend=redis_backend) as cache:
        assert cache.backend == redis_backend
        assert cache.server == cluster_url
        assert cache.server_info["kind"] == node.kind and cache.server_info["lua_free"] is node.lua_free
        nodes: Any = cache.server_info["nodes"]
        assert set(nodes) == {f"127.0.0.1:{p}" for p in redis_cluster.primary_ports()}
        assert all(d.startswith(node.named) for d in nodes.values()), nodes
    line = next(r.getMessage() for r in caplog.records if "connected to" in r.getMessage())
    # "Redis Cluster" is the protocol's name: a cluster of Valkey nodes says it too.
    assert cluster_url in line and "Redis Cluster of 3 shards" in line and node.named in line, line
    assert ("Lua-free extend/release (SET IFEQ, DELIFEQ)" in line) is node.lua_free, line


def test_connect_warns_of_each_evicting_primary(
    redis_backend: str, cluster_url: str, redis_cluster: Cluster, caplog: pytest.LogCaptureFixture
) -> None:
    port = redis_cluster.primary_ports()[1]
    redis_cluster.client(port).config_set("maxmemory-policy", "allkeys-lru")
    try:
        with caplog.at_level(logging.WARNING, logger="hotlock"):
            hotlock.connect(cluster_url, backend=redis_backend).close()
    finally:
        redis_cluster.client(port).config_set("maxmemory-policy", "noeviction")
    warnings = [r.getMessage() for r in caplog.records if "maxmemory-policy" in r.getMessage()]
    assert len(warnings) == 1 and f"127.0.0.1:{port} has maxmemory-policy allkeys-lru" in warnings[0], warnings


def test_locks_spread_over_every_shard(rcache: Cache, redis_cluster: Cluster) -> None:
    locks = rcache.lock_many([f"spread-{i}" for i in range(90)], ttl=10)
    sizes = {port: redis_cluster.client(port).dbsize() for port in redis_cluster.primary_ports()}
    assert sum(sizes.values()) == 90 and all(n > 10 for n in sizes.values()), sizes
    for lock in locks:
        assert lock is not None
        assert redis_cluster.client(redis_cluster.owner_of(lock_name(lock.key))).exists(lock_name(lock.key)) == 1
    assert all(rcache.unlock_many(locks))  # type: ignore[arg-type]
    assert sum(redis_cluster.client(p).dbsize() for p in redis_cluster.primary_ports()) == 0


def test_set_nx_and_incr_route_like_locks(rcache: Cache, redis_cluster: Cluster) -> None:
    for i in range(20):
        assert rcache.set_nx(f"once-{i}", "v", ttl=10) is True
        assert rcache.incr(f"count-{i}", i) == i
    ports = {redis_cluster.owner_of(b"hotlock:once:{once-%d}" % i) for i in range(20)}
    assert len(ports) == 3


@pytest.fixture(params=[b for b in ("redis-py", "native", "native-c")])
def routed(
    request: pytest.FixtureRequest, cluster_url: str, redis_cluster: Cluster
) -> Iterator[tuple[str, dict[int, FaultProxy]]]:
    """A fault proxy in front of every primary; the backend under test."""
    if request.param.startswith("native") and native_module()[0] is None:
        pytest.fail(f"the native backend is not live: {native_module()[1]}")
    proxies = {port: FaultProxy(port).start() for port in redis_cluster.primary_ports()}
    yield request.param, proxies
    for proxy in proxies.values():
        proxy.stop()


def test_batch_over_every_shard_is_one_round_trip(
    routed: tuple[str, dict[int, FaultProxy]], cluster_url: str, redis_cluster: Cluster
) -> None:
    """With 100 ms added each way on every primary's path, a round trip costs >= 200 ms: a
    batch over 3 shards that went node by node would take >= 600 ms; one round trip
    takes about 200. And each primary ran each of its keys' acquire (the transaction: no
    script) and release exactly once (the release: the script on Redis 7.0, DELIFEQ on
    Valkey 9)."""
    backend, proxies = routed
    cache = routed_cache(cluster_url, backend, proxies, timeout=2.0)
    keys = [k for port in redis_cluster.primary_ports() for k in keys_on(redis_cluster, port, 10, "b")]
    release = release_command(redis_cluster)
    before = {p: node_calls(redis_cluster.client(p), "evalsha", "delifeq", "exec") for p in proxies}
    for proxy in proxies.values():
        proxy.delay(0.1)
    started = time.monotonic()
    locks = cache.lock_many(keys, ttl=10)
    took = time.monotonic() - started
    assert all(lock is not None for lock in locks)
    assert 0.2 <= took < 0.5, f"lock_many over 3 shards took {took:.3f} s: not one round trip"
    started = time.monotonic()
    assert all(cache.unlock_many(locks))  # type: ignore[arg-type]
    took = time.monotonic() - started
    assert took < 0.5, f"unlock_many over 3 shards took {took:.3f} s"
    for port in proxies:
        after = node_calls(redis_cluster.client(port), "evalsha", "delifeq", "exec")
        scripts, delifeqs, execs = (a - b for a, b in zip(after, before[port], strict=True))
        # 10 acquires (transactions) and 10 releases.
        assert (scripts, delifeqs, execs) == ((0, 10, 10) if release == "delifeq" else (10, 0, 10)), port
    cache.close()


def test_lost_reply_on_one_node_is_retried_with_the_same_token(
    routed: tuple[str, dict[int, FaultProxy]], cluster_url: str, redis_cluster: Cluster
) -> None:
    """The acquire ran on the node but its reply was dropped: the one retry finds the key
    already ours, so the caller gets the lock, not LockNotAcquired; the batch form too."""
    backend, proxies = routed
    port = redis_cluster.primary_ports()[0]
    cache = routed_cache(cluster_url, backend, proxies)
    key = keys_on(redis_cluster, port, 1, "lost")[0]
    proxies[port].drop_replies(1)
    with cache.lock(key, ttl=10) as lock:
        assert proxies[port].dropped_replies == 1
        assert redis_cluster.client(port).get(lock_name(key)) is not None
        assert lock.valid_for() > 9
    assert redis_cluster.client(port).exists(lock_name(key)) == 0
    keys = [k for p in redis_cluster.primary_ports() for k in keys_on(redis_cluster, p, 3, "lostb")]
    proxies[port].drop_replies(1)
    locks = cache.lock_many(keys, ttl=10)
    assert proxies[port].dropped_replies == 2 and all(lock is not None for lock in locks)
    assert all(cache.unlock_many(locks))  # type: ignore[arg-type]
    cache.close()


def test_a_lost_reply_is_retried_once_only(
    routed: tuple[str, dict[int, FaultProxy]], cluster_url: str, redis_cluster: Cluster
) -> None:
    """Two replies dropped in a row: the acquire runs exactly twice on its node (the first
    try and the one retry, same token: the retry's transaction finds the key, so the
    script decides it, once), never a third time. Every link reconnects with a
    handshake (CLIENT SETINFO, and the native one's SCRIPT LOADs), whose reply is the second
    one dropped. The native link retries it within the link, so the retry's own reply
    arrives and the lock is held; the redis-py link's handshake failure reaches the call as
    a connection that ran nothing, whose resend the call's budget (two reply timeouts,
    both spent waiting) no longer allows: a CacheError, the acquire run once. A lost extend
    reply is never resent (the extend: the script on Redis 7.0, SET IFEQ on Valkey 9)."""
    backend, proxies = routed
    port = redis_cluster.primary_ports()[1]
    client = redis_cluster.client(port)
    cache = routed_cache(cluster_url, backend, proxies)
    key = keys_on(redis_cluster, port, 1, "twice")[0]
    with cache.lock(keys_on(redis_cluster, port, 1, "warm2")[0], ttl=5):
        pass  # the link to the node is open
    before = node_calls(client, "exec", "evalsha")
    proxies[port].drop_replies(2)
    if backend == "redis-py":
        with pytest.raises(CacheError, match=r"acquire \(retried after a lost reply\) failed.*handshake"):
            cache.lock(key, ttl=10)
        assert proxies[port].dropped_replies == 2
        assert tuple(a - b for a, b in zip(node_calls(client, "exec", "evalsha"), before, strict=True)) == (1, 0)
        cache.close()
        return
    lock = cache.lock(key, ttl=10)
    assert proxies[port].dropped_replies == 2
    assert tuple(a - b for a, b in zip(node_calls(client, "exec", "evalsha"), before, strict=True)) == (2, 1)
    # SET counts the acquires' own SETs too, but none runs between these two readings.
    extend = "set" if redis_cluster.nodes[0].lua_free else "evalsha"
    before_extend = calls(client, extend)
    proxies[port].drop_replies(1)
    with pytest.raises(CacheError):
        lock.extend()
    assert calls(client, extend) - before_extend == 1
    assert lock.unlock() is True
    cache.close()


def test_blackholed_node_is_cache_error_for_its_keys_only(
    routed: tuple[str, dict[int, FaultProxy]], cluster_url: str, redis_cluster: Cluster
) -> None:
    backend, proxies = routed
    port = redis_cluster.primary_ports()[2]
    cache = routed_cache(cluster_url, backend, proxies, timeout=0.3)
    dead = keys_on(redis_cluster, port, 1, "bh")[0]
    alive = [keys_on(redis_cluster, p, 1, "ok")[0] for p in redis_cluster.primary_ports() if p != port]
    proxies[port].blackhole(True)
    started = time.monotonic()
    with pytest.raises(CacheError):
        cache.lock(dead, ttl=5)
    assert time.monotonic() - started < 3.0
    for key in alive:
        with cache.lock(key, ttl=5):
            pass
    proxies[port].blackhole(False)
    with cache.lock(dead, ttl=5):
        pass
    cache.close()


# -- resharding ---------------------------------------------------------------------------


def _other_primary(cluster: Cluster, port: int) -> int:
    return next(p for p in cluster.primary_ports() if p != port)


def test_moved_after_a_slot_migration(rcache: Cache, redis_cluster: Cluster, redis_backend: str) -> None:
    """A held lock's slot moves to another primary (MIGRATING/IMPORTING, MIGRATE, SETSLOT
    NODE): the holder extends and releases it there, a rival still sees it held, and
    the backend's map learns the new owner."""
    key = "moving"
    slot = key_slot(lock_name(key))
    source = redis_cluster.owner(slot)
    target = _other_primary(redis_cluster, source)
    lock = rcache.lock(key, ttl=10)
    try:
        redis_cluster.move_slot(slot, target)
        redis_cluster.wait_ok()
        assert redis_cluster.client(target).exists(lock_name(key)) == 1
        lock.extend(ttl=20)
        assert redis_cluster.client(target).pttl(lock_name(key)) > 15000
        assert rcache._backend.slot_owner(lock_name(key)) == ("127.0.0.1", target)  # type: ignore[attr-defined]
        with hotlock.connect(redis_cluster.url, backend=redis_backend) as rival, pytest.raises(LockNotAcquired):
            rival.lock(key, ttl=5)
        assert lock.unlock() is True
        assert redis_cluster.client(target).exists(lock_name(key)) == 0
    finally:
        redis_cluster.move_slot(slot, source)
        redis_cluster.wait_ok()


def test_ask_while_a_slot_is_migrating(rcache: Cache, redis_cluster: Cluster) -> None:
    """Mid-migration the source answers ASK for keys it no longer has: a new lock goes to
    the target with ASKING (and is held there), an old one is still served by the source,
    and after its key has moved too it is extended and released through ASK."""
    old, new = "mig}:old", "mig}:new"  # one slot: the hash tag is "mig"
    slot = key_slot(lock_name(old))
    assert key_slot(lock_name(new)) == slot
    source = redis_cluster.owner(slot)
    target = _other_primary(redis_cluster, source)
    held = rcache.lock(old, ttl=10)
    redis_cluster.begin_migration(slot, target)
    try:
        fresh = rcache.lock(new, ttl=10)
        asking = redis_cluster.client(target).pipeline(transaction=False)  # one connection
        asking.execute_command("ASKING")
        asking.exists(lock_name(new))
        assert asking.execute() == [True, 1]
        # (EXISTS on the source would answer ASK itself: count the slot's keys instead.)
        assert redis_cluster.client(source).execute_command("CLUSTER", "COUNTKEYSINSLOT", slot) == 1
        with pytest.raises(LockNotAcquired):
            rcache.lock(new, ttl=5)
        held.extend(ttl=10)  # still on the source
        assert redis_cluster.migrate_keys(slot, source, target) == 1
        held.extend(ttl=12)  # now on the target, through ASK
        assert held.unlock() is True
        assert fresh.unlock() is True
        # The slot still belongs to the source in every map: ASK never rewrites it.
        assert rcache._backend.slot_owner(lock_name(old)) == ("127.0.0.1", source)  # type: ignore[attr-defined]
    finally:
        redis_cluster.migrate_keys(slot, source, target)
        redis_cluster.end_migration(slot, target)
        redis_cluster.wait_ok()
        redis_cluster.move_slot(slot, source)
        redis_cluster.wait_ok()
    for port in redis_cluster.primary_ports():
        assert redis_cluster.client(port).execute_command("CLUSTER", "COUNTKEYSINSLOT", slot) == 0


def test_exclusion_across_shards_while_a_slot_moves(
    redis_backend: str, cluster_url: str, redis_cluster: Cluster
) -> None:
    """Threads contend for keys on every shard while one key's slot is moved away and back:
    no two holders (the overlap checker), no error, no false LockNotAcquired for lock_wait."""
    ports = redis_cluster.primary_ports()
    keys = [k for p in ports for k in keys_on(redis_cluster, p, 2, "x")]
    moving = key_slot(lock_name(keys[0]))
    checker = OverlapChecker(len(keys))
    errors: list[BaseException] = []
    deadline = time.monotonic() + 3.0
    cache = hotlock.connect(cluster_url, backend=redis_backend)

    def worker(n: int) -> None:
        i = n
        try:
            while time.monotonic() < deadline:
                i += 1
                k = i % len(keys)
                with cache.lock_wait(keys[k], ttl=5, wait=5):
                    checker.enter(k)
                    time.sleep(0.0005)
                    checker.exit(k)
        except BaseException as exc:  # any error fails the test below
            errors.append(exc)

    threads = [threading.Thread(target=worker, args=(n,)) for n in range(6)]
    for t in threads:
        t.start()
    source = redis_cluster.owner(moving)
    time.sleep(0.5)
    redis_cluster.move_slot(moving, _other_primary(redis_cluster, source))
    time.sleep(0.5)
    redis_cluster.move_slot(moving, source)
    for t in threads:
        t.join()
    cache.close()
    redis_cluster.wait_ok()
    assert not errors, errors[:3]
    assert checker.sections > 100 and checker.overlaps == 0


def test_the_checker_catches_a_broken_lock_across_shards(cluster_url: str, redis_cluster: Cluster) -> None:
    """The same workers with a prefix each (nobody excludes anybody): the checker must see it."""
    keys = [k for p in redis_cluster.primary_ports() for k in keys_on(redis_cluster, p, 1, "y")]
    checker = OverlapChecker(len(keys))
    deadline = time.monotonic() + 1.0

    def worker(n: int) -> None:
        with hotlock.connect(cluster_url, prefix=f"t{n}:", backend="redis-py") as cache:
            i = 0
            while time.monotonic() < deadline:
                i += 1
                with cache.lock_wait(keys[i % len(keys)], ttl=5, wait=2):
                    checker.enter(i % len(keys))
                    time.sleep(0.001)
                    checker.exit(i % len(keys))

    threads = [threading.Thread(target=worker, args=(n,)) for n in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert checker.sections > 50 and checker.overlaps > 0


# -- failover ------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def spare_cluster(server_kind: str) -> Iterator[Cluster]:
    """A cluster of its own, of the test's server kind, for the tests that kill nodes."""
    cluster = start_cluster(kinds=[server_kind] * 6)
    yield cluster
    cluster.stop()


def test_killed_primary(redis_backend: str, spare_cluster: Cluster) -> None:
    """SIGKILL one primary: locks on the other shards never stop, locks on its slots are
    CacheError (never LockNotAcquired) until its replica is promoted, then work again
    (the map is asked of another node). A lock taken with wait_replicas=1 before the kill
    is still held, and still its holder's, on the promoted replica. (Without it, one
    granted in the last moment before the kill, not yet copied, would be lost: the
    two-holder window of any asynchronous failover, forced in
    test_failover_can_give_two_holders_on_a_cluster; see docs/cluster.md.)"""
    cluster = spare_cluster
    cluster.flush()
    victim = cluster.primary_ports()[0]
    cache = hotlock.connect(cluster.url, backend=redis_backend, timeout=0.5, connect_timeout=0.5)
    dead_keys = keys_on(cluster, victim, 3, "d")
    alive = [keys_on(cluster, p, 1, "a")[0] for p in cluster.primary_ports() if p != victim]
    # wait_replicas=1: the acquire returns once the replica has it, so the promoted
    # replica must still know the lock (without it, replication lag decides).
    confirmed = hotlock.connect(cluster.url, backend=redis_backend, wait_replicas=1, timeout=2)
    old_holder = confirmed.lock(dead_keys[0], ttl=30)
    node = next(n for n in cluster.nodes if n.port == victim)
    assert node.proc is not None
    node.proc.send_signal(signal.SIGKILL)
    node.proc.wait()
    try:
        errors = 0
        promoted = False
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            for key in alive:
                with cache.lock(key, ttl=5):
                    pass
            try:
                with cache.lock(dead_keys[1], ttl=5):
                    promoted = True
            except CacheError:
                errors += 1
            if promoted:
                break
            time.sleep(0.1)
        assert promoted, "locks on the failed shard did not resume after the replica's promotion"
        assert errors > 0, "the gap before the promotion should have been seen as CacheError"
        cluster.wait_ok()  # every live node agrees on the new map
        assert victim not in cluster.primary_ports()
        # The replica had the old holder's key: it is still held, and still his.
        with pytest.raises(LockNotAcquired):
            cache.lock(dead_keys[0], ttl=5)
        assert cluster.client(cluster.owner_of(lock_name(dead_keys[0]))).get(lock_name(dead_keys[0])) == (
            old_holder._token
        )
        # Renewals are confirmed as acquires are, and the promoted primary has no replica
        # left to confirm one: the extend is a lost lease, and the key is released.
        with pytest.raises(hotlock.LockLost, match="0 of 1 replicas"):
            old_holder.extend(ttl=10)
        assert old_holder.unlock() is False
        with cache.lock(dead_keys[0], ttl=5):
            pass
        cache.close()
        confirmed.close()
    finally:
        cluster.restart(victim)  # back as a replica, so the next backend's run has a failover too


# -- the two-holder window of a failover, forced ------------------------------------------
# A lock granted by a primary in the last moment before it dies may never reach its replica.
# Left to timing that window is a few microseconds; here it is forced: the replica is
# SIGSTOPped (it can neither read nor reconnect) and the primary drops its replication link
# (CLIENT KILL TYPE replica), so a write that follows reaches the primary's backlog only.
# SIGSTOP alone would not do: bytes already written to the replica's socket are read when it
# resumes. Then the primary is SIGKILLed and the replica promoted with CLUSTER FAILOVER
# TAKEOVER (at once; the automatic election would take the node timeout and more).


def _shard_to_fail(cluster: Cluster) -> tuple[int, int]:
    """A primary (not a seed of cluster.url, when one can be had) and its replica's port,
    with the cluster healthy, synced and empty."""
    cluster.wait_ok()
    cluster.wait_synced()
    cluster.flush()
    seeds = {n.port for n in cluster.nodes[:2]}
    primaries = cluster.primary_ports()
    primary = next((p for p in primaries if p not in seeds), primaries[0])
    replica = int(cluster.client(primary).info("replication")["slave0"]["port"])
    return primary, replica


def _node(cluster: Cluster, port: int) -> RedisServer:
    return next(n for n in cluster.nodes if n.port == port)


def _stopped(pid: int) -> bool:
    with open(f"/proc/{pid}/stat") as f:
        return f.read().rsplit(")", 1)[1].split()[0] in ("T", "t")


@contextlib.contextmanager
def _replica_cut_off(cluster: Cluster, primary: int, replica: int) -> Iterator[None]:
    """While inside: the replica is frozen and no longer linked, so the primary's writes go
    nowhere but its backlog. On leaving, the replica runs again (it reconnects by itself,
    if its primary is still there)."""
    proc = _node(cluster, replica).proc
    assert proc is not None and proc.poll() is None
    proc.send_signal(signal.SIGSTOP)
    try:
        deadline = time.monotonic() + 10
        while not _stopped(proc.pid):  # a signal is delivered soon after kill(), not within it
            assert time.monotonic() < deadline, "the replica did not stop"
            time.sleep(0.01)
        side = cluster.client(primary)
        assert side.execute_command("CLIENT", "KILL", "TYPE", "replica") == 1
        assert int(side.info("replication")["connected_slaves"]) == 0
        yield
    finally:
        proc.send_signal(signal.SIGCONT)


def _kill(cluster: Cluster, port: int) -> None:
    proc = _node(cluster, port).proc
    assert proc is not None
    proc.send_signal(signal.SIGKILL)
    proc.wait(10)


def _take_over(cluster: Cluster, replica: int, key: str) -> None:
    """Promote ``replica`` (its primary is dead) and wait until every live node says so."""
    side = cluster.client(replica)
    deadline = time.monotonic() + 30
    while side.info("replication")["role"] != "master":
        with contextlib.suppress(redis.ResponseError):  # promoted meanwhile by the election
            side.execute_command("CLUSTER", "FAILOVER", "TAKEOVER")
        if time.monotonic() > deadline:
            pytest.fail("CLUSTER FAILOVER TAKEOVER did not promote the replica")
        time.sleep(0.05)
    cluster.wait_ok()
    assert cluster.owner_of(lock_name(key)) == replica


def _bring_back(cluster: Cluster, port: int) -> None:
    """Restart a killed primary: it rejoins as its promoted replica's replica."""
    proc = _node(cluster, port).proc
    if proc is not None and proc.poll() is not None:
        cluster.restart(port)


def _flagged_failed(cluster: Cluster, by: int, port: int) -> bool:
    """Whether the node at ``by`` reports the node at ``port`` as failed in CLUSTER SHARDS."""
    for shard in cluster.client(by).execute_command("CLUSTER", "SHARDS"):  # redis-py: dicts
        for node in shard[b"nodes"]:
            if int(node[b"port"]) == port:
                return bool(node[b"health"] == b"fail")
    return False


def test_a_cache_connected_after_a_failover_maps_the_promoted_replica(spare_cluster: Cluster) -> None:
    """A primary SIGKILLed and its replica promoted, the dead node still down: a cache
    connected then (sync and async, native and redis-py) maps the shard's slots to the
    promoted replica alone and locks there, both at once after the takeover and once the
    other nodes flag the dead one failed. Valkey keeps a node's shard id through a
    failover, so its CLUSTER SHARDS lists the dead node as a second primary of the same
    shard in both states (Redis 7.0 lists it alone, in a shard with no slots); a map that
    counted it failed every connect() until it came back."""
    cluster = spare_cluster
    primary, replica = _shard_to_fail(cluster)
    key = keys_on(cluster, primary, 1, "after")[0]
    dead, promoted = ("127.0.0.1", primary), ("127.0.0.1", replica)

    async def connect_async(backend: str) -> None:
        async with await hotlock.aio.connect(cluster.url, backend=backend, timeout=1, connect_timeout=1) as acache:
            assert dead not in acache._backend.map.primaries  # type: ignore[attr-defined]
            lock = await acache.lock(key, ttl=10)
            assert cluster.client(replica).get(lock_name(key)) == lock._token
            assert await lock.unlock() is True

    def connect_each() -> None:
        for backend in ("native", "redis-py"):
            with hotlock.connect(cluster.url, backend=backend, timeout=1, connect_timeout=1) as cache:
                assert dead not in cache._backend.map.primaries  # type: ignore[attr-defined]
                assert cache._backend.slot_owner(lock_name(key)) == promoted  # type: ignore[attr-defined]
                with cache.lock(key, ttl=10) as lock:
                    assert cluster.client(replica).get(lock_name(key)) == lock._token
            asyncio.run(connect_async(backend))

    try:
        _kill(cluster, primary)
        _take_over(cluster, replica, key)
        connect_each()
        deadline = time.monotonic() + 30
        while not _flagged_failed(cluster, replica, primary):
            assert time.monotonic() < deadline, "the dead primary was never flagged failed"
            time.sleep(0.05)
        connect_each()
    finally:
        _bring_back(cluster, primary)


def test_a_serving_primary_flagged_failed_keeps_its_slots(redis_backend: str, spare_cluster: Cluster) -> None:
    """A node clears a FAIL flag on a primary that owns slots only two node timeouts after
    setting it, so a primary frozen past the node timeout (its replica frozen too, so no
    failover happens) serves again while the other nodes still report it ``fail`` in
    CLUSTER SHARDS; the same window follows a failover to a replica that had been frozen
    (the race test_failover_can_give_two_holders_on_a_cluster hit on a loaded machine). A
    client that builds its map then still reaches that primary's keys."""
    cluster = spare_cluster
    primary, replica = _shard_to_fail(cluster)
    key = keys_on(cluster, primary, 1, "flag")[0]
    # A node to ask that stays up: not the frozen primary, nor its replica, frozen too
    # (earlier failover tests may have made any node that replica).
    seed = next(n.port for n in cluster.nodes if n.port not in (primary, replica))
    with _replica_cut_off(cluster, primary, replica):
        proc = _node(cluster, primary).proc
        assert proc is not None
        proc.send_signal(signal.SIGSTOP)
        try:
            deadline = time.monotonic() + 30
            while not _flagged_failed(cluster, seed, primary):
                assert time.monotonic() < deadline, "the frozen primary was never flagged failed"
                time.sleep(0.05)
        finally:
            proc.send_signal(signal.SIGCONT)
        assert cluster.client(primary).ping()
        assert _flagged_failed(cluster, seed, primary)  # serving, and still reported failed
        with hotlock.connect(cluster.url, backend=redis_backend, timeout=1, connect_timeout=1) as c:
            held = c.lock(key, ttl=30)
            assert cluster.client(primary).get(lock_name(key)) == held._token
            assert held.unlock() is True
    cluster.wait_ok()


def test_failover_can_give_two_holders_on_a_cluster(redis_backend: str, spare_cluster: Cluster) -> None:
    """The documented caveat (docs/cluster.md), reproduced: a lock granted by a primary whose replica never got
    it (replica frozen, link cut), the primary SIGKILLed, the replica promoted: a second
    client is granted the same key, and both hold valid-looking leases."""
    cluster = spare_cluster
    primary, replica = _shard_to_fail(cluster)
    key = keys_on(cluster, primary, 1, "two")[0]
    a = hotlock.connect(cluster.url, backend=redis_backend, timeout=1, connect_timeout=1)
    try:
        with _replica_cut_off(cluster, primary, replica):
            first = a.lock(key, ttl=120)  # granted and answered at once: no replica is asked
            assert cluster.client(primary).get(lock_name(key)) == first._token
            _kill(cluster, primary)  # before the replica could have it
        _take_over(cluster, replica, key)
        assert cluster.client(replica).exists(lock_name(key)) == 0  # the grant died with the primary
        with hotlock.connect(cluster.url, backend=redis_backend, timeout=1, connect_timeout=1) as b:
            second = b.lock(key, ttl=120)  # the promoted replica never saw the first
            # Two holders of one key, each with a live lease: why the protected resource
            # must check an idempotency key or a fencing token.
            assert first.valid_for() > 60 and second.valid_for() > 60
            assert second._token != first._token
            assert cluster.client(replica).get(lock_name(key)) == second._token
            assert second.unlock() is True
    finally:
        a.close()
        _bring_back(cluster, primary)


def test_wait_replicas_closes_the_failover_window_on_a_cluster(redis_backend: str, spare_cluster: Cluster) -> None:
    """The same forced window with wait_replicas=1. An acquire the cut-off replica cannot
    confirm in time is undone and raised as CacheError: its caller never believes it holds
    the lock. One with a longer wait_timeout is still waiting while the replica is frozen
    and returns once the replica, running again, has it. After the same SIGKILL and
    promotion, each key has exactly one holder."""
    cluster = spare_cluster
    primary, replica = _shard_to_fail(cluster)
    undone, kept = keys_on(cluster, primary, 2, "wr")
    hasty = hotlock.connect(cluster.url, backend=redis_backend, wait_replicas=1, wait_timeout=0.3, timeout=2)
    # A generous wait: the resumed replica reconnects and acknowledges within a few seconds.
    patient = hotlock.connect(cluster.url, backend=redis_backend, wait_replicas=1, wait_timeout=20, timeout=25)
    got: dict[str, object] = {}

    def acquire() -> None:
        try:
            got["lock"] = patient.lock(kept, ttl=120)
        except BaseException as exc:  # reported by the asserts below
            got["error"] = exc

    waiter = threading.Thread(target=acquire)
    try:
        with _replica_cut_off(cluster, primary, replica):
            with pytest.raises(CacheError, match="replicas"):
                hasty.lock(undone, ttl=120)
            assert cluster.client(primary).exists(lock_name(undone)) == 0  # undone, not stranded
            waiter.start()
            waiter.join(1.0)
            assert waiter.is_alive(), f"the acquire did not wait for the frozen replica: {got}"
        waiter.join(60)
        assert not waiter.is_alive() and "lock" in got, got
        held = got["lock"]
        assert isinstance(held, hotlock.Lock)
        _kill(cluster, primary)
        _take_over(cluster, replica, kept)
        # The promoted replica has the confirmed lock, and nothing of the undone one.
        assert cluster.client(replica).get(lock_name(kept)) == held._token
        assert cluster.client(replica).exists(lock_name(undone)) == 0
        with hotlock.connect(cluster.url, backend=redis_backend, timeout=1, connect_timeout=1) as b:
            with pytest.raises(LockNotAcquired):
                b.lock(kept, ttl=120)  # still its first holder's
            assert b.lock(undone, ttl=120).unlock() is True  # its only holder: the first was told no
    finally:
        if waiter.is_alive():
            waiter.join(60)
        hasty.close()
        patient.close()
        _bring_back(cluster, primary)


# -- wait_replicas and NOSCRIPT ------------------------------------------------------------


def test_wait_replicas_waits_on_the_keys_own_shard(
    redis_backend: str, cluster_url: str, redis_cluster: Cluster
) -> None:
    """Each shard has one replica: wait_replicas=1 holds on every shard; wait_replicas=2
    cannot be met, so the acquires are undone (no key stranded) and raise CacheError."""
    keys = [k for p in redis_cluster.primary_ports() for k in keys_on(redis_cluster, p, 2, "w")]
    with hotlock.connect(cluster_url, backend=redis_backend, wait_replicas=1, wait_timeout=0.5) as cache:
        locks = cache.lock_many(keys, ttl=10)
        assert all(lock is not None for lock in locks)
        assert all(cache.unlock_many(locks))  # type: ignore[arg-type]
    with hotlock.connect(cluster_url, backend=redis_backend, wait_replicas=2, wait_timeout=0.2, timeout=1) as cache:
        with pytest.raises(CacheError, match="1 of 2 replicas"):
            cache.lock(keys[0], ttl=10)
        with pytest.raises(CacheError, match="1 of 2 replicas"):
            cache.lock_many(keys, ttl=10)
    for key in keys:
        assert redis_cluster.client(redis_cluster.owner_of(lock_name(key))).exists(lock_name(key)) == 0


def _waits(cluster: Cluster, port: int) -> int:
    """WAIT commands the node at ``port`` has run so far (INFO commandstats)."""
    return int(cluster.client(port).info("commandstats").get("cmdstat_wait", {}).get("calls", 0))


def _acknowledged(cluster: Cluster, primary: int) -> None:
    """Until the primary's replica is linked again and acknowledges a write."""
    cluster.wait_synced()
    side = cluster.client(primary)
    deadline = time.monotonic() + 30
    while int(side.wait(1, 100)) < 1:
        assert time.monotonic() < deadline, "the replica did not come back"
        side.set(b"hotlock-test-ack", 1)


@contextlib.contextmanager
def _one_shard_unconfirmed(cluster: Cluster) -> Iterator[tuple[int, int]]:
    """(a primary whose replica is cut off while inside, another primary); afterwards the
    replica runs, linked and caught up again."""
    cluster.wait_synced()
    primary, other = cluster.primary_ports()[:2]
    replica = int(cluster.client(primary).info("replication")["slave0"]["port"])
    try:
        with _replica_cut_off(cluster, primary, replica):
            yield primary, other
    finally:
        _acknowledged(cluster, primary)


def test_wait_replicas_confirms_renewals_on_the_node_that_took_them(
    redis_backend: str, cluster_url: str, redis_cluster: Cluster
) -> None:
    """An extend is confirmed by a WAIT to the key's own primary, one per node per batch.
    With one shard's replica cut off, the extends there are lost (LockLost, released) and
    the other shard's stand."""
    cluster = redis_cluster
    primary, other = cluster.primary_ports()[:2]
    cut, kept = keys_on(cluster, primary, 2, "rc"), keys_on(cluster, other, 1, "rk")
    with hotlock.connect(cluster_url, backend=redis_backend, wait_replicas=1, wait_timeout=0.2, timeout=2) as cache:
        one, batched = cache.lock(cut[0], ttl=30), cache.lock(cut[1], ttl=30)
        elsewhere = cache.lock(kept[0], ttl=30)
        before = {p: _waits(cluster, p) for p in (primary, other)}
        assert cache.extend_many([one, batched, elsewhere], ttl=30) == [True, True, True]
        assert {p: _waits(cluster, p) - before[p] for p in before} == {primary: 1, other: 1}
        with _one_shard_unconfirmed(cluster):
            with pytest.raises(hotlock.LockLost, match=rf"extend undone: 0 of 1 replicas of [\d.]+:{primary}"):
                one.extend(30)
            assert one.lost
            assert cache.extend_many([batched, elsewhere], ttl=30) == [False, True]
            assert batched.lost and not elsewhere.lost
        for key in cut:
            assert cluster.client(primary).exists(lock_name(key)) == 0  # released, not left to its TTL
        assert cluster.client(other).pttl(lock_name(kept[0])) > 20_000
        assert elsewhere.unlock() is True


def test_async_wait_replicas_confirms_renewals_on_the_node_that_took_them(
    redis_backend: str, cluster_url: str, redis_cluster: Cluster
) -> None:
    cluster = redis_cluster
    if redis_backend == "native" and native_aio()[0] is None:
        pytest.fail(f"the native async backend is not live: {native_aio()[1]}")
    primary, other = cluster.primary_ports()[:2]
    cut, kept = keys_on(cluster, primary, 2, "arc"), keys_on(cluster, other, 1, "ark")

    async def main() -> None:
        async with await hotlock.aio.connect(
            cluster_url,
            backend=redis_backend,  # type: ignore[arg-type]
            wait_replicas=1,
            wait_timeout=0.2,
            timeout=2,
        ) as cache:
            one, batched = await cache.lock(cut[0], ttl=30), await cache.lock(cut[1], ttl=30)
            elsewhere = await cache.lock(kept[0], ttl=30)
            before = {p: _waits(cluster, p) for p in (primary, other)}
            assert await cache.extend_many([one, batched, elsewhere], ttl=30) == [True, True, True]
            assert {p: _waits(cluster, p) - before[p] for p in before} == {primary: 1, other: 1}
            with _one_shard_unconfirmed(cluster):
                with pytest.raises(hotlock.LockLost, match=rf"extend undone: 0 of 1 replicas of [\d.]+:{primary}"):
                    await one.extend(30)
                assert await cache.extend_many([batched, elsewhere], ttl=30) == [False, True]
                assert one.lost and batched.lost and not elsewhere.lost
            assert await elsewhere.unlock() is True

    asyncio.run(main())
    for key in cut:
        assert cluster.client(primary).exists(lock_name(key)) == 0


def test_noscript_from_any_node_is_recovered(rcache: Cache, redis_cluster: Cluster) -> None:
    keys = [k for p in redis_cluster.primary_ports() for k in keys_on(redis_cluster, p, 2, "ns")]
    for port in redis_cluster.primary_ports():
        redis_cluster.client(port).script_flush()
    locks = rcache.lock_many(keys, ttl=10)
    assert all(lock is not None for lock in locks)
    redis_cluster.client(redis_cluster.primary_ports()[1]).script_flush()
    assert all(rcache.unlock_many(locks))  # type: ignore[arg-type]
    for key in keys:
        assert redis_cluster.client(redis_cluster.owner_of(lock_name(key))).exists(lock_name(key)) == 0


# -- hotlock.aio on the cluster (its lock suite runs there too: test_aio's [*-cluster] ids) --


async def _async_routed(url: str, backend: str, proxies: dict[int, FaultProxy], timeout: float) -> AsyncCache:
    config = parse_url(url, connect_timeout=timeout, timeout=timeout)

    async def open_link(node: ServerConfig) -> AsyncLink:
        proxy = proxies.get(node.port)
        target = node if proxy is None else node.node("127.0.0.1", proxy.port)
        if backend.startswith("native"):
            from hotlock.backends.native_async import NativeAsyncBackend

            native, why = native_aio()
            if native is None:
                pytest.fail(f"the native async backend is not live: {why}")
            return await NativeAsyncBackend.open(target, native.AioProtocol)
        from hotlock.backends.redispy_async import RedisAsyncLink

        return await RedisAsyncLink.open(target)

    name = backend[:6] if backend.startswith("native") else backend
    opened = await AsyncClusterBackend.open(config, name, open_link, router(backend))  # type: ignore[arg-type]
    info = await opened.info()
    commands = commands_from(await opened.command_info()) if probe_needed(info, "auto") else None
    opened.use_dialect(detect(info, commands, "auto"))  # as hotlock.aio.connect() does: Lua-free on Valkey
    return AsyncCache(opened, b"hotlock:")


def test_async_batch_over_every_shard_is_one_round_trip(
    routed: tuple[str, dict[int, FaultProxy]], cluster_url: str, redis_cluster: Cluster
) -> None:
    backend, proxies = routed
    keys = [k for port in redis_cluster.primary_ports() for k in keys_on(redis_cluster, port, 10, "ab")]

    async def main() -> float:
        cache = await _async_routed(cluster_url, backend, proxies, 2.0)
        for proxy in proxies.values():
            proxy.delay(0.1)
        started = time.monotonic()
        locks = await cache.lock_many(keys, ttl=10)
        took = time.monotonic() - started
        assert all(lock is not None for lock in locks)
        assert all(await cache.unlock_many(locks))  # type: ignore[arg-type]
        await cache.close()
        return took

    took = asyncio.run(main())
    assert 0.2 <= took < 0.5, f"async lock_many over 3 shards took {took:.3f} s: not one round trip"


def test_async_lost_reply_and_moved(
    routed: tuple[str, dict[int, FaultProxy]], cluster_url: str, redis_cluster: Cluster
) -> None:
    """A dropped acquire reply is retried with the same token (the lock is ours, not
    LockNotAcquired); then the key's slot moves, and the holder extends and releases it
    on the new primary through MOVED."""
    backend, proxies = routed
    port = redis_cluster.primary_ports()[0]
    key = keys_on(redis_cluster, port, 1, "alost")[0]
    slot = key_slot(lock_name(key))
    target = _other_primary(redis_cluster, port)

    async def main() -> None:
        cache = await _async_routed(cluster_url, backend, proxies, 0.5)
        proxies[port].drop_replies(1)
        lock = await cache.lock(key, ttl=10)
        assert proxies[port].dropped_replies == 1
        redis_cluster.move_slot(slot, target)
        await lock.extend(ttl=20)
        assert redis_cluster.client(target).pttl(lock_name(key)) > 15000
        assert await lock.unlock() is True
        await cache.close()

    try:
        asyncio.run(main())
    finally:
        redis_cluster.move_slot(slot, port)
        redis_cluster.wait_ok()


# -- least privilege ------------------------------------------------------------------------

CLUSTER_COMMANDS = ["+cluster|shards", "+cluster|slots", "+asking"]


@pytest.mark.parametrize("missing", [None, "+cluster|shards", "+asking"])
def test_the_readme_acl_list_is_enough_on_a_cluster(
    redis_backend: str, cluster_url: str, redis_cluster: Cluster, missing: str | None
) -> None:
    """The documented ACL list plus its cluster additions lets a user lock on every shard,
    ASK included; without CLUSTER SHARDS (and SLOTS) no map can be had: CacheError at
    connect; without ASKING a key mid-migration is a CacheError (never "held elsewhere")."""
    from .test_security import PASSWORD, USER, acl_line, listed

    # Without SHARDS the client falls back to SLOTS: both go for the "no map" case.
    gone = {"+cluster|shards": {"+cluster|shards", "+cluster|slots"}}.get(missing or "", {missing})
    # The list documented for the nodes' kind: on Valkey 9, +delifeq and +command|info for
    # the Lua-free path, and no +pexpire or +del.
    commands = [c for c in listed(redis_cluster.nodes[0].kind, "auto") + CLUSTER_COMMANDS if c not in gone]
    for node in redis_cluster.nodes:
        node.client().execute_command("ACL", "SETUSER", USER, "reset", *acl_line(commands))
    url = cluster_url.replace("redis+cluster://", f"redis+cluster://{USER}:{PASSWORD}@")
    try:
        if missing == "+cluster|shards":
            with pytest.raises(CacheError, match="no cluster node gave the slot map"):
                hotlock.connect(url, backend=redis_backend)
            return
        with hotlock.connect(url, backend=redis_backend) as cache:
            keys = [k for p in redis_cluster.primary_ports() for k in keys_on(redis_cluster, p, 2, "acl")]
            locks = cache.lock_many(keys, ttl=10)
            assert all(lock is not None for lock in locks)
            slot = key_slot(lock_name("acl-ask}:x"))
            source = redis_cluster.owner(slot)
            redis_cluster.begin_migration(slot, _other_primary(redis_cluster, source))
            try:
                if missing == "+asking":
                    with pytest.raises(CacheError):
                        cache.lock("acl-ask}:x", ttl=5)
                else:
                    with cache.lock("acl-ask}:x", ttl=5):  # ASK: the key is new, the target takes it
                        pass
            finally:
                redis_cluster.end_migration(slot, source)
            assert all(cache.unlock_many(locks))  # type: ignore[arg-type]
    finally:
        for node in redis_cluster.nodes:
            node.client().execute_command("ACL", "DELUSER", USER)


def test_graceful_failover(redis_backend: str, spare_cluster: Cluster) -> None:
    """CLUSTER FAILOVER on a replica: the held lock is kept (a manual failover waits for the
    replica to catch up), its holder extends and releases it on the new primary (the old
    one, now a replica, answers MOVED), a rival still sees it held."""
    cluster = spare_cluster
    cluster.flush()
    primary = cluster.primary_ports()[1]
    replica = int(cluster.client(primary).info("replication")["slave0"]["port"])
    key = keys_on(cluster, primary, 1, "gf")[0]
    with hotlock.connect(cluster.url, backend=redis_backend) as cache:
        lock = cache.lock(key, ttl=30)
        # A manual failover gives up after a while if the primary is slow to answer (a
        # loaded machine): ask again, up to three times.
        for _attempt in range(3):
            assert cluster.client(replica).execute_command("CLUSTER", "FAILOVER") == b"OK"
            deadline = time.monotonic() + 10
            while cluster.owner_of(lock_name(key)) != replica and time.monotonic() < deadline:
                time.sleep(0.05)
            if cluster.owner_of(lock_name(key)) == replica:
                break
        else:
            pytest.fail("the manual failover did not happen")
        cluster.wait_ok()
        lock.extend(ttl=10)
        assert cluster.client(replica).pttl(lock_name(key)) > 5000
        with pytest.raises(LockNotAcquired):
            cache.lock(key, ttl=5)
        assert lock.unlock() is True
        with cache.lock(key, ttl=5):
            pass


def test_lost_reply_after_a_moved(
    routed: tuple[str, dict[int, FaultProxy]], cluster_url: str, redis_cluster: Cluster
) -> None:
    """The slot moved since the map was read: the old owner answers MOVED, the new owner
    runs the acquire but its reply is lost, and the one retry (same token, on the new
    owner) finds it already ours: the caller holds the lock, its token stored there."""
    backend, proxies = routed
    source = redis_cluster.primary_ports()[0]
    target = _other_primary(redis_cluster, source)
    key = keys_on(redis_cluster, source, 1, "mv")[0]
    slot = key_slot(lock_name(key))
    cache = routed_cache(cluster_url, backend, proxies)
    with cache.lock(keys_on(redis_cluster, target, 1, "warm")[0], ttl=5):
        pass  # the link to the target is open before the move
    redis_cluster.move_slot(slot, target)
    try:
        proxies[target].drop_replies(1)
        lock = cache.lock(key, ttl=10)
        assert proxies[target].dropped_replies == 1
        stored = redis_cluster.client(target).get(lock_name(key))
        assert stored == lock._token
        assert lock.unlock() is True
    finally:
        redis_cluster.move_slot(slot, source)
        redis_cluster.wait_ok()
    cache.close()


# The Valkey cluster's run is make test-slow's: the test waits out the client's own retry
# budget (seconds of CLUSTERDOWN), the same code on either kind.
@pytest.mark.slow_variants("server_kind")
def test_clusterdown_is_waited_out_within_the_budget(redis_backend: str, spare_cluster: Cluster) -> None:
    """One slot unassigned on every node, with full coverage required: every node answers
    CLUSTERDOWN for every key. A try-once lock on another slot during the outage is a
    CacheError after its budget (never LockNotAcquired); a lock_wait whose budget outlasts
    the outage gets its lock once the slot is served again."""
    cluster = spare_cluster
    cluster.wait_ok()
    key = "down"
    slot = key_slot(lock_name("down-elsewhere"))  # the slot taken away; the lock's own stays
    assert slot != key_slot(lock_name(key))
    owner = cluster.owner(slot)
    live = [n for n in cluster.nodes if n.proc is not None and n.proc.poll() is None]
    cache = hotlock.connect(cluster.url, backend=redis_backend, timeout=1)
    try:
        for node in live:
            node.client().config_set("cluster-require-full-coverage", "yes")
        for node in live:
            node.client().execute_command("CLUSTER", "DELSLOTS", slot)
        deadline = time.monotonic() + 10
        while b"cluster_state:fail" not in cluster.client(owner).execute_command("CLUSTER", "INFO"):
            assert time.monotonic() < deadline, "the cluster did not go down"
            time.sleep(0.02)
        started = time.monotonic()
        with pytest.raises(CacheError, match="CLUSTERDOWN"):
            cache.lock(key, ttl=5)
        assert time.monotonic() - started < 4  # its budget: about two reply timeouts

        def heal() -> None:
            time.sleep(0.5)
            cluster.client(owner).execute_command("CLUSTER", "ADDSLOTS", slot)

        healer = threading.Thread(target=heal)
        healer.start()
        with cache.lock_wait(key, ttl=5, wait=5):
            assert cluster.client(cluster.owner_of(lock_name(key))).exists(lock_name(key)) == 1
        healer.join()
    finally:
        with contextlib.suppress(redis.ResponseError):  # "already busy": healed, as it should be
            cluster.client(owner).execute_command("CLUSTER", "ADDSLOTS", slot)
        for node in live:
            node.client().config_set("cluster-require-full-coverage", "no")
        cluster.wait_ok()
        cache.close()
