"""Client CPU per operation of hotlock trees against each other and the C loop, interleaved:
``python -m bench.abcpu cycle|extend|batch|async|cluster [TREE ...]``.

Each TREE is a checkout with its extension built in place (``src/hotlock/_native*.so``);
the default is this one. Every round runs each tree's native cycle, extend or batch
(``lock_many`` of 100 fresh keys, then ``unlock_many``; the keys made as the bench's batch
workload makes them, one f-string each, which the C loop does with snprintf) in a fresh
interpreter (``PYTHONPATH=TREE/src``), then the C loop, all pinned like ``--one-core``
(server and client on one core, or ``--split``), so a before/after comparison is taken on
the same server in the same minutes. Client CPU (getrusage) per operation moves less with
other work on the machine than rates do; medians over the rounds are printed.

``async`` is the cycle through ``hotlock.aio`` (native backend) on uvloop, 100 tasks on one
client, each locking and unlocking fresh keys (the bench's "100 tasks on uvloop" row); ``x
C`` is against the C loop's cycle (below 1 is possible: the tasks share each read and
write, the C loop makes one round trip per call). ``cluster`` is the sync native cycle on a
3-primary Redis Cluster (tests.cluster's, as bench.cluster starts it, no replicas; every
node pinned where the server is), each round with the same tree's cycle on the one server
beside it: ``x 1 server`` is the cluster's client CPU over that one-server cycle
(bench.cluster's "x one server"), the routing's own cost, apart from the core the two paths
share, which is what a change to the cluster path moves; ``x C`` is printed as for the
other workloads.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

from . import ceiling
from .server import pin_running, pinning, start_redis

ROOT = Path(__file__).resolve().parent.parent
TASKS = 100  # the async workload's tasks on one client

# The child: N operations as the bench's runs do them (a Python call per operation; async:
# TASKS tasks sharing them). Only API every tree has: run it against the oldest one kept.
CHILD = f"""
import itertools, resource, sys, time
import hotlock
def cpu():
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime
url, what, n, tag = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4]
serial = itertools.count()
if what == "async":
    import asyncio, uvloop, hotlock.aio
    runner = asyncio.Runner(loop_factory=uvloop.new_event_loop)
    cache = runner.run(hotlock.aio.connect(url, backend="native"))
    async def task(m):
        for _ in range(m):
            await (await cache.lock(f"abcpu:{{tag}}:{{next(serial)}}", 30)).unlock()
    async def cycles(k):
        await asyncio.gather(*(task(k // {TASKS} + (i < k % {TASKS})) for i in range({TASKS})))
    def run(k):
        runner.run(cycles(k))
else:
    cache = hotlock.connect(url, backend="native")
    if what == "extend":
        held = cache.lock(f"abcpu:held:{{tag}}", 30)
        op = lambda: held.extend(30)
    elif what == "batch":
        def op():
            cache.unlock_many(cache.lock_many([f"abcpu:{{tag}}:{{next(serial)}}" for _ in range(100)], 30))
    else:
        op = lambda: cache.lock(f"abcpu:{{tag}}:{{next(serial)}}", 30).unlock()
    def run(k):
        for _ in range(k):
            op()
run(n // 10)
c0, t0 = cpu(), time.perf_counter()
run(n)
print((cpu() - c0) / n * 1e6, n / (time.perf_counter() - t0))
"""


@contextlib.contextmanager
def _cluster(core: int | None) -> Iterator[str]:
    """bench.cluster's cluster: 3 primaries, no replicas, pinned to ``core``; its url."""
    from tests.cluster import start_cluster

    cluster = start_cluster(replicas=0)
    try:
        if core is not None:
            pin_running([n.pid for n in cluster.nodes if n.pid is not None], core)
        yield cluster.url
    finally:
        cluster.stop()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.abcpu", description=__doc__.splitlines()[0])
    ap.add_argument("workload", choices=("cycle", "extend", "batch", "async", "cluster"))
    ap.add_argument("trees", nargs="*", type=Path, default=[ROOT])
    ap.add_argument("--split", action="store_true", help="server and client on different cores")
    ap.add_argument("--runs", type=int, default=7)
    ap.add_argument("--ops", type=int, help="operations per run (default 60,000; 1,000 batches)")
    args = ap.parse_args(argv)
    if args.ops is None:
        args.ops = 1_000 if args.workload == "batch" else 60_000
    pin = pinning(one_core=not args.split)
    client = pin.prefix(pin.client)
    exe, why = ceiling.build()
    if exe is None:
        raise SystemExit(f"the C loop: {why}")
    # What the child runs, and the C loop: the async and cluster workloads are cycles.
    what = {"cluster": "cycle"}.get(args.workload, args.workload)
    c_mode = {"async": "cycle"}.get(what, what)
    with contextlib.ExitStack() as stack:
        server = stack.enter_context(start_redis(pin.server))
        # (row, tree, url); on a cluster each tree runs on the one server too, its reference.
        runs = [(str(t), t, server.url) for t in args.trees]
        one_server: dict[str, str] = {}
        if args.workload == "cluster":
            cluster_url = stack.enter_context(_cluster(pin.server))
            runs = []
            for t in args.trees:
                runs += [(f"{t} 1 server", t, server.url), (f"{t} cluster", t, cluster_url)]
                one_server[f"{t} cluster"] = f"{t} 1 server"
        rows: dict[str, list[tuple[float, float]]] = {name: [] for name, _, _ in runs}
        rows["C loop"] = []
        for i in range(args.runs):
            for n, (name, tree, url) in enumerate(runs):
                env = dict(os.environ, PYTHONPATH=str(tree.resolve() / "src"))
                cmd = [*client, sys.executable, "-c", CHILD, url, what, str(args.ops), f"{i}-{n}"]
                done = subprocess.run(cmd, env=env, capture_output=True, text=True, cwd="/", check=False)
                if done.returncode != 0:
                    raise SystemExit(f"{name}: {done.stderr.strip()[-500:]}")
                cpu_us, rate = map(float, done.stdout.split())
                rows[name].append((cpu_us, rate))
            r = ceiling.run_c(exe, server.host, server.port, c_mode, 0.5, f"abcpu{i}{os.getpid()}", client)
            rows["C loop"].append((r["cpu"] / r["ops"] * 1e6, r["ops"] / r["seconds"]))
    cpus = {name: statistics.median(v[0] for v in values) for name, values in rows.items()}
    plural = {"batch": "batches", "extend": "extends"}.get(what, "cycles")
    how = {"async": f" ({TASKS} tasks on uvloop)", "cluster": " (1 server, then the cluster)"}.get(args.workload, "")
    print(f"pinning: {pin.note}; {args.runs} rounds of {args.ops:,} {plural}{how}; load {os.getloadavg()[0]:.2f}")
    # speed x C: each round's rate over the C loop's in the same round, the median of those
    # (a paired ratio moves less with the machine's load than either rate does).
    print(f"{'':<40}{'CPU µs/op':>10}{'x C':>7}{'ops/s':>10}{'speed x C':>11}" + ("  x 1 server" if one_server else ""))
    for name, values in rows.items():
        rate = statistics.median(v[1] for v in values)
        speed = statistics.median(v[1] / c[1] for v, c in zip(values, rows["C loop"], strict=True))
        line = f"{name[-40:]:<40}{cpus[name]:>10.2f}{cpus[name] / cpus['C loop']:>7.2f}{rate:>10,.0f}{speed:>11.2f}"
        if name in one_server:
            line += f"{cpus[name] / cpus[one_server[name]]:>12.2f}"
        print(line)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
