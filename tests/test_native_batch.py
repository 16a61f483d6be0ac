"""The native batch's one-call paths (ext/_batch.pxi) against the Python methods they replace.

On the native backend Cache.lock_many's common case (a list or tuple of str/bytes keys, an
int/float TTL) and Cache.unlock_many's (a list or tuple of None and this cache's leases)
are one extension call each, with every other case handed to the Python methods
(hotlock._fastpath binds them to NativeCache). These tests hold each to its Python path on
a real server, one and a cluster: the same commands (INFO commandstats, per primary on a
cluster), the same stored values and TTLs, the same leases and results, and for every
input the Python methods refuse, the same exception with the same message and nothing sent.
"""

from __future__ import annotations

import contextlib
from array import array
from collections.abc import Callable, Iterator
from datetime import timedelta
from typing import Any

import pytest
import redis

import hotlock
from hotlock._cache import Cache
from hotlock._fastpath import NativeCache, NativeLock
from hotlock._lock import Lease, Lock

from .cluster import Cluster
from .conftest import RedisServer, lock_name, native_for_module
from .faultproxy import FaultProxy

native = native_for_module()

SLOTS = [s for klass in Lease.__mro__ for s in getattr(klass, "__slots__", ())]
PY_LOCK_MANY = Cache.lock_many
PY_UNLOCK_MANY = Cache.unlock_many
KEYS: list[str | bytes] = ["plain", "ünïcødé-€", b"\x00\xffbytes", "x" * 1024, b"y" * 1024, "tenant-7}:a"]


def commandstats(clients: list[redis.Redis]) -> list[dict[str, int]]:
    return [{k.removeprefix("cmdstat_"): int(v["calls"]) for k, v in c.info("commandstats").items()} for c in clients]


# What a server runs on its own meanwhile (a replica's REPLCONF ACK, the cluster bus's
# and INFO's own calls): not the client's.
NOT_SENT = {"info", "replconf", "ping", "cluster|info", "cluster|nodes", "cluster|slots", "cluster|shards"}


def sent_by(clients: list[redis.Redis], action: Callable[[], object]) -> tuple[object, list[dict[str, int]]]:
    """action()'s result and the commands it sent, per server."""
    before = commandstats(clients)
    result = action()
    after = commandstats(clients)
    return result, [
        {k: v - b.get(k, 0) for k, v in a.items() if v != b.get(k, 0) and k not in NOT_SENT}
        for a, b in zip(after, before, strict=True)
    ]


def commands_processed(clients: list[redis.Redis]) -> int:
    return sum(int(c.info("stats")["total_commands_processed"]) for c in clients)


def nothing_sent(clients: list[redis.Redis], action: Callable[[], object]) -> None:
    first = commands_processed(clients)
    idle = commands_processed(clients) - first  # what the INFOs add
    before = commands_processed(clients)
    action()
    assert commands_processed(clients) - before == idle


@contextlib.contextmanager
def python_paths() -> Iterator[None]:
    """NativeCache with the Python lock_many and unlock_many (as written in hotlock._cache)."""
    fast_lock_many, fast_unlock_many = NativeCache.lock_many, NativeCache.unlock_many
    NativeCache.lock_many, NativeCache.unlock_many = PY_LOCK_MANY, PY_UNLOCK_MANY  # type: ignore[method-assign]
    try:
        yield
    finally:
        NativeCache.lock_many, NativeCache.unlock_many = fast_lock_many, fast_unlock_many  # type: ignore[method-assign]


