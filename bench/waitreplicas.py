"""What wait_replicas costs a renewal: ``python -m bench.waitreplicas [--runs 5] [--n 2000]``.

A private redis-server primary with one replica (both on the server core), and a client on
the other core (bench.server.pinning). For each sync backend (native, redis-py) and each
setting (without wait_replicas, and ``wait_replicas=1``), ``--runs`` fresh client processes
each hold one lock and extend it ``--n`` times, then hold 100 leases and renew them with
``extend_many`` ``--n``/10 times (what the auto-extend renewer sends). Reported, as medians
over the runs:

- **wall time per extend** (and per batch of 100);
- **client CPU per extend** (getrusage of the client process, user + system);
- **round trips per extend**: the client's write and sendto syscalls per extend (strace -c,
  the difference between 100 and 300 extends, so connecting and warming up cancel out;
  both backends write each round trip's commands in one call);
- **commands per extend** on the primary (INFO commandstats): EVALSHA and WAIT calls.

Prints a Markdown table; nothing is written.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

import redis

from .server import pinning, start_redis
from .workloads import cpu_seconds

ROOT = Path(__file__).resolve().parent.parent
BACKENDS = ("native", "redis-py")
BATCH = 100


def _count_child(url: str, backend: str, wait: int, kind: str, k: int) -> None:
    """k extends (or extend_many of BATCH), nothing else: what strace counts."""
    import hotlock

    kwargs = {"wait_replicas": wait, "wait_timeout": 1.0} if wait else {}
    with hotlock.connect(url, backend=backend, timeout=2, **kwargs) as cache:  # type: ignore[arg-type]
        if kind == "extend":
            lock = cache.lock("bench:wr:count", 30)
            for _ in range(k):
                lock.extend(30)
            lock.unlock()
        else:
            locks = [lk for lk in cache.lock_many([f"bench:wr:c{i}" for i in range(BATCH)], 30) if lk is not None]
            for _ in range(k):
                cache.extend_many(locks, 30)
            cache.unlock_many(locks)


def _writes(url: str, backend: str, wait: int, kind: str, k: int) -> int:
    """The write and sendto syscalls of a _count_child run, by strace -c."""
    out = Path(f"/tmp/hotlock-bench-strace-{backend}-{wait}-{kind}-{k}")
    cmd = ["strace", "-f", "-c", "-e", "trace=write,sendto,sendmsg", "-o", str(out)]
    cmd += [sys.executable, "-m", "bench.waitreplicas", "--count", url, backend, str(wait), kind, str(k)]
    subprocess.run(cmd, capture_output=True, check=True, cwd=ROOT)
    calls = 0
    for line in out.read_text().splitlines():
        parts = line.split()
        if parts and parts[-1] in ("write", "sendto", "sendmsg"):
            calls += int(parts[3])  # % time, seconds, usecs/call, calls, [errors,] syscall
    out.unlink()
    return calls


def _round_trips(url: str, backend: str, wait: int, kind: str) -> float:
    if shutil.which("strace") is None:
        return float("nan")
    return (_writes(url, backend, wait, kind, 300) - _writes(url, backend, wait, kind, 100)) / 200


def _child(url: str, backend: str, wait: int, n: int) -> dict[str, float]:
    """One client process: n extends of one lock, then n/10 extend_many of BATCH leases."""
    import hotlock

    kwargs = {"wait_replicas": wait, "wait_timeout": 1.0} if wait else {}
    side = redis.Redis.from_url(url)
    out: dict[str, float] = {}
    with hotlock.connect(url, backend=backend, timeout=2, **kwargs) as cache:  # type: ignore[arg-type]
        lock = cache.lock("bench:wr:one", 30)
        for _ in range(200):  # warm up
            lock.extend(30)
        k0 = _calls(side)
        w0, c0 = time.perf_counter(), cpu_seconds()
        for _ in range(n):
            lock.extend(30)
        w1, c1 = time.perf_counter(), cpu_seconds()
        k1 = _calls(side)
        out.update(wall=(w1 - w0) / n, cpu=(c1 - c0) / n)
        out.update(evalsha=(k1["evalsha"] - k0["evalsha"]) / n, waits=(k1["wait"] - k0["wait"]) / n)
        lock.unlock()
        locks = [lk for lk in cache.lock_many([f"bench:wr:{i}" for i in range(BATCH)], 30) if lk is not None]
        m = max(1, n // 10)
        k0 = _calls(side)
        w0, c0 = time.perf_counter(), cpu_seconds()
        for _ in range(m):
            cache.extend_many(locks, 30)
        w1, c1 = time.perf_counter(), cpu_seconds()
        k1 = _calls(side)
        out.update(batch_wall=(w1 - w0) / m, batch_cpu=(c1 - c0) / m)
        out.update(batch_waits=(k1["wait"] - k0["wait"]) / m)
        cache.unlock_many(locks)
    side.close()
    return out


def _calls(side: redis.Redis) -> dict[str, int]:
    stats = side.info("commandstats")
    return {name: int(stats.get(f"cmdstat_{name}", {}).get("calls", 0)) for name in ("evalsha", "wait")}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.waitreplicas", description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--n", type=int, default=2000)
    ap.add_argument("--child", nargs=3, metavar=("URL", "BACKEND", "WAIT"), help=argparse.SUPPRESS)
    ap.add_argument("--count", nargs=5, metavar=("URL", "BACKEND", "WAIT", "KIND", "K"), help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.count:
        url, backend, wait, kind, k = args.count
        _count_child(url, backend, int(wait), kind, int(k))
        return 0
    if args.child:
        print(json.dumps(_child(args.child[0], args.child[1], int(args.child[2]), args.n)))
        return 0
    pins = pinning()
    fast = ("--repl-diskless-sync-delay", "0")
    with (
        start_redis(pins.server, *fast) as primary,
        start_redis(pins.server, *fast, "--replicaof", primary.host, str(primary.port)),
    ):
        side = redis.Redis(host=primary.host, port=primary.port)
        deadline = time.monotonic() + 30
        while True:  # the replica synced and acknowledging writes
            side.set("bench:ack", 1)
            if int(side.wait(1, 100)) >= 1:
                break
            if time.monotonic() > deadline:
                raise SystemExit("the replica did not acknowledge a write within 30 s")
            time.sleep(0.05)
        runs: dict[tuple[str, int], list[dict[str, float]]] = {}
        for _ in range(args.runs):
            # Interleaved: a noisy neighbour slows every variant, not one.
            for backend in BACKENDS:
                for wait in (0, 1):
                    cmd = [
                        *pins.prefix(pins.client),
                        sys.executable,
                        "-m",
                        "bench.waitreplicas",
                        "--n",
                        str(args.n),
                        "--child",
                        primary.url,
                        backend,
                        str(wait),
                    ]
                    done = subprocess.run(cmd, capture_output=True, text=True, check=True, cwd=ROOT)
                    runs.setdefault((backend, wait), []).append(json.loads(done.stdout))
        trips = {
            (backend, wait, kind): _round_trips(primary.url, backend, wait, kind)
            for backend in BACKENDS
            for wait in (0, 1)
            for kind in ("extend", "batch")
        }
        version = primary.version()
    print(
        f"redis-server {version}, a primary and one replica on one host; {pins.note}; "
        f"{args.runs} runs of {args.n} extends and {max(1, args.n // 10)} extend_many of {BATCH}, medians"
    )
    print()
    print(
        "| backend | wait_replicas | extend: wall | client CPU | writes | EVALSHA + WAIT "
        "| extend_many(100): wall | client CPU | writes | WAIT |"
    )
    print("|---|--:|--:|--:|--:|--:|--:|--:|--:|--:|")
    for (backend, wait), results in runs.items():

        def med(field: str, results: list[dict[str, float]] = results) -> float:
            return statistics.median(r[field] for r in results)

        print(
            f"| {backend} | {wait or 'off'} | {med('wall') * 1e6:.0f} µs | {med('cpu') * 1e6:.1f} µs "
            f"| {trips[backend, wait, 'extend']:.2f} | {med('evalsha'):.2f} + {med('waits'):.2f} "
            f"| {med('batch_wall') * 1e6:.0f} µs | {med('batch_cpu') * 1e6:.0f} µs "
            f"| {trips[backend, wait, 'batch']:.2f} | {med('batch_waits'):.2f} |"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
