"""Client CPU per operation of hotlock trees against each other and the C loop, interleaved:
``python -m bench.abcpu cycle|extend|batch [TREE ...]``.

Each TREE is a checkout with its extension built in place (``src/hotlock/_native*.so``);
the default is this one. Every round runs each tree's native cycle, extend or batch
(``lock_many`` of 100 fresh keys, then ``unlock_many``; the keys made as the bench's batch
workload makes them, one f-string each, which the C loop does with snprintf) in a fresh
interpreter (``PYTHONPATH=TREE/src``), then the C loop, all pinned like ``--one-core``
(server and client on one core, or ``--split``), so a before/after comparison is taken on
the same server in the same minutes. Client CPU (getrusage) per operation moves less with
other work on the machine than rates do; medians over the rounds are printed.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
from pathlib import Path

from . import ceiling
from .server import pinning, start_redis

ROOT = Path(__file__).resolve().parent.parent

# The child: N operations as the bench's sync runs do them (a Python call per operation).
CHILD = """
import itertools, resource, sys, time
import hotlock
def cpu():
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime
cache = hotlock.connect(sys.argv[1], backend="native")
what, n, serial = sys.argv[2], int(sys.argv[3]), itertools.count()
if what == "extend":
    held = cache.lock(f"abcpu:held:{sys.argv[4]}", 30)
    op = lambda: held.extend(30)
elif what == "batch":
    tag = sys.argv[4]
    def op():
        cache.unlock_many(cache.lock_many([f"abcpu:{tag}:{next(serial)}" for _ in range(100)], 30))
else:
    op = lambda: cache.lock(f"abcpu:{sys.argv[4]}:{next(serial)}", 30).unlock()
for _ in range(n // 10):
    op()
c0, t0 = cpu(), time.perf_counter()
for _ in range(n):
    op()
print((cpu() - c0) / n * 1e6, n / (time.perf_counter() - t0))
"""


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.abcpu", description=__doc__.splitlines()[0])
    ap.add_argument("workload", choices=("cycle", "extend", "batch"))
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
    rows: dict[str, list[tuple[float, float]]] = {str(t): [] for t in args.trees}
    rows["C loop"] = []
    with start_redis(pin.server) as server:
        for i in range(args.runs):
            for n, tree in enumerate(args.trees):
                env = dict(os.environ, PYTHONPATH=str(tree.resolve() / "src"))
                cmd = [*client, sys.executable, "-c", CHILD, server.url, args.workload, str(args.ops), f"{i}-{n}"]
                done = subprocess.run(cmd, env=env, capture_output=True, text=True, cwd="/", check=False)
                if done.returncode != 0:
                    raise SystemExit(f"{tree}: {done.stderr.strip()[-500:]}")
                cpu_us, rate = map(float, done.stdout.split())
                rows[str(tree)].append((cpu_us, rate))
            r = ceiling.run_c(exe, server.host, server.port, args.workload, 0.5, f"abcpu{i}{os.getpid()}", client)
            rows["C loop"].append((r["cpu"] / r["ops"] * 1e6, r["ops"] / r["seconds"]))
    c_cpu = statistics.median(cpu for cpu, _ in rows["C loop"])
    plural = "batches" if args.workload == "batch" else f"{args.workload}s"
    print(f"pinning: {pin.note}; {args.runs} rounds of {args.ops:,} {plural}; load {os.getloadavg()[0]:.2f}")
    # speed x C: each round's rate over the C loop's in the same round, the median of those
    # (a paired ratio moves less with the machine's load than either rate does).
    print(f"{'':<40}{'CPU µs/op':>10}{'x C':>7}{'ops/s':>10}{'speed x C':>11}")
    for name, values in rows.items():
        cpu = statistics.median(v[0] for v in values)
        rate = statistics.median(v[1] for v in values)
        speed = statistics.median(v[1] / c[1] for v, c in zip(values, rows["C loop"], strict=True))
        print(f"{name[-40:]:<40}{cpu:>10.2f}{cpu / c_cpu:>7.2f}{rate:>10,.0f}{speed:>11.2f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
