"""What auto_extend costs: ``python -m bench.renewal [--leases 10000] [--ttl 3] [--write]``.

Holds ``--leases`` auto-extended leases (taken with lock_many, 1,000 at a time) on one
private redis-server and, once the renewer has merged them into its batches, measures
over ``--periods`` renewal periods (ttl/3 each), per backend (native and redis-py, sync;
hotlock.aio native on uvloop):

- **round trips per period**: every extend_many the renewer sends, counted by a wrapper
  around the cache's backend (this bench's own; nothing in the library counts), checked
  against the server's INFO commandstats (EVALSHA calls = leases renewed);
- **client CPU per renewal**: the process's user+system time (getrusage) over the
  window, all threads, divided by the leases renewed; the main thread only sleeps;
- **client memory**: what holding the leases costs (tracemalloc, after minus before taking
  them: Lock objects, the renewer's records and heaps), what one period allocates at
  its peak and keeps (tracemalloc), and the RSS growth over the window (no leak). Measured
  in a second run, since tracemalloc slows Python down.

``--lateness N`` also pauses the server (SIGSTOP: a blackhole for every connection) N
times under a lease of 0.5 s and reports how late after the lease's local deadline
``lost`` was seen by a polling thread and the renewer told it (on_lost), sync and async.

Each measurement runs in a fresh process pinned to the client core (bench.server.pinning).
``--write`` puts the table in bench/renewal.md, which bench.report appends to results.md.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import os
import resource
import signal
import statistics
import subprocess
import sys
import threading
import time
import tracemalloc
from pathlib import Path
from typing import Any

from .server import pinning, start_redis
from .workloads import cpu_seconds

ROOT = Path(__file__).resolve().parent.parent
OUT = Path(__file__).resolve().parent / "renewal.md"
MEM_TTL = 9.0


def _rss_kib() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss


def _evalsha_calls(url: str) -> int:
    import redis

    client = redis.Redis.from_url(url)
    try:
        stats = client.info("commandstats")
        return int(stats.get("cmdstat_evalsha", {}).get("calls", 0))
    finally:
        client.close()


class _Counting:
    """The cache's backend, counting extend_many calls and their sizes (bench only)."""

    def __init__(self, inner: Any, aio: bool) -> None:
        self._inner = inner
        self.name, self.server = inner.name, inner.server
        self.calls: list[int] = []
        if aio:
            self.extend_many = self._extend_many_aio  # type: ignore[method-assign]

    def extend_many(self, names: list[bytes], tokens: list[bytes], ms: int) -> list[bool]:
        self.calls.append(len(names))
        result: list[bool] = self._inner.extend_many(names, tokens, ms)
        return result

    async def _extend_many_aio(self, names: list[bytes], tokens: list[bytes], ms: int) -> list[bool]:
        self.calls.append(len(names))
        result: list[bool] = await self._inner.extend_many(names, tokens, ms)
        return result

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)


def _child_sync(url: str, backend: str, leases: int, ttl: float, periods: int, memory: bool) -> dict[str, Any]:
    import hotlock

    cache = hotlock.connect(url, backend=backend, timeout=5)
    counting = _Counting(cache._backend, aio=False)
    cache._backend = counting  # type: ignore[assignment]
    gc.collect()
    if memory:
        tracemalloc.start()
    held_before = tracemalloc.get_traced_memory()[0] if memory else 0
    locks: list[Any] = []
    for i in range(0, leases, 1000):
        locks += cache.lock_many([f"renew:{j}" for j in range(i, min(i + 1000, leases))], ttl, auto_extend=True)
    assert all(lk is not None for lk in locks), "some keys were held already"
    period = ttl / 3
    time.sleep(2 * period)  # merged into one batch per period by now
    out = _measure(url, counting, lambda s: time.sleep(s), locks, period, periods, memory, held_before)
    cache.unlock_many(locks)
    cache.close()
    return out


