"""python -m bench.cluster: one redis-server against a 3-primary Redis Cluster, both on loopback.

Writes bench/results-cluster.md (``make bench`` runs it after the peer comparison):

- cycle: acquire + release of a fresh key, one thread, and the same from 8 threads;
- extend: one held lock extended again and again, one thread;
- async cycle: the same acquire + release through hotlock.aio, one task;
- batch: lock_many(100) + unlock_many(100) on fresh keys (over every shard on the cluster);
- contention: 8 threads on 16 keys with lock_wait, sections/s;
- server CPU per cycle on each primary (INFO used_cpu_user + used_cpu_sys over the
  8-thread run), and from it what N shards on N cores would sustain: a projection.

On a 2-core machine the three primaries and the client share two cores, so the cluster
cannot show its scale-out here; the per-primary CPU is what carries over. Two placements
(``--placement``), both pinned with ``taskset``/sched_setaffinity so the other work on
the machine moves less of the figures: ``split`` puts every server on core 0 and the
client on core 1, ``one-core`` puts everything on core 0.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import platform
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import redis

import hotlock
import hotlock.aio

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from tests.cluster import start_cluster
from tests.conftest import start_redis

from .ceiling import build, run_c
from .server import pin_running

THREADS = 8
BATCH = "lock_many(100) + unlock_many(100)"
BATCH_CPU = "client CPU per batch of 100"


@dataclass
class Row:
    workload: str
    backend: str
    topology: str
    rate: float
    unit: str


_PLACES = {
    "split": "every redis-server pinned to core 0 (taskset -apc 0), the client to core 1 (sched_setaffinity)",
    "one-core": "every redis-server and the client pinned to core 0 (taskset -apc 0, sched_setaffinity)",
    "none": "not pinned",
}


def _cpu(client: redis.Redis) -> float:
    info = client.info("cpu")
    return float(info["used_cpu_user"]) + float(info["used_cpu_sys"])


def _timed(seconds: float, threads: int, step: Callable[[int, int], int]) -> float:
    """Run step(thread, i) in ``threads`` threads for ``seconds``; units done per second
    (the client's CPU per unit goes to _CPU_US, for the one-thread cycle row)."""
    counts = [0] * threads
    stop = time.monotonic() + seconds

    def run(n: int) -> None:
        i = 0
        done = 0
        while time.monotonic() < stop:
            done += step(n, i)
            i += 1
        counts[n] = done

    pool = [threading.Thread(target=run, args=(n,)) for n in range(threads)]
    started = time.monotonic()
    cpu = time.process_time()
    for t in pool:
        t.start()
    for t in pool:
        t.join()
    _CPU_US.append((time.process_time() - cpu) / max(sum(counts), 1) * 1e6)
    return sum(counts) / (time.monotonic() - started)


_CPU_US: list[float] = []


def measure(
    url: str, backend: str, topology: str, seconds: float, sides: list[redis.Redis]
) -> tuple[list[Row], list[float]]:
    cache = hotlock.connect(url, backend=backend)
    rows = []
    tag = f"{backend}-{topology}"

    def cycle(n: int, i: int) -> int:
        cache.lock(f"c-{tag}-{n}-{i}", ttl=10).unlock()
        return 1

    rows.append(Row("cycle, 1 thread", backend, topology, _timed(seconds, 1, cycle), "cycles/s"))
    rows.append(Row("client CPU per cycle, 1 thread", backend, topology, _CPU_US[-1], "µs"))
    held = cache.lock(f"e-{tag}", ttl=10)

    def extend(n: int, i: int) -> int:
        held.extend()
        return 1

    rows.append(Row("extend, 1 thread", backend, topology, _timed(seconds, 1, extend), "extends/s"))
    rows.append(Row("client CPU per extend, 1 thread", backend, topology, _CPU_US[-1], "µs"))
    held.unlock()
    rate, cpu_us = asyncio.run(_async_cycle(url, backend, tag, seconds))
    rows.append(Row("async cycle, 1 task", backend, topology, rate, "cycles/s"))
    rows.append(Row("client CPU per async cycle, 1 task", backend, topology, cpu_us, "µs"))
    before = [_cpu(s) for s in sides]
    count = [0]

    def counted(n: int, i: int) -> int:
        cycle(n, i)
        count[0] += 1
        return 1

    rows.append(Row(f"cycle, {THREADS} threads", backend, topology, _timed(seconds, THREADS, counted), "cycles/s"))
    cpu_per_cycle = [(_cpu(s) - b) / max(count[0], 1) * 1e6 for s, b in zip(sides, before, strict=True)]

    def batch(n: int, i: int) -> int:
        locks = cache.lock_many([f"b-{tag}-{i}-{j}" for j in range(100)], ttl=10)
        cache.unlock_many([lock for lock in locks if lock is not None])
        return 1

    rows.append(Row(BATCH, backend, topology, _timed(seconds, 1, batch), "batches/s"))
    rows.append(Row(BATCH_CPU, backend, topology, _CPU_US[-1], "µs"))

    def section(n: int, i: int) -> int:
        with cache.lock_wait(f"hot-{tag}-{(n * 7 + i) % 16}", ttl=10, wait=5):
            pass
        return 1

    rows.append(
        Row(
            f"contention, {THREADS} threads on 16 keys",
            backend,
            topology,
            _timed(seconds, THREADS, section),
            "sections/s",
        )
    )
    cache.close()
    return rows, cpu_per_cycle


def _c_batch(exe: Path, ports: list[int], topology: str, seconds: float, tag: str) -> list[Row]:
    """The C loop's batch (bench/ceiling.c): on a cluster, routed to the primaries by slot.
    It runs where the client is pinned: a child inherits the affinity."""
    done = run_c(exe, "127.0.0.1", ports[0], "batch", seconds, tag, [], ports[1:])
    return [
        Row(BATCH, "C loop", topology, done["ops"] / done["seconds"], "batches/s"),
        Row(BATCH_CPU, "C loop", topology, done["cpu"] / done["ops"] * 1e6, "µs"),
    ]


async def _async_cycle(url: str, backend: str, tag: str, seconds: float) -> tuple[float, float]:
    """Acquire + release of fresh keys through hotlock.aio, one task: (cycles/s, client CPU µs each)."""
    cache = await hotlock.aio.connect(url, backend=backend)
    try:
        done = 0
        stop = time.monotonic() + seconds
        started = time.monotonic()
        cpu = time.process_time()
        while time.monotonic() < stop:
            for _ in range(50):
                await (await cache.lock(f"a-{tag}-{done}", ttl=10)).unlock()
                done += 1
        return done / (time.monotonic() - started), (time.process_time() - cpu) / done * 1e6
    finally:
        await cache.close()


def _ratios(rows: list[Row]) -> list[str]:
    """The cluster against one server, per backend: client CPU and rate, each the ratio of
    the two medians; the C loop's batch is the floor, the kernel's own cost of three
    sockets against one with no Python in it."""
    at = {(r.workload, r.backend, r.topology): r.rate for r in rows}
    pairs = [
        ("client CPU per cycle, 1 thread", "cycle client CPU"),
        ("cycle, 1 thread", "cycle rate"),
        ("client CPU per extend, 1 thread", "extend client CPU"),
        ("extend, 1 thread", "extend rate"),
        ("client CPU per async cycle, 1 task", "async cycle client CPU"),
        ("async cycle, 1 task", "async cycle rate"),
        (BATCH_CPU, "batch client CPU"),
        (BATCH, "batch rate"),
    ]
    out = [
        "The 3-shard cluster against one server (cluster ÷ one server, medians):",
        "",
        "| backend | figure | ratio |",
        "|---|---|--:|",
    ]
    for backend in dict.fromkeys(r.backend for r in rows):
        for workload, name in pairs:
            one, three = at.get((workload, backend, "1 server")), at.get((workload, backend, "3-shard cluster"))
            if one and three:
                out.append(f"| {backend} | {name} | {three / one:.2f}\u00d7 |")
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=2.0)
    parser.add_argument("--rounds", type=int, default=3, help="interleaved rounds; the median is reported")
    parser.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results-cluster.md"))
    parser.add_argument("--backends", default="native,redis-py", help="comma-separated")
    parser.add_argument(
        "--placement",
        choices=("split", "one-core", "none"),
        default="split",
        help="split: servers on core 0, client on core 1; one-core: all on core 0; none: unpinned",
    )
    args = parser.parse_args()
    exe, how = build()
    if exe is None:
        print(f"bench.cluster: no C loop rows ({how})", file=sys.stderr)
    load_before = os.getloadavg()
    single = start_redis()
    cluster = start_cluster(replicas=0)
    if args.placement != "none":
        # The client pins itself before it starts any thread (new threads inherit it).
        pin_running([single.pid, *(n.pid for n in cluster.nodes)], 0)
        os.sched_setaffinity(0, {1 if args.placement == "split" else 0})
    try:
        version = single.client().info("server")["redis_version"]
        primaries = [cluster.client(p) for p in cluster.primary_ports()]
        runs: dict[tuple[str, str, str], list[Row]] = {}
        cpus: dict[tuple[str, str], list[list[float]]] = {}
        for n in range(args.rounds):
            for backend in args.backends.split(","):
                for url, topology, sides in (
                    (single.url, "1 server", [single.client()]),
                    (cluster.url, "3-shard cluster", primaries),
                ):
                    r, c = measure(url, backend, topology, args.seconds, sides)
                    for row in r:
                        runs.setdefault((row.workload, backend, topology), []).append(row)
                    cpus.setdefault((backend, topology), []).append(c)
            if exe is not None:
                for ports, topology in (([single.port], "1 server"), (cluster.primary_ports(), "3-shard cluster")):
                    for row in _c_batch(exe, ports, topology, args.seconds, f"c{n}"):
                        runs.setdefault((row.workload, row.backend, topology), []).append(row)
        rows = [
            Row(k[0], k[1], k[2], statistics.median(r.rate for r in v), v[0].unit)
            for k, v in sorted(runs.items(), key=lambda kv: (kv[0][1], kv[0][0], kv[0][2]))
        ]
        cpu = {k: [statistics.median(col) for col in zip(*v, strict=True)] for k, v in cpus.items()}
    finally:
        cluster.stop()
        single.stop()
    load_after = os.getloadavg()
    git = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    lines = [
        "# hotlock on Redis Cluster: one server vs 3 primaries",
        "",
        "Generated by `python -m bench.cluster` (`make bench` runs it too).",
        "",
        f"- {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, git {git}, {args.seconds:.1f} s per run, "
        f"median of {args.rounds} interleaved rounds",
        f"- machine: {platform.machine()}, {os.cpu_count()} cores; Python {platform.python_version()}; "
        f"redis-server {version}",
        f"- placement: {_PLACES[args.placement]}",
        f"- load average at start {load_before[0]:.2f}, at end {load_after[0]:.2f} (other work shares the cores)",
        "- the cluster: 3 primaries, no replicas, on the same loopback and the same 2 cores as the client and"
        " the single server (which is idle while the cluster runs)",
        "",
        "| workload | backend | topology | rate | unit |",
        "|---|---|---|--:|---|",
    ]
    # CPU to a tenth of a µs: on one core a cycle costs the client about 8 µs.
    lines += [
        f"| {r.workload} | {r.backend} | {r.topology} | {r.rate:,.{1 if r.unit == 'µs' else 0}f} | {r.unit} |"
        for r in rows
    ]
    lines += ["", *_ratios(rows)]
    lines += [
        "",
        "Client CPU per cycle is the steadier figure on a shared machine. The native cluster backend routes"
        " a healthy call in the extension (ext/_route.pxi), the redis-py one in Python (hotlock/backends/cluster.py).",
    ]
    lines += [
        "",
        f"Server CPU per acquire + release (µs, INFO used_cpu_user + used_cpu_sys over the {THREADS}-thread cycle"
        " run, divided by the cycles; on the cluster, per primary: each serves about a third):",
        "",
        "| backend | topology | server CPU µs per cycle, per primary |",
        "|---|---|---|",
    ]
    for (backend, topology), values in cpu.items():
        lines.append(f"| {backend} | {topology} | {', '.join(f'{v:.1f}' for v in values)} |")
    single_cpu = cpu[("native", "1 server")][0]
    # Each primary served about a third of the cycles, so the sum is the cluster's CPU per
    # cycle, and about what one primary spends on each cycle it serves.
    shard_cpu = sum(cpu[("native", "3-shard cluster")])
    lines += [
        "",
        "**Projection, not a measurement.** A primary of the cluster spent about "
        f"{shard_cpu:.0f} µs of CPU on each acquire + release it served (one server: {single_cpu:.0f} µs; the"
        " cluster's gossip and cron cost is spread over few cycles at these rates, so this is the pessimistic"
        f" figure). One primary on its own core would then top out near {1e6 / shard_cpu:,.0f} cycles/s, and N"
        f" primaries on N cores, with keys spread evenly and clients with cores to spare, near N x that"
        f" ({3e6 / shard_cpu:,.0f}/s for 3; {1e6 / single_cpu:,.0f}/s per core at the one-server figure)."
        " On this 2-core machine the three primaries and the client share two cores, so the measured cluster"
        " rows above show the routing cost, not the scale-out.",
        "",
    ]
    with open(args.out, "w") as out:
        out.write("\n".join(lines))
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
