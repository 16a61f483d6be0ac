"""Wake-ups against polling under contention: ``python -m bench.wakeups [--one-core] [--runs N] [--parts]``.

The comparison run's contention workloads (bench.workloads: 8 threads sharing a client,
4 processes with a client each, 16 keys, an empty critical section), measured for hotlock
native with wake-ups and with ``wakeups=False`` only, in paired rounds whose order
alternates, on one private redis-server; medians over the rounds. Besides sections/s,
the p99 wait and the client's CPU per section, it reads the server's INFO commandstats
around each run: EVALSHA, PUBLISH and SUBSCRIBE calls per section show what waking
costs the server (a mark and a PUBLISH per woken wait, a SUBSCRIBE per hot key).

``--parts`` adds rows that take waking apart, each the wake-ups build with one part cut
out in the measured process (bench/profile_notes.md, "what each part costs"):

- *marks only*: waits mark and releases PUBLISH, but no wait subscribes (it polls);
- *no wake*: messages reach the subscriber, which wakes nobody (waits sleep out their backoff);
- *idle thread*: polling, with one idle thread started in each process (as the subscriber's).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

import redis

from .server import RedisServer, pinning, start_redis

ROOT = Path(__file__).resolve().parent.parent
COUNTED = ("evalsha", "publish", "subscribe")
# A row: its name, the contestant it runs, and what is cut out of it (see _cut).
ROWS = (("wake-ups", "hotlock-native", ""), ("polling", "hotlock-native-polling", ""))
PARTS = (
    ("marks only", "hotlock-native", "subscriptions"),
    ("no wake", "hotlock-native", "wakes"),
    ("idle thread", "hotlock-native-polling", "threads"),
)


def _cut(part: str) -> None:
    """Take one part of waking out of this process (a --parts row), before the workload."""
    from hotlock.backends import wakeup as _wakeup

    from . import workloads

    if part == "subscriptions":
        _wakeup.Wakeups.join = lambda self, channel: None  # type: ignore[method-assign]
    elif part == "wakes":
        _wakeup.Waiter.wake = lambda self: None  # type: ignore[method-assign]
    elif part == "threads":
        contend = workloads._contend
        started: list[threading.Thread] = []

        def with_idle_thread(*args: Any, **kwargs: Any) -> dict[str, Any]:
            if not started:  # once per process (a contention thread or a forked worker)
                started.append(threading.Thread(target=threading.Event().wait, daemon=True))
                started[0].start()
            return contend(*args, **kwargs)

        workloads._contend = with_idle_thread
    elif part:
        raise ValueError(f"unknown part {part!r}")


def _calls(server: RedisServer) -> dict[str, int]:
    stats = redis.Redis(host=server.host, port=server.port).info("commandstats")
    return {c: int(stats.get(f"cmdstat_{c}", {}).get("calls", 0)) for c in COUNTED}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.wakeups", description=__doc__.splitlines()[0])
    ap.add_argument("--one-core", action="store_true", help="server and client both on one core")
    ap.add_argument("--runs", type=int, default=9)
    ap.add_argument("--seconds", type=float, default=2.0)
    ap.add_argument("--parts", action="store_true", help="also the rows that take waking apart")
    ap.add_argument("--child", help=argparse.SUPPRESS)  # one measurement: a JSON spec
    ap.add_argument("--cut", default="", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child:
        from . import run

        _cut(args.cut)
        print(json.dumps(run.measure(json.loads(args.child))))
        return 0

    pin = pinning(one_core=args.one_core)
    client = pin.prefix(pin.client)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join((str(ROOT), str(ROOT / "src"))))
    chosen = ROWS + PARTS if args.parts else ROWS
    rows: dict[tuple[str, str], list[dict[str, float]]] = {}
    with start_redis(pin.server) as server:
        for i in range(args.runs):
            for mode, workers in (("threads", 8), ("processes", 4)):
                for row_name, name, cut in chosen if i % 2 == 0 else chosen[::-1]:
                    spec = {
                        "kind": "contention",
                        "mode": mode,
                        "workers": workers,
                        "keys": 16,
                        "seconds": args.seconds,
                        "contestant": name,
                        "url": server.url,
                        "tag": f"w{i}{random.randrange(10**9)}",
                    }
                    before = _calls(server)
                    cmd = [*client, sys.executable, "-m", "bench.wakeups", "--child", json.dumps(spec), "--cut", cut]
                    done = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=ROOT, check=True)
                    r = json.loads(done.stdout.strip().splitlines()[-1])
                    after = _calls(server)
                    row = {
                        "rate": r["ops"] / r["seconds"],
                        "p99_ms": r["wait_p99"] * 1000,
                        "max_ms": r["wait_max"] * 1000,
                        "fair": r["worker_min"] / max(1, r["worker_max"]),
                        "cpu_us": r["cpu"] / r["ops"] * 1e6,
                    }
                    # The server's calls came in the warm-up too: per section of the whole run.
                    row.update({c: (after[c] - before[c]) / (r["ops"] + r["ops_warm"]) for c in COUNTED})
                    rows.setdefault((mode, row_name), []).append(row)
    print(f"pinning: {pin.note}; {args.runs} paired rounds of {args.seconds:g} s; medians")
    head = f"{'workers':<10} {'row':<12} {'sections/s':>10} {'x poll':>6} {'p99 ms':>7} {'max ms':>7} {'min/max':>7}"
    print(head + f" {'CPU us':>7} " + " ".join(f"{c + '/sec':>13}" for c in COUNTED))
    for (mode, row_name), runs in rows.items():
        med = {k: statistics.median(r[k] for r in runs) for k in runs[0]}
        polling = statistics.median(r["rate"] for r in rows[(mode, "polling")])
        print(
            f"{mode:<10} {row_name:<12} {med['rate']:>10,.0f} {med['rate'] / polling:>6.3f} {med['p99_ms']:>7.2f} "
            f"{med['max_ms']:>7.2f} {med['fair']:>7.2f} {med['cpu_us']:>7.1f} "
            + " ".join(f"{med[c]:>13.4f}" for c in COUNTED)
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