def _measure(
    url: str,
    counting: _Counting,
    sleep: Any,
    locks: list[Any],
    period: float,
    periods: int,
    memory: bool,
    held_before: int,
) -> dict[str, Any]:
    held_bytes = tracemalloc.get_traced_memory()[0] - held_before if memory else 0
    calls0, sha0 = len(counting.calls), _evalsha_calls(url)
    rss0, cpu0, t0 = _rss_kib(), cpu_seconds(), time.monotonic()
    peaks, kept = [], []
    for _ in range(periods):
        if memory:
            base = tracemalloc.get_traced_memory()[0]
            tracemalloc.reset_peak()
        sleep(period)
        if memory:
            now, peak = tracemalloc.get_traced_memory()
            peaks.append(peak - base)
            kept.append(now - base)
    cpu, elapsed = cpu_seconds() - cpu0, time.monotonic() - t0
    rss1 = _rss_kib()
    calls = counting.calls[calls0:]
    renewed = sum(calls)
    return {
        "leases": len(locks),
        "lost": sum(1 for lk in locks if lk.lost),
        "periods": elapsed / period,
        "round_trips": len(calls),
        "renewed": renewed,
        "evalsha": _evalsha_calls(url) - sha0,  # nothing else runs: every one is a renewal
        "cpu_s": cpu,
        "cpu_us_per_renewal": cpu / renewed * 1e6 if renewed else 0.0,
        "held_bytes": held_bytes,
        "period_peak_bytes": statistics.median(peaks) if peaks else 0,
        "period_kept_bytes": statistics.median(kept) if kept else 0,
        "rss_growth_kib": rss1 - rss0,
    }


def _child_aio(url: str, leases: int, ttl: float, periods: int, memory: bool) -> dict[str, Any]:
    import uvloop

    import hotlock.aio

    async def main() -> dict[str, Any]:
        cache = await hotlock.aio.connect(url, backend="native", timeout=5)
        counting = _Counting(cache._backend, aio=True)
        cache._backend = counting  # type: ignore[assignment]
        gc.collect()
        if memory:
            tracemalloc.start()
        held_before = tracemalloc.get_traced_memory()[0] if memory else 0
        locks: list[Any] = []
        for i in range(0, leases, 1000):
            keys = [f"renew:{j}" for j in range(i, min(i + 1000, leases))]
            locks += await cache.lock_many(keys, ttl, auto_extend=True)
        period = ttl / 3
        await asyncio.sleep(2 * period)
        # The window sleeps in a thread so the loop runs the renewer undisturbed.
        loop = asyncio.get_running_loop()
        out = await loop.run_in_executor(
            None,
            lambda: _measure(url, counting, time.sleep, locks, period, periods, memory, held_before),
        )
        await cache.unlock_many(locks)
        await cache.close()
        return out

    return uvloop.run(main())


def _lateness(url: str, pid: int, trials: int, kind: str) -> dict[str, Any]:
    """Pause the server under a 0.5 s lease: how late after its deadline is the loss seen."""
    import hotlock
    import hotlock.aio

    seen: list[float] = []
    told: list[float] = []
    ttl = 0.5

    def pause_and_watch(lock: Any, on_loop_time: Any) -> None:
        os.kill(pid, signal.SIGSTOP)
        try:
            while not lock.lost:
                time.sleep(0.001)
            seen.append(on_loop_time() - lock._deadline)
        finally:
            os.kill(pid, signal.SIGCONT)

    if kind == "sync":
        cache = hotlock.connect(url, backend="native", timeout=0.3, connect_timeout=0.3)
        for i in range(trials):
            lock = cache.lock(f"late:{i}", ttl, auto_extend=True)
            stamps: list[float] = []
            lock.on_lost(lambda lk, s=stamps: s.append(time.monotonic() - lk._deadline))
            time.sleep(0.2)
            pause_and_watch(lock, time.monotonic)
            while not stamps:
                time.sleep(0.001)
            told.append(stamps[0])
            time.sleep(0.4)  # the reply timeouts pass
        cache.close()
    else:

        async def main() -> None:
            cache = await hotlock.aio.connect(url, backend="native", timeout=0.3, connect_timeout=0.3)
            loop = asyncio.get_running_loop()
            for i in range(trials):
                lock = await cache.lock(f"late:{i}", ttl, auto_extend=True)
                stamps: list[float] = []
                lock.on_lost(lambda lk, s=stamps: s.append(loop.time() - lk._deadline))
                await asyncio.sleep(0.2)
                watcher = threading.Thread(target=pause_and_watch, args=(lock, loop.time))
                watcher.start()
                while not stamps:
                    await asyncio.sleep(0.001)
                told.append(stamps[0])
                await loop.run_in_executor(None, watcher.join)
                await asyncio.sleep(0.4)
            await cache.close()

        import uvloop

        uvloop.run(main())
    return {
        "trials": trials,
        "seen_ms": [round(x * 1000, 2) for x in seen],
        "told_ms": [round(x * 1000, 2) for x in told],
    }


