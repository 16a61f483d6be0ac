"""Wake-ups against polling under contention: ``python -m bench.wakeups [--one-core] [--runs N]``.

The comparison run's contention workloads (bench.workloads: 8 threads sharing a client,
4 processes with a client each, 16 keys, an empty critical section), measured for hotlock
native with wake-ups and with ``wakeups=False`` only, in paired rounds whose order
alternates, on one private redis-server; medians over the rounds. Besides sections/s,
the p99 wait and the client's CPU per section, it reads the server's INFO commandstats
around each run: EVALSHA, PUBLISH and SUBSCRIBE calls per section show what waking
costs the server (a mark and a PUBLISH per woken wait, a SUBSCRIBE per hot key).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
from pathlib import Path

import redis

from .server import RedisServer, pinning, start_redis

ROOT = Path(__file__).resolve().parent.parent
CONTESTANTS = ("hotlock-native", "hotlock-native-polling")
COUNTED = ("evalsha", "publish", "subscribe")


def _calls(server: RedisServer) -> dict[str, int]:
    stats = redis.Redis(host=server.host, port=server.port).info("commandstats")
    return {c: int(stats.get(f"cmdstat_{c}", {}).get("calls", 0)) for c in COUNTED}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.wakeups", description=__doc__.splitlines()[0])
    ap.add_argument("--one-core", action="store_true", help="server and client both on one core")
    ap.add_argument("--runs", type=int, default=9)
    ap.add_argument("--seconds", type=float, default=2.0)
    args = ap.parse_args(argv)

    pin = pinning(one_core=args.one_core)
    client = pin.prefix(pin.client)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join((str(ROOT), str(ROOT / "src"))))
    rows: dict[tuple[str, str], list[dict[str, float]]] = {}
    with start_redis(pin.server) as server:
        for i in range(args.runs):
            for mode, workers in (("threads", 8), ("processes", 4)):
                for name in CONTESTANTS if i % 2 == 0 else CONTESTANTS[::-1]:
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
                    cmd = [*client, sys.executable, "-m", "bench.run", json.dumps(spec)]
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
                    row.update({c: (after[c] - before[c]) / r["ops"] for c in COUNTED})
                    rows.setdefault((mode, name), []).append(row)
    print(f"pinning: {pin.note}; {args.runs} paired rounds of {args.seconds:g} s; medians")
    head = f"{'workers':<10} {'contestant':<24} {'sections/s':>10} {'p99 ms':>7} {'max ms':>7} {'min/max':>7}"
    print(head + f" {'CPU us':>7} " + " ".join(f"{c + '/sec':>13}" for c in COUNTED))
    for (mode, name), runs in rows.items():
        med = {k: statistics.median(r[k] for r in runs) for k in runs[0]}
        print(
            f"{mode:<10} {name:<24} {med['rate']:>10,.0f} {med['p99_ms']:>7.2f} {med['max_ms']:>7.2f} "
            f"{med['fair']:>7.2f} {med['cpu_us']:>7.1f} " + " ".join(f"{med[c]:>13.4f}" for c in COUNTED)
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
