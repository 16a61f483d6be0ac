"""Resharding and failover under load, with the operators' own tools (tests/reshard.py):
``redis-cli --cluster reshard`` of a third of the slots, ``add-node`` + ``rebalance`` +
drain + ``del-node`` of a fourth primary, a plain ``CLUSTER FAILOVER`` in the middle of a
reshard, and Valkey 9's atomic ``CLUSTER MIGRATESLOTS``, each while 8 threads lock and
unlock keys over every slot. Zero overlaps everywhere; the errors are counted by kind and
each test says which it allows (see docs/cluster.md, "Resharding and failover under load").

Each test has its own cluster: the operations change its shape. The short forms run in
make test (a few seconds of load each); the full forms (more keys, every sync backend,
the failover of the resharded shard itself) are marked slow.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

import pytest

from .cluster import Cluster, start_cluster
from .reshard import (
    THIRD,
    Report,
    add_rebalance_drain_delete,
    counted,
    failover_during_reshard,
    fill,
    hot_keys,
    hot_tags,
    migrate_slots,
    plain_failover,
    reshard,
    run_under_load,
    three_primaries,
)


@pytest.fixture
def redis_cluster3() -> Iterator[Cluster]:
    cluster = start_cluster(3, 0)
    yield cluster
    cluster.stop()


@pytest.fixture
def replicated_cluster() -> Iterator[Cluster]:
    cluster = start_cluster(3, 1)
    yield cluster
    cluster.stop()


@pytest.fixture
def valkey_cluster() -> Iterator[Cluster]:
    cluster = start_cluster(3, 0, kinds=["valkey"] * 3)
    yield cluster
    cluster.stop()


def run(
    cluster: Cluster,
    backend: str,
    name: str,
    server: str,
    operation: Callable[[Report], None],
    keys: int,
    names: list[str] | None = None,
) -> Report:
    report = run_under_load(
        cluster.url, backend, counted(cluster, operation), Report(name, server, backend), keys=keys, names=names
    )
    print(report.line())  # the report line (pytest -s, or -rA) shows what the run came to
    for kind, text in report.samples.items():
        print(f"  {kind}: e.g. {text}")
    # The load ran while the operation did, and nobody shared a key's section.
    assert report.during > 0, report.line()
    assert report.overlaps == 0, report.line()
    # ... and it met the slots changing hands (MOVED at least), not only slots at rest.
    assert sum(report.redirects.values()) > 0, report.line()
    # An unlock that found its lock gone, or anything but CacheError, is a bug anywhere.
    assert report.others == 0, report.samples
    return report


# -- a: redis-cli --cluster reshard of a third of the slots ---------------------------------


def _reshard(cluster: Cluster, backend: str, keys: int) -> None:
    source, target, _ = three_primaries(cluster)
    report = run(cluster, backend, "reshard 1/3", "redis", reshard(cluster, source, target, THIRD), keys)
    # Every redirection a reshard causes (MOVED, ASK, TRYAGAIN) is retried by the rules in
    # Route: a CacheError here is a lock call that gave up where it should have gone on.
    assert report.cache_errors == 0, report.samples


def test_reshard_a_third_under_load(redis_cluster3: Cluster) -> None:
    _reshard(redis_cluster3, "native", 600)


@pytest.mark.slow
@pytest.mark.parametrize("backend", ["native", "redis-py"])
def test_reshard_a_third_under_load_full(backend: str, redis_cluster3: Cluster) -> None:
    _reshard(redis_cluster3, backend, 5000)


def _reshard_hot(cluster: Cluster, backend: str, slots: int, per_slot: int) -> None:
    """All the load on the slots the reshard moves, each slot holding 200 other keys (its
    MIGRATE takes a while): many calls meet their slot MIGRATING (a lock's key exists only
    while held, so the source answers ASK and the call goes ASKING to the target) or just
    moved (MOVED), and none fails."""
    source, target, _ = three_primaries(cluster)
    first, _ = cluster.primaries()[source]
    # redis-cli takes a source's slots lowest first.
    tags = hot_tags(first, first + slots - 1)
    fill(cluster.client(source), tags, 200)
    names = hot_keys(tags, per_slot)
    operation = reshard(cluster, source, target, slots)
    report = run(cluster, backend, f"reshard of {slots} hot slots", "redis", operation, 0, names)
    assert report.redirects["ASKING"] > 0, report.line()
    assert report.cache_errors == 0, report.samples


@pytest.mark.parametrize("backend", ["native", "redis-py"])
def test_reshard_of_the_slots_under_load(backend: str, redis_cluster3: Cluster) -> None:
    _reshard_hot(redis_cluster3, backend, 100, 20)


@pytest.mark.slow
@pytest.mark.parametrize("backend", ["native", "redis-py"])
def test_reshard_of_the_slots_under_load_full(backend: str, redis_cluster3: Cluster) -> None:
    _reshard_hot(redis_cluster3, backend, 1000, 10)


# -- b: a fourth primary added, rebalanced onto, drained and deleted ----------------------


def _add_and_remove(cluster: Cluster, backend: str, keys: int) -> None:
    report = run(
        cluster, backend, "add-node, rebalance, drain, del-node", "redis", add_rebalance_drain_delete(cluster), keys
    )
    assert report.cache_errors == 0, report.samples
    assert len(cluster.primary_ports()) == 3


def test_add_rebalance_drain_delete_under_load(redis_cluster3: Cluster) -> None:
    _add_and_remove(redis_cluster3, "native", 300)


@pytest.mark.slow
@pytest.mark.parametrize("backend", ["native", "redis-py"])
def test_add_rebalance_drain_delete_under_load_full(backend: str, redis_cluster3: Cluster) -> None:
    _add_and_remove(redis_cluster3, backend, 5000)


# -- c: a plain CLUSTER FAILOVER in the middle of a reshard -------------------------------


def _failover(cluster: Cluster, backend: str, keys: int, shard: str, slots: int) -> Report:
    source, target, bystander = three_primaries(cluster)
    promoted = {"bystander": bystander, "source": source}[shard]
    operation = failover_during_reshard(cluster, source, target, promoted, slots)
    return run(cluster, backend, f"failover of the {shard} shard mid-reshard", "redis", operation, keys)


def test_failover_in_the_middle_of_a_reshard(replicated_cluster: Cluster) -> None:
    """The failover pauses the old primary's writes until its replica has caught up; a
    lock call that meets the pause may lose its reply and its one retry (CacheError):
    counted, never an overlap. The rest of the reshard still completes."""
    # A sixth of the slots: the failover comes a tenth of the way in either way, and the
    # short form stays short.
    report = _failover(replicated_cluster, "native", 600, "bystander", THIRD // 2)
    assert any("while the reshard ran" in note for note in report.notes), report.line()


@pytest.mark.slow
@pytest.mark.parametrize("shard", ["bystander", "source"])
@pytest.mark.parametrize("backend", ["native", "redis-py"])
def test_failover_in_the_middle_of_a_reshard_full(backend: str, shard: str, replicated_cluster: Cluster) -> None:
    _failover(replicated_cluster, backend, 5000, shard, THIRD)


@pytest.mark.slow
@pytest.mark.parametrize("backend", ["native", "redis-py"])
def test_a_plain_failover_under_16_threads_costs_no_error(backend: str, replicated_cluster: Cluster) -> None:
    """A manual failover with no reshard around it: the old primary's MOVED and its pause
    are retried within each call's budget, so none of 16 threads sees an error."""
    cluster = replicated_cluster
    cluster.wait_synced()
    operation = counted(cluster, plain_failover(cluster, cluster.primary_ports()[0]))
    report = run_under_load(
        cluster.url, backend, operation, Report("CLUSTER FAILOVER", "redis", backend), threads=16, settle_s=1.0
    )
    print(report.line())
    assert report.overlaps == 0 and report.cache_errors == 0, report.samples


# -- d: Valkey 9's atomic slot migration -----------------------------------------------------


def _migrate_slots(cluster: Cluster, backend: str, keys: int) -> None:
    source, target, _ = three_primaries(cluster)
    first, last = cluster.primaries()[source]
    report = run(
        cluster,
        backend,
        "CLUSTER MIGRATESLOTS 1/3",
        "valkey",
        migrate_slots(cluster, source, target, first, last - 1),
        keys,
    )
    # The slots change hands in one step, with the source's writes paused meanwhile: no
    # ASK, no TRYAGAIN, a MOVED at most. Nothing may fail.
    assert report.cache_errors == 0, report.samples


@pytest.mark.parametrize("backend", ["native", "redis-py"])
def test_atomic_slot_migration_under_load(backend: str, valkey_cluster: Cluster) -> None:
    _migrate_slots(valkey_cluster, backend, 600)


@pytest.mark.slow
@pytest.mark.parametrize("backend", ["native", "redis-py"])
def test_atomic_slot_migration_under_load_full(backend: str, valkey_cluster: Cluster) -> None:
    _migrate_slots(valkey_cluster, backend, 20000)