def assert_same_leases(a: list[Lock | None], b: list[Lock | None], keys: list[Any]) -> None:
    assert len(a) == len(b) == len(keys)
    for x, y, key in zip(a, b, keys, strict=True):
        assert (x is None) == (y is None)
        if x is None or y is None:
            continue
        assert type(x) is type(y) is NativeLock
        for slot in SLOTS:
            assert type(getattr(x, slot)) is type(getattr(y, slot)), slot
        assert x.key is key and y.key is key
        assert x._name == y._name == lock_name(key if isinstance(key, bytes) else str(key))
        assert x._ttl_ms == y._ttl_ms and x._pid == y._pid and x._backend is y._backend
        assert x._meter is y._meter and x._auto is None and x._loss is None and x._loss_counted is False
        assert x._deadline == x._since + x._ttl_ms / 1000.0
        for held in (x._token, y._token):  # the token alone, or b"" once released
            assert held == b"" or len(held) == 16
        assert x._token[:16] != y._token[:16] or not x._token  # fresh tokens


def run_both(
    cache: hotlock.Cache, clients: list[redis.Redis], keys: Any, *args: Any, **kwargs: Any
) -> tuple[list[Lock | None], list[Lock | None], list[dict[str, int]]]:
    """lock_many on the one-call path, then (its locks released) on the Python path: both
    paths' leases (the first released, the second held), and the commands each sent
    (asserted equal)."""
    fast, fast_sent = sent_by(clients, lambda: cache.lock_many(keys, *args, **kwargs))
    PY_UNLOCK_MANY(cache, fast)  # type: ignore[arg-type]
    with python_paths():
        slow, slow_sent = sent_by(clients, lambda: cache.lock_many(keys, *args, **kwargs))
    assert fast_sent == slow_sent
    return fast, slow, fast_sent  # type: ignore[return-value]


@pytest.fixture
def fast(redis_url: str) -> Iterator[hotlock.Cache]:
    cache = hotlock.connect(redis_url, backend="native")
    assert type(cache) is NativeCache and cache._take is not None
    yield cache
    cache.close()


