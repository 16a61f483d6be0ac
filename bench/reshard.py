"""python -m bench.reshard: resharding and failover under load, the full forms of tests/test_reshard.py.

Writes bench/results-reshard.md (``make bench`` runs it after bench.cluster): for each
operation, server kind and backend, 8 threads lock and unlock keys spread over every slot
(tests/reshard.py) while the operation runs, on a cluster of its own:

- ``redis-cli --cluster reshard`` of a third of the slots (16384/3) from one primary to another;
- the same of 1000 slots with all the load on them (10 locks and 200 other keys per slot:
  each slot's MIGRATE takes a while, so the calls meet it MIGRATING and go ASKING);
- ``redis-cli --cluster add-node`` of a fourth primary, ``rebalance
  --cluster-use-empty-masters``, a drain (``rebalance --cluster-weight <it>=0``), ``del-node``;
- a plain ``CLUSTER FAILOVER`` to a replica once a tenth of a reshard is done (the third
  shard's replica, or the resharded source's own), then ``--cluster fix`` and the rest;
- Valkey 9's atomic ``CLUSTER MIGRATESLOTS`` of a third of the slots.

Not pinned: what is measured is what breaks (errors by kind, overlaps), not a rate.
"""

from __future__ import annotations

import argparse
import os
import platform
import subprocess
import sys
import time
from collections.abc import Callable

import pytest

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from tests.cluster import Cluster, start_cluster
from tests.reshard import (
    THIRD,
    Report,
    add_rebalance_drain_delete,
    counted,
    failover_during_reshard,
    fill,
    hot_keys,
    hot_tags,
    migrate_slots,
    reshard,
    run_under_load,
    three_primaries,
)

Operation = Callable[[Cluster], Callable[[Report], None]]


def _reshard(cluster: Cluster) -> Callable[[Report], None]:
    source, target, _ = three_primaries(cluster)
    return reshard(cluster, source, target, THIRD)


def _reshard_hot(cluster: Cluster) -> Callable[[Report], None]:
    source, target, _ = three_primaries(cluster)
    first, _ = cluster.primaries()[source]
    fill(cluster.client(source), HOT_TAGS.setdefault(first, hot_tags(first, first + HOT_SLOTS - 1)), 200)
    return reshard(cluster, source, target, HOT_SLOTS)


HOT_SLOTS = 1000
HOT_TAGS: dict[int, list[str]] = {}  # the first slot of the source -> the tags of its first HOT_SLOTS


def _failover(shard: str) -> Operation:
    def make(cluster: Cluster) -> Callable[[Report], None]:
        source, target, bystander = three_primaries(cluster)
        return failover_during_reshard(cluster, source, target, bystander if shard == "bystander" else source)

    return make


def _migrate_slots(cluster: Cluster) -> Callable[[Report], None]:
    source, target, _ = three_primaries(cluster)
    first, last = cluster.primaries()[source]
    return migrate_slots(cluster, source, target, first, last - 1)


# (operation, server kind, replicas per primary, what makes it on a fresh cluster)
OPERATIONS: list[tuple[str, str, int, Operation]] = [
    ("redis-cli --cluster reshard 1/3", "redis", 0, _reshard),
    ("redis-cli --cluster reshard 1/3", "valkey", 0, _reshard),
    (f"redis-cli --cluster reshard of {HOT_SLOTS} hot slots", "redis", 0, _reshard_hot),
    ("add-node, rebalance, drain, del-node", "redis", 0, add_rebalance_drain_delete),
    ("CLUSTER FAILOVER (third shard) mid-reshard", "redis", 1, _failover("bystander")),
    ("CLUSTER FAILOVER (source shard) mid-reshard", "redis", 1, _failover("source")),
    ("CLUSTER MIGRATESLOTS 1/3 (atomic)", "valkey", 0, _migrate_slots),
]


def measure(name: str, kind: str, replicas: int, make: Operation, backend: str, keys: int) -> Report:
    cluster = start_cluster(3, replicas, kinds=[kind] * (3 * (1 + replicas)))
    report = Report(name, kind, backend)
    try:
        operation = make(cluster)
        names = None
        if make is _reshard_hot:
            # All the load on the slots that move (10 locks each), 200 other keys in each.
            names = hot_keys(HOT_TAGS[cluster.primaries()[three_primaries(cluster)[0]][0]], 10)
        run_under_load(cluster.url, backend, counted(cluster, operation), report, keys=keys, names=names)
    except (Exception, pytest.fail.Exception) as exc:  # a failed operation is a row of the table
        report.notes.append(f"FAILED: {str(exc).splitlines()[0][:300]}")
    finally:
        cluster.stop()
    print(report.line(), flush=True)
    return report


def main() -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--keys", type=int, default=5000, help="keys the load spreads over the slots")
    parser.add_argument("--backends", default="native,redis-py", help="comma-separated")
    parser.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results-reshard.md"))
    args = parser.parse_args()
    load_before = os.getloadavg()
    reports = [
        measure(name, kind, replicas, make, backend, args.keys)
        for name, kind, replicas, make in OPERATIONS
        for backend in args.backends.split(",")
    ]
    load_after = os.getloadavg()
    git = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    cli = subprocess.run(["redis-cli", "--version"], capture_output=True, text=True).stdout.strip()
    lines = [
        "# hotlock under resharding and failover",
        "",
        "Generated by `python -m bench.reshard` (`make bench` runs it too); the short forms of the same"
        " runs are tests/test_reshard.py.",
        "",
        f"- {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, git {git}; machine: {platform.machine()},"
        f" {os.cpu_count()} cores; Python {platform.python_version()}; {cli}",
        f"- load average at start {load_before[0]:.2f}, at end {load_after[0]:.2f} (other work shares the cores)",
        f"- load: 8 threads on one cache, try-once `lock(ttl=5)` on {args.keys} keys spread over every slot, a"
        " 0.5 ms critical section seen by the overlap checker (tests/overlap.py), `unlock()`; reply timeout 2 s",
        "- each row on a fresh 3-primary cluster (with one replica each for the failover rows); duration is the"
        " operation's own; sections: all completed (those completed while the operation ran); conflicts:"
        " LockNotAcquired, another thread held the key; server side: the ASKING commands the nodes served and"
        " the MOVED/ASK/TRYAGAIN/CLUSTERDOWN replies they gave (INFO commandstats, errorstats) while the"
        " operation ran, on the nodes still there at its end",
        "",
        "| operation | server | backend | duration | sections (during) | conflicts | errors by kind | overlaps |"
        " server side | notes |",
        "|---|---|---|--:|--:|--:|---|--:|---|---|",
    ]
    lines += [
        f"| {r.operation} | {r.server} | {r.backend} | {r.seconds:.1f} s | {r.sections:,} ({r.during:,}) |"
        f" {r.conflicts:,} | {r.errors_text()} | {r.overlaps} | {r.redirects_text()} | {'; '.join(r.notes)} |"
        for r in reports
    ]
    samples = {kind: text for r in reports for kind, text in r.samples.items()}
    if samples:
        lines += ["", "One message of each error kind:", ""]
        lines += [f"- `{kind}`: {text}" for kind, text in sorted(samples.items())]
    lines.append("")
    with open(args.out, "w") as out:
        out.write("\n".join(lines))
    print("\n".join(lines))
    return 1 if any(r.overlaps for r in reports) else 0


if __name__ == "__main__":
    raise SystemExit(main())
