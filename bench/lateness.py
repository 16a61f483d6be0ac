"""How late a known loss reaches the caller: LockLost out of a block whose Redis went dark.

An auto-extended lock (ttl 1 s) on a cache whose reply timeout is 5 s, through the test
suite's fault proxy; the proxy then swallows every byte both ways. The renewer cannot
confirm an extend, so the lease is lost at its deadline. Measured: from that deadline
(and, sync, from the moment ``lock.lost`` read True) to the LockLost caught by the caller
around the block. Before a known loss was raised at once this was one or two reply
timeouts (the block's exit awaited the release). Every backend and loop, on one
redis-server this run starts; medians and worst of ``--runs`` runs.

    python -m bench.lateness [--runs 7]
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import time

import uvloop
from tests.faultproxy import FaultProxy

import hotlock
import hotlock.aio

from .server import start_redis

TTL = 1.0
REPLY_TIMEOUT = 5.0


def sync_run(backend: str, proxy: FaultProxy) -> tuple[float, float]:
    cache = hotlock.connect(proxy.url, backend=backend, timeout=REPLY_TIMEOUT, connect_timeout=REPLY_TIMEOUT)
    seen = deadline = 0.0
    try:
        with cache.lock("late", ttl=TTL, auto_extend=True) as lock:
            time.sleep(0.1)
            proxy.blackhole(True)
            deadline = lock._deadline
            while not lock.lost:
                time.sleep(0.0005)
            seen = time.monotonic()
    except hotlock.LockLost:
        caught = time.monotonic()
    else:
        raise SystemExit("bench.lateness: the block did not raise LockLost")
    finally:
        proxy.clear()
        cache.close()
    return caught - deadline, caught - seen


async def async_run(backend: str, proxy: FaultProxy) -> float:
    cache = await hotlock.aio.connect(proxy.url, backend=backend, timeout=REPLY_TIMEOUT, connect_timeout=REPLY_TIMEOUT)
    loop = asyncio.get_running_loop()
    deadline = 0.0
    try:
        async with cache.lock("late", ttl=TTL, auto_extend=True) as lock:
            await asyncio.sleep(0.1)
            proxy.blackhole(True)
            deadline = lock._deadline
            await asyncio.sleep(30)  # cancelled at the deadline
    except hotlock.LockLost:
        return loop.time() - deadline
    else:
        raise SystemExit("bench.lateness: the block did not raise LockLost")
    finally:
        proxy.clear()
        await cache.close()


def ms(values: list[float]) -> str:
    return f"{statistics.median(values) * 1000:8.2f} {max(values) * 1000:8.2f}"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.lateness", description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=7)
    args = ap.parse_args(argv)
    server = start_redis()
    try:
        print(f"# LockLost lateness: ttl {TTL:g} s, reply timeout {REPLY_TIMEOUT:g} s, Redis blackholed")
        print(f"# redis-server on 127.0.0.1:{server.port}, unpinned; {args.runs} runs each; ms, median and worst")
        print(f"{'backend':10} {'api':8} {'from the deadline':>17}   {'from lock.lost':>17}")
        for backend in ("native", "redis-py"):
            from_deadline, from_seen = [], []
            for _ in range(args.runs):
                with FaultProxy(server.port) as proxy:
                    d, s = sync_run(backend, proxy)
                from_deadline.append(d)
                from_seen.append(s)
            print(f"{backend:10} {'sync':8} {ms(from_deadline)}   {ms(from_seen)}", flush=True)
            for loop in ("asyncio", "uvloop"):
                late = []
                for _ in range(args.runs):
                    with FaultProxy(server.port) as proxy:
                        late.append((uvloop.run if loop == "uvloop" else asyncio.run)(async_run(backend, proxy)))
                print(f"{backend:10} {loop:8} {ms(late)}   {'':17}", flush=True)
    finally:
        server.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