def _run_child(client: list[str], args: list[str]) -> dict[str, Any]:
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    cmd = [*client, sys.executable, "-m", "bench.renewal", "--child", json.dumps(args)]
    done = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=ROOT)
    if done.returncode != 0:
        raise SystemExit(f"bench.renewal child {args}: {done.stderr.strip()[-1500:]}")
    result: dict[str, Any] = json.loads(done.stdout.strip().splitlines()[-1])
    return result


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.renewal", description=__doc__.splitlines()[0])
    ap.add_argument("--leases", type=int, default=10_000)
    ap.add_argument("--ttl", type=float, default=6.0, help="seconds (renewal period ttl/3)")
    ap.add_argument("--periods", type=int, default=6)
    ap.add_argument("--lateness", type=int, default=10, help="server pauses per loop kind (0: none)")
    ap.add_argument("--one-core", action="store_true")
    ap.add_argument("--write", action="store_true", help="write bench/renewal.md")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child:
        spec = json.loads(args.child)
        kind = spec[0]
        if kind == "sync":
            print(json.dumps(_child_sync(*spec[1:])))
        elif kind == "aio":
            print(json.dumps(_child_aio(*spec[1:])))
        else:
            print(json.dumps(_lateness(*spec[1:])))
        return 0

    pin = pinning(one_core=args.one_core)
    client = pin.prefix(pin.client)
    rows: list[tuple[str, dict[str, Any], dict[str, Any]]] = []
    late: dict[str, dict[str, Any]] = {}
    started = time.time()
    load0 = os.getloadavg()
    with start_redis(pin.server) as server:
        for name, spec in (
            ("native", ["sync", server.url, "native"]),
            ("redis-py", ["sync", server.url, "redis-py"]),
            ("hotlock.aio native (uvloop)", ["aio", server.url]),
        ):
            cpu = _run_child(client, [*spec, args.leases, args.ttl, args.periods, False])
            # tracemalloc slows Python several times over: a longer TTL keeps the leases
            # alive through it (the memory per period does not depend on the period).
            mem = _run_child(client, [*spec, args.leases, max(args.ttl, MEM_TTL), 2, True])
            rows.append((name, cpu, mem))
            print(name, json.dumps(cpu), json.dumps(mem), flush=True)
        if args.lateness:
            for kind in ("sync", "aio"):
                late[kind] = _run_child(client, ["late", server.url, server.pid, args.lateness, kind])
                print(kind, json.dumps(late[kind]), flush=True)
        version = server.version()
    load = f"load average (1 min) {load0[0]:.2f} at start, {os.getloadavg()[0]:.2f} at end"
    text = _report(rows, late, args, f"{pin.note}; {load}", version, time.time() - started)
    print(text)
    if args.write:
        OUT.write_text(text)
    return 0


def _git() -> str:
    done = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=ROOT)
    return done.stdout.strip() or "?"


