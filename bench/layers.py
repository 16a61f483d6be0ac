"""Where a native cycle's time goes: ``python -m bench.layers [--split] [--runs N]``.

Peels the native path layer by layer, interleaved, on one private redis-server:

- ``C``        bench/ceiling.c: hotlock's EVALSHA calls from C over hiredis
- ``backend``  the native backend's acquire/release called directly (bytes key, 16-byte
               urandom token): Cython + hiredis, without the public Python layer
- ``api``      cache.lock(key, ttl).unlock(): the public API
- ``python``   the public API over a backend that does nothing: the Python layer alone
- ``metrics``  (with ``--metrics``) the public API with the Prometheus adapter listening
               (hotlock.metrics.PrometheusMetrics on a registry of its own)

It reads one private attribute (``Cache._backend``) to call the backend directly; that
is the point of the exercise and nothing else in bench/ does it. By default server and
client share one core, so the client's CPU shows in the rate (``--split`` pins them apart).
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

from . import ceiling
from .server import pinning, start_redis
from .workloads import cpu_seconds

ROOT = Path(__file__).resolve().parent.parent


class _Nothing:
    """A backend that answers at once: what is left is the Python layer's own cost."""

    name = "nothing"
    server = "nowhere"

    def acquire(self, key: bytes, token: bytes, ttl_ms: int) -> int:
        return 1_764_582_723_123_456  # a fence as the server's clock makes them (16 digits)

    def release(self, key: bytes, token: bytes) -> bool:
        return True


def _child(url: str, layer: str, n: int) -> dict[str, float]:
    import hotlock
    from hotlock._cache import Cache
    from hotlock._scripts import held_value

    serial = itertools.count()
    metrics = None
    if layer == "metrics":
        from prometheus_client import CollectorRegistry

        from hotlock.metrics import PrometheusMetrics

        metrics = PrometheusMetrics(CollectorRegistry())
    cache = (
        Cache(_Nothing(), b"hotlock:")  # type: ignore[arg-type]
        if layer == "python"
        else hotlock.connect(url, backend="native", metrics=metrics)
    )
    if layer == "backend":
        backend = cache._backend
        urandom = os.urandom

        def op() -> None:
            key = f"hotlock:lock:bench:l:{next(serial)}".encode()
            token = urandom(16)
            fence = backend.acquire(key, token, 30000)
            backend.release(key, held_value(token, fence))
    else:

        def op() -> None:
            cache.lock(f"bench:l:{next(serial)}", 30).unlock()

    for _ in range(n // 10):
        op()
    c0 = cpu_seconds()
    t0 = time.perf_counter()
    for _ in range(n):
        op()
    elapsed = time.perf_counter() - t0
    return {"rate": n / elapsed, "cpu_us": (cpu_seconds() - c0) / n * 1e6}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.layers", description=__doc__.splitlines()[0])
    ap.add_argument("--split", action="store_true", help="server and client on different cores")
    ap.add_argument("--metrics", action="store_true", help="also the public API with the Prometheus adapter")
    ap.add_argument("--runs", type=int, default=7)
    ap.add_argument("--cycles", type=int, default=8000)
    ap.add_argument("--child", nargs=2, metavar=("URL", "LAYER"), help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child:
        print(json.dumps(_child(args.child[0], args.child[1], args.cycles)))
        return 0

    pin = pinning(one_core=not args.split)
    client = pin.prefix(pin.client)
    exe, why = ceiling.build()
    env = dict(os.environ, PYTHONPATH=os.pathsep.join((str(ROOT), str(ROOT / "src"))))
    results: dict[str, list[dict[str, float]]] = {}
    with start_redis(pin.server) as server:
        for i in range(args.runs):
            for layer in ("python", "backend", "api", *(("metrics",) if args.metrics else ())):
                cmd = [*client, sys.executable, "-m", "bench.layers", "--cycles", str(args.cycles), "--child"]
                done = subprocess.run([*cmd, server.url, layer], capture_output=True, text=True, env=env, cwd=ROOT)
                if done.returncode != 0:
                    raise SystemExit(f"{layer}: {done.stderr.strip()[-500:]}")
                results.setdefault(layer, []).append(json.loads(done.stdout))
            if exe is not None:
                r = ceiling.run_c(exe, server.host, server.port, "cycle", 0.5, f"layers{i}{os.getpid()}", client)
                rate, cpu_us = r["ops"] / r["seconds"], r["cpu"] / r["ops"] * 1e6
                results.setdefault("C", []).append({"rate": rate, "cpu_us": cpu_us})
    print(f"pinning: {pin.note}; {args.runs} rounds; acquire+release of a fresh key" + ("" if exe else f"; C: {why}"))
    print(f"{'layer':<10} {'cycles/s':>10} {'CPU us/cycle':>13}")
    for layer in ("C", "backend", "api", "metrics", "python"):
        if layer in results:
            rate = statistics.median(r["rate"] for r in results[layer])
            cpu = statistics.median(r["cpu_us"] for r in results[layer])
            print(f"{layer:<10} {rate:>10,.0f} {cpu:>13.1f}")
    if "metrics" in results:
        api = statistics.median(r["cpu_us"] for r in results["api"])
        metered = statistics.median(r["cpu_us"] for r in results["metrics"])
        print(f"metrics / api client CPU: {metered / api:.3f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