@pytest.mark.parametrize("ttl", [30, 1, 604800, 2.5, 0.0025, 0.0035, 604800.0, timedelta(seconds=3), 10**40 // 10**39])
@pytest.mark.parametrize("container", [list, tuple])
def test_the_one_call_lock_many_is_the_python_paths(
    fast: hotlock.Cache, redis_server: RedisServer, ttl: Any, container: type
) -> None:
    client = redis_server.client()
    keys = container(KEYS)
    a, fast_sent = sent_by([client], lambda: fast.lock_many(keys, ttl))
    assert isinstance(a, list) and all(lk is not None for lk in a)
    short = a[0].ttl < 0.1  # a few ms may run out in one scheduling pause
    for lock in a:
        value = client.get(lock._name)
        assert value == lock._token or (short and value is None)
        assert 0 < client.pttl(lock._name) <= lock._ttl_ms or short
    released, fast_released = sent_by([client], lambda: fast.unlock_many(a))
    assert released == [True] * len(keys) or short
    assert all(lock._token == b"" for lock in a)
    with python_paths():
        b, slow_sent = sent_by([client], lambda: fast.lock_many(keys, ttl))
        released, slow_released = sent_by([client], lambda: fast.unlock_many(b))
    assert released == [True] * len(keys) or short
    assert fast_sent == slow_sent and (fast_released == slow_released or short)
    assert_same_leases(a, b, list(keys))  # type: ignore[arg-type]
    assert all(x.fence < y.fence for x, y in zip(a, b, strict=True))  # type: ignore[union-attr]
    assert client.dbsize() == 0


def test_keys_held_elsewhere_are_none_on_both_paths(fast: hotlock.Cache, redis_server: RedisServer) -> None:
    client = redis_server.client()
    holder = hotlock.connect(redis_server.url, backend="native")
    try:
        held = [holder.lock("held-1", 30), holder.lock(b"held-2", 30, limit=2)]  # a permit: a conflict of kind
        keys = ["free-1", "held-1", "free-2", b"held-2"]
        a, b, sent = run_both(fast, [client], keys, 30)
        # Each path: every key's transaction in one write, the two held keys then by script.
        assert sent[0]["exec"] == 4 and sent[0]["evalsha"] == 2
        assert [lk is None for lk in a] == [lk is None for lk in b] == [False, True, False, True]
        assert_same_leases(a, b, keys)
        assert fast.unlock_many(b) == [True, False, True, False]
        assert holder.unlock_many(held) == [True, True]

        def items() -> list[Lock | None]:
            """None, a lock lost behind its back, a released one, one lock twice, a permit
            (released by script, Lua-free server or not)."""
            got = fast.lock_many(["u-1", "u-2"], 30)
            gone = fast.lock("gone", 30)
            client.delete(gone._name)
            done = fast.lock("done", 30)
            done.unlock()
            twice = fast.lock("twice", 30)
            return [got[0], None, got[1], gone, done, twice, twice, fast.lock("permit", 30, limit=3)]

        given = items()
        fast_results, fast_sent = sent_by([client], lambda: fast.unlock_many(given))
        with python_paths():
            given = items()
            slow_results, slow_sent = sent_by([client], lambda: fast.unlock_many(given))
        assert fast_results == slow_results == [True, False, True, False, False, True, False, True]
        assert fast_sent == slow_sent
        # What is left: the permits' hashes (a released permit leaves its key's fence).
        assert sorted(client.keys()) == [lock_name(b"held-2"), lock_name("permit")]
    finally:
        holder.close()


@pytest.mark.parametrize(
    ("args", "kwargs"),
    [
        (("k", 30), {}),  # a lone str: refused, not one lock per character
        ((b"k",), {}),
        ((5,), {}),
        ((None,), {}),
        ((["a", 3],), {}),
        ((["a", ""],), {}),
        ((["a", "x" * 1025],), {}),
        ((["a", b"y" * 1025],), {}),
        ((["\ud800"],), {}),
        ((["a", "b", "a"],), {}),
        ((["a", b"a"],), {}),  # the same raw key twice
        ((("a", "a"),), {}),
        ((["a"], 0), {}),
        ((["a"], -1), {}),
        ((["a"], 0.0004), {}),
        ((["a"], True), {}),
        ((["a"], "30"), {}),
        ((["a"], float("nan")), {}),
        ((["a"], float("inf")), {}),
        ((["a"], 10**12), {}),
        ((["a"], 604800.5), {}),
        ((["a", 3], 0), {}),  # the key is checked first
        (([], 0), {}),
        ((["a"],), {"auto_extend": 1}),
        ((["a"],), {"max_hold": 5}),
        ((["a"], 0.05), {"auto_extend": True}),  # too short to renew
        ((["a"],), {"tll": 30}),
        ((["a"], 30), {"ttl": 30}),
        ((["a"], 30, True), {}),
        ((), {}),
    ],
)
def test_lock_many_refuses_as_the_python_method_does(
    fast: hotlock.Cache, redis_server: RedisServer, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> None:
    errors = []

    def both() -> None:
        for method in (NativeCache.lock_many, PY_LOCK_MANY):
            with pytest.raises((TypeError, ValueError)) as error:
                method(fast, *args, **kwargs)
            errors.append(error.value)

    nothing_sent([redis_server.client()], both)
    assert type(errors[0]) is type(errors[1]) and str(errors[0]) == str(errors[1])
    assert redis_server.client().dbsize() == 0


@pytest.mark.parametrize("n", [2, 100, 300])
def test_lock_many_hands_a_duplicate_to_the_python_method_and_takes_distinct_keys_itself(
    fast: hotlock.Cache, n: int
) -> None:
    # Keys that are prefixes of each other, the same text as str and as bytes a key apart,
    # and (at 300) more than the duplicate check's table keeps on the stack.
    keys: list[str | bytes] = [("k" * (i % 7 + 1) + str(i // 7)) if i % 2 else f"k{i}".encode() for i in range(n)]
    handed: list[tuple[Any, ...]] = []

    def spy(cache: hotlock.Cache, *args: Any, **kwargs: Any) -> Any:
        handed.append(args)
        return PY_LOCK_MANY(cache, *args, **kwargs)

    lock_many, _ = native.cache_batch(NativeCache, spy, PY_UNLOCK_MANY)
    try:
        locks = lock_many(fast, keys, 30)
        assert handed == [] and [lock.key for lock in locks] == keys
        fast.unlock_many(locks)
        for twice in (keys[0], keys[-1], keys[n // 2]):
            with pytest.raises(ValueError):
                lock_many(fast, [*keys, twice], 30)
            assert len(handed) == 1 and handed.pop()[0] == [*keys, twice]
        with pytest.raises(ValueError):
            lock_many(fast, [*keys, keys[-1].decode() if isinstance(keys[-1], bytes) else keys[-1].encode()], 30)
        assert len(handed) == 1
    finally:
        native.cache_batch(NativeCache, PY_LOCK_MANY, PY_UNLOCK_MANY)


def test_unlock_many_refuses_as_the_python_method_does(fast: hotlock.Cache, redis_server: RedisServer) -> None:
    other = hotlock.connect(redis_server.url, backend="native")
    redispy = hotlock.connect(redis_server.url, backend="redis-py")
    try:
        mine = fast.lock("mine", 30)
        theirs = other.lock("theirs", 30)
        plain = redispy.lock("plain", 30)
        for args, kwargs in [
            (("k",), {}),
            ((b"k",), {}),
            ((5,), {}),
            (([mine, 3],), {}),
            (([mine, "k"],), {}),
            (([mine, theirs],), {}),  # another cache's lock
            ((([mine, plain]),), {}),  # another backend's
            (((mine, theirs),), {}),
            (([mine], 1), {}),
            ((), {}),
        ]:
            errors: list[BaseException] = []

            def both(
                args: tuple[Any, ...] = args, kwargs: dict[str, Any] = kwargs, errors: list[BaseException] = errors
            ) -> None:
                for method in (NativeCache.unlock_many, PY_UNLOCK_MANY):
                    with pytest.raises((TypeError, ValueError)) as error:
                        method(fast, *args, **kwargs)
                    errors.append(error.value)

            nothing_sent([redis_server.client()], both)
            assert type(errors[0]) is type(errors[1]) and str(errors[0]) == str(errors[1]), args
        assert mine._token and theirs._token  # nothing released
        assert fast.unlock_many([mine]) == [True] and other.unlock_many([theirs]) == [True]
        assert plain.unlock() is True
    finally:
        other.close()
        redispy.close()


def test_the_python_methods_take_only_what_is_off_the_common_case(fast: hotlock.Cache, redis_url: str) -> None:
    calls: list[str] = []

    def lock_many(cache: hotlock.Cache, *args: Any, **kwargs: Any) -> list[Lock | None]:
        calls.append("lock_many")
        return PY_LOCK_MANY(cache, *args, **kwargs)

    def unlock_many(cache: hotlock.Cache, *args: Any, **kwargs: Any) -> list[bool]:
        calls.append("unlock_many")
        return PY_UNLOCK_MANY(cache, *args, **kwargs)

    native.cache_batch(NativeCache, lock_many, unlock_many)
    try:
        taken = fast.lock_many(["r-1", b"r-2"])
        taken += fast.lock_many(("r-3",), 30)
        taken += fast.lock_many(["r-4"], ttl=2.5, auto_extend=False, max_hold=None)
        assert fast.unlock_many([*taken, None]) == [True] * 4 + [False]
        assert fast.unlock_many(tuple(taken)) == [False] * 4  # released: nothing sent
        assert calls == []
        off = fast.lock_many(k for k in ["r-5"])  # a generator
        off += fast.lock_many([type("Key", (str,), {})("r-6")])  # not exactly str
        off += fast.lock_many(["r-7"], timedelta(seconds=3))
        off += fast.lock_many(["r-8"], 30, auto_extend=True)
        off += fast.lock_many(keys=["r-9"])
        assert fast.lock_many([]) == []
        assert calls == ["lock_many"] * 6
        assert fast.unlock_many(lk for lk in off[:1]) == [True]  # a generator
        assert fast.unlock_many(off[1:]) == [True] * 4  # an auto-extended lease among them
        assert calls == ["lock_many"] * 6 + ["unlock_many"] * 2
    finally:
        native.cache_batch(NativeCache, PY_LOCK_MANY, PY_UNLOCK_MANY)


def test_the_one_call_methods_read_as_the_python_ones() -> None:
    import inspect

    for fast_method, python in ((NativeCache.lock_many, PY_LOCK_MANY), (NativeCache.unlock_many, PY_UNLOCK_MANY)):
        assert fast_method is not python
        assert fast_method.__name__ == python.__name__
        assert inspect.getdoc(fast_method) == inspect.getdoc(python)
        bare = [p.replace(annotation=p.empty) for p in inspect.signature(python).parameters.values()]
        assert list(inspect.signature(fast_method).parameters.values())[1:] == bare[1:]


def test_a_metered_batch_reports_as_the_python_path(redis_server: RedisServer) -> None:
    from hotlock.metrics import BaseListener

    events: list[tuple[Any, ...]] = []

    class Recorder(BaseListener):
        def acquired(self, key: str | bytes, wait_s: float, attempts: int | None) -> None:
            events.append(("acquired", key, attempts))

        def not_acquired(self, key: str | bytes, outcome: str, wait_s: float) -> None:
            events.append(("not_acquired", key, outcome))

        def released(self, key: str | bytes, held_s: float) -> None:
            events.append(("released", key, held_s >= 0))

    metered = hotlock.connect(redis_server.url, backend="native", metrics=Recorder())
    holder = hotlock.connect(redis_server.url, backend="native")
    try:
        held = holder.lock("m-held", 30)
        keys = ["m-1", "m-held", b"m-2"]
        runs = []
        for path in (contextlib.nullcontext, python_paths):
            events.clear()
            with path():
                locks = metered.lock_many(keys, 30)
                assert all(lk._meter is not None for lk in locks if lk is not None)
                metered.unlock_many(locks)
            runs.append(list(events))
        assert (
            runs[0]
            == runs[1]
            == [
                ("acquired", "m-1", 1),
                ("not_acquired", "m-held", "held"),
                ("acquired", b"m-2", 1),
                ("released", "m-1", True),
                ("released", b"m-2", True),
            ]
        )
        assert held.unlock() is True
    finally:
        metered.close()
        holder.close()


def test_a_lost_batch_reply_is_resent_with_the_same_tokens(redis_server: RedisServer) -> None:
    with FaultProxy(redis_server.port) as proxy:
        cache = hotlock.connect(proxy.url, backend="native", timeout=0.5, connect_timeout=0.5)
        try:
            keys = [f"lost-{i}" for i in range(20)]
            first = cache.lock("lost-0", 30)  # connected: the next reply lost is the batch's
            proxy.drop_replies(1)
            locks = cache.lock_many(keys, 10)
            assert proxy.dropped_replies == 1
            assert locks[0] is None  # held by the lock above, whatever the retry
            client = redis_server.client()
            for lock in locks[1:]:
                assert lock is not None and client.get(lock._name) == lock._token
            proxy.drop_replies(1)
            # It ran, its reply was lost, the retry found the keys gone: no error, no key left.
            assert len(cache.unlock_many(locks)) == 20
            assert proxy.dropped_replies == 2
            assert all(lock is None or lock._token == b"" for lock in locks)
            assert all(client.get(lock_name(k)) is None for k in keys[1:])
            assert first.unlock() is True
        finally:
            cache.close()


# -- a cluster ---------------------------------------------------------------------------


def test_the_one_call_batch_on_a_cluster_is_the_python_paths(redis_cluster: Cluster, cluster_url: str) -> None:
    """Routed in C (ClusterRouter.many) on both paths: the same commands on each primary,
    the same leases, the same results."""
    cache = hotlock.connect(cluster_url, backend="native")
    try:
        assert type(cache) is NativeCache and cache._take is not None
        primaries = [redis_cluster.client(p) for p in redis_cluster.primary_ports()]
        holder = cache.lock("c-held", 30)
        keys: list[str | bytes] = [f"c-{i}" for i in range(60)] + ["c-held", b"c-bytes", "tenant-7}:x", "tenant-7}:y"]
        a, b, sent = run_both(cache, primaries, keys, 10)
        # Every key's transaction on its own primary, the one held key then by script.
        assert sum(s.get("exec", 0) for s in sent) == len(keys)
        assert sum(s.get("evalsha", 0) for s in sent) == 1
        assert sum(1 for s in sent if s.get("exec")) == 3
        assert [lk is None for lk in a] == [lk is None for lk in b] == [k == "c-held" for k in keys]
        assert_same_leases(a, b, keys)
        fast_results, fast_sent = sent_by(primaries, lambda: cache.unlock_many(b))
        c = cache.lock_many(keys, 10)
        with python_paths():
            slow_results, slow_sent = sent_by(primaries, lambda: cache.unlock_many(c))
        assert fast_results == slow_results == [k != "c-held" for k in keys]
        assert fast_sent == slow_sent
        assert holder.unlock() is True
        assert all(p.dbsize() == 0 for p in primaries)
    finally:
        cache.close()


def _router_with(table: list[int]) -> Any:
    from types import SimpleNamespace

    from hotlock._native import ClusterRouter

    router = ClusterRouter(SimpleNamespace(timeout=1.0), SimpleNamespace(stale=False))
    nodes = max((n for n in table if n != 0xFFFF), default=-1) + 1
    router.set_map(array("H", table).tobytes(), [("127.0.0.1", 7000 + i) for i in range(nodes)], [None] * nodes)
    return router


@pytest.mark.parametrize(
    "table",
    [
        [0] * 5461 + [1] * 5462 + [2] * 5461,  # a new cluster's three ranges
        [0xFFFF] * 16384,  # nothing served yet
        [0] * 100 + [0xFFFF] * 16184 + [1] * 100,  # unserved slots between
        [(s // 256) % 3 for s in range(16384)],  # 64 runs: the most kept as runs
        [(s // 252) % 3 for s in range(16384)],  # 66 runs: the table is used
        [s % 7 for s in range(16384)],  # a run per slot
    ],
)
def test_a_routers_runs_of_slots_name_the_nodes_its_table_does(table: list[int]) -> None:
    router = _router_with(table)
    assert [router.node_of_slot(s) for s in range(16384)] == [(n, n) for n in table]
    with pytest.raises(ValueError):
        router.node_of_slot(16384)


def test_a_live_clusters_runs_name_the_nodes_its_table_does(redis_cluster: Cluster, cluster_url: str) -> None:
    cache = hotlock.connect(cluster_url, backend="native")
    try:
        router = cache._backend._router  # type: ignore[attr-defined]
        pairs = [router.node_of_slot(s) for s in range(16384)]
        assert all(runs == table != 0xFFFF for runs, table in pairs)
        assert len({table for _, table in pairs}) == 3
    finally:
        cache.close()


def test_a_list_changed_during_the_round_trip_changes_nothing(redis_server: RedisServer) -> None:
    """The caller's list is read once, before anything is sent, as the Python methods' list()
    does: another thread emptying it while the round trip runs (without the GIL) changes
    neither the leases nor the results."""
    import threading

    with FaultProxy(redis_server.port) as proxy:
        cache = hotlock.connect(proxy.url, backend="native")
        try:
            cache.lock("connect", 1).unlock()
            keys: list[str | bytes] = [f"changed-{i}" for i in range(50)]
            given = list(keys)
            proxy.delay(0.3)
            emptier = threading.Timer(0.1, keys.clear)
            emptier.start()
            locks = cache.lock_many(keys, 30)
            emptier.join()
            assert keys == [] and [lk.key if lk else None for lk in locks] == given
            held = list(locks)
            emptier = threading.Timer(0.1, held.clear)
            emptier.start()
            assert cache.unlock_many(held) == [True] * 50
            emptier.join()
            assert held == [] and all(lk is not None and lk._token == b"" for lk in locks)
        finally:
            proxy.clear()
            cache.close()