def _report(
    rows: list[tuple[str, dict[str, Any], dict[str, Any]]],
    late: dict[str, dict[str, Any]],
    args: argparse.Namespace,
    pin_note: str,
    version: str,
    seconds: float,
) -> str:
    period = args.ttl / 3
    lines = [
        "## Leases that extend themselves: what renewal costs",
        "",
        f"Generated by `python -m bench.renewal --leases {args.leases} --ttl {args.ttl:g} --write` "
        f"({time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, git {_git()}, redis-server {version}, "
        f"{pin_note}; {seconds:.0f} s). {args.leases:,} leases held with `auto_extend=True`, "
        f"ttl {args.ttl:g} s, so one renewal period is {period:g} s; measured over {args.periods} periods "
        "once the renewer had merged them. Round trips are the renewer's extend_many calls (a counting "
        "wrapper in the bench) and EVALSHA calls from INFO commandstats; CPU is the whole client "
        "process (getrusage, all threads) over the window; memory from tracemalloc in a second run "
        f"(ttl {max(args.ttl, MEM_TTL):g} s there, 2 periods: tracemalloc slows the client several times over).",
        "",
        "| backend | round trips / period | leases / round trip | EVALSHA / period "
        "| lost (CPU run / tracemalloc run) | client CPU / renewal | client CPU / period "
        "| memory held (10k leases) | allocated / period (peak) | kept / period | RSS growth over the window |",
        "|---|--:|--:|--:|--:|--:|--:|--:|--:|--:|--:|",
    ]
    for name, cpu, mem in rows:
        per = cpu["periods"] or 1
        lines.append(
            f"| {name} | {cpu['round_trips'] / per:.1f} | {cpu['renewed'] / max(cpu['round_trips'], 1):,.0f} "
            f"| {cpu['evalsha'] / per:,.0f} | {cpu['lost']} / {mem['lost']} | {cpu['cpu_us_per_renewal']:.1f} µs "
            f"| {cpu['cpu_s'] / per * 1000:.1f} ms | {mem['held_bytes'] / 1e6:.1f} MB "
            f"| {mem['period_peak_bytes'] / 1e6:.2f} MB | {mem['period_kept_bytes'] / 1e3:.1f} kB "
            f"| {cpu['rss_growth_kib']:,} KiB |"
        )
    if late:
        lines += [
            "",
            f"**Loss at the deadline** (`--lateness {args.lateness}`): the server paused with SIGSTOP under a "
            "0.5 s auto-extended lease (a blackhole for every connection, reply timeout 0.3 s), native backend; "
            "how long after the lease's local deadline `lock.lost` was seen by a thread polling every 1 ms, "
            "and the renewer ran `on_lost`:",
            "",
            "| API | lost seen: median / max | on_lost told: median / max |",
            "|---|--:|--:|",
        ]
        for kind, r in late.items():
            seen, told = r["seen_ms"], r["told_ms"]
            lines.append(
                f"| {'sync (thread)' if kind == 'sync' else 'async (uvloop)'} | "
                f"{statistics.median(seen):.1f} / {max(seen):.1f} ms | "
                f"{statistics.median(told):.1f} / {max(told):.1f} ms |"
            )
    lines += [
        "",
        "A lease is lost when no extend is confirmed within two thirds of its TTL: a client starved of CPU "
        "(tracemalloc multiplies the Python work per renewal, and other work shares the two cores: see the "
        "load average) sends its chunks late, one after the other. Keep the TTL long against the worst "
        "stall you expect; the default 30 s gives 20 s.",
        "",
        "Renewals go in chunks of `hotlock._renewer.BATCH` (5,000) extends per round trip, so 10,000 "
        "leases of one TTL cost 2 round trips per period; leases of different TTLs renew in batches of "
        "their own. A little under 2 per period and 10,000 EVALSHA per period are measured because a lease "
        "is renewed a third of its TTL after its last extend was *sent*, and the second chunk is sent when "
        "the first has come back.",
        "",
    ]
    return "\n".join(lines)


if __name__ == "__main__":
    raise SystemExit(main())
