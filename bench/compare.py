"""The comparison run: ``python -m bench`` (``make bench``).

One private redis-server, pinned; every contestant and workload measured in the same run,
rounds interleaved (round 1 of everything, then round 2, ...) so drift on a noisy machine
hits every contestant alike; medians with min and max; client CPU per operation; ratios to
the best peer and to the C ceiling. Writes bench/results.md, bench/results.json and
bench/results.png.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from . import ceiling, report
from .contestants import ASYNC, HOTLOCK, LABELS, PEERS, POLLING, async_unavailable, sync_unavailable
from .server import Pinning, RedisServer, pinning, start_redis

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent


@dataclass
class Cell:
    """One contestant on one workload: run ``runs`` times, results kept per run."""

    section: str  # cycle, extend, batch, async, contention, handoff
    contestant: str
    params: dict[str, Any]
    run: Callable[[Cell, int], dict[str, Any]]
    results: list[dict[str, Any]] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)

    @property
    def label(self) -> str:
        extra = " ".join(f"{k}={v}" for k, v in self.params.items())
        return f"{self.section} {self.contestant} {extra}".strip()


def _flushall(server: RedisServer) -> None:
    with socket.create_connection((server.host, server.port), timeout=5) as s:
        s.sendall(b"FLUSHALL\r\n")
        s.recv(64)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench", description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="a short smoke run: 2 rounds, short timings")
    ap.add_argument("--one-core", action="store_true", help="server and client both on one core (shows client CPU)")
    ap.add_argument("--unpinned", action="store_true", help="no taskset at all")
    ap.add_argument("--runs", type=int, help="rounds per measurement (default 5; 2 with --quick)")
    ap.add_argument("--only", help="comma-separated sections: cycle,extend,batch,async,contention,handoff")
    ap.add_argument("--out", type=Path, default=HERE, help="where results.md/.json/.png go (default bench/)")
    ap.add_argument("--no-write", action="store_true", help="print the table, write nothing")
    args = ap.parse_args(argv)

    runs = args.runs or (2 if args.quick else 5)
    if runs < 1:
        ap.error("--runs must be at least 1")
    sec = 0.3 if args.quick else 1.0  # per sync/async run
    csec = 0.5 if args.quick else 2.0  # per contention run
    rounds = 10 if args.quick else 40  # handoffs per run
    sections = set((args.only or "cycle,extend,batch,async,contention,handoff").split(","))
    pin = pinning(one_core=args.one_core, unpinned=args.unpinned)
    started = time.monotonic()

    server = start_redis(pin.server)
    try:
        return _run(args, server, pin, runs, sec, csec, rounds, sections, started)
    finally:
        server.stop()


def _run(
    args: argparse.Namespace,
    server: RedisServer,
    pin: Pinning,
    runs: int,
    sec: float,
    csec: float,
    rounds: int,
    sections: set[str],
    started: float,
) -> int:
    client = pin.prefix(pin.client)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])))
    exe, why_c = ceiling.build()
    unavailable: dict[str, str | None] = {n: sync_unavailable(n) for n in (*HOTLOCK, *POLLING, *PEERS)}
    unavailable.update({n: async_unavailable(n, server.url) for n in ASYNC})
    unavailable["C-hiredis"] = None if exe else f"not built: {why_c}"

    import hotlock

    info = hotlock.backend_info()
    meta = {
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "machine": _machine(),
        "python": platform.python_version(),
        "redis_server": server.version(),
        "hiredis": _pkg_version("hiredis"),
        "pinning": pin.note,
        "runs": runs,
        "seconds": sec,
        "contention_seconds": csec,
        "handoff_rounds": rounds,
        "quick": args.quick,
        "hotlock_default_backend": info["backend"],
        "hotlock_native_reason": info["reason"],
        "unavailable": {k: v for k, v in unavailable.items() if v},
        "measured_hotlock": [n for n in (*HOTLOCK, "hotlock-aio-native", "hotlock-aio-redis-py") if not unavailable[n]],
        "command": " ".join(["python -m bench", *sys.argv[1:]]),
        "git": _git_head(),
        "loadavg_start": _loadavg(),
    }
    print(f"hotlock backends measured: {', '.join(LABELS[n] for n in meta['measured_hotlock']) or 'none'}")
    for n, why in meta["unavailable"].items():
        print(f"  {LABELS[n]}: {why}")
    print(f"default backend for redis:// urls: {info['backend']}" + (f" ({info['reason']})" if info["reason"] else ""))
    print(f"pinning: {pin.note}; server {server.url} pid {server.pid}; {runs} rounds")

    def child(cell: Cell, i: int) -> dict[str, Any]:
        spec = {
            **cell.params,
            "kind": cell.section if cell.section in ("async", "contention", "handoff") else "sync",
            "contestant": cell.contestant,
            "url": server.url,
            "tag": f"r{i}{random.randrange(10**9)}",
        }
        if cell.section in ("cycle", "extend", "batch"):
            spec["workload"] = cell.section
        done = subprocess.run(
            [*client, sys.executable, "-m", "bench.run", json.dumps(spec)],
            capture_output=True,
            text=True,
            env=env,
            cwd=ROOT,
            timeout=300,
            check=False,
        )
        if done.returncode != 0:
            raise RuntimeError(done.stderr.strip().splitlines()[-1] if done.stderr.strip() else "failed")
        result: dict[str, Any] = json.loads(done.stdout.strip().splitlines()[-1])
        return result

    def c_loop(cell: Cell, i: int) -> dict[str, Any]:
        assert exe is not None
        return ceiling.run_c(exe, server.host, server.port, cell.section, sec, f"r{i}{random.randrange(10**9)}", client)

    def rbench(cell: Cell, i: int) -> dict[str, Any]:
        return ceiling.run_redis_benchmark(
            server.host, server.port, cell.section, sec, f"r{i}{random.randrange(10**9)}", client
        )

    cells: list[Cell] = []
    for workload in ("cycle", "extend", "batch"):
        if workload not in sections:
            continue
        names = HOTLOCK if workload == "batch" else (*HOTLOCK, *PEERS)
        cells += [Cell(workload, n, {"seconds": sec}, child) for n in names]
        cells.append(Cell(workload, "C-hiredis", {}, c_loop))
        cells.append(Cell(workload, "redis-benchmark", {}, rbench))
    if "async" in sections:
        for loop in ("uvloop", "asyncio"):
            for tasks in (100, 1000):
                cells += [Cell("async", n, {"loop": loop, "tasks": tasks, "seconds": sec}, child) for n in ASYNC]
    if "contention" in sections:
        for mode, workers in (("threads", 8), ("processes", 4)):
            cells += [
                Cell("contention", n, {"mode": mode, "workers": workers, "keys": 16, "seconds": csec}, child)
                for n in (*HOTLOCK, *POLLING, *PEERS)
            ]
    if "handoff" in sections:
        cells += [Cell("handoff", n, {"rounds": rounds}, child) for n in (*HOTLOCK, *POLLING, *PEERS)]

    live = [c for c in cells if not unavailable.get(c.contestant)]
    rng = random.Random(2026)
    for i in range(runs):
        order = live[:]
        rng.shuffle(order)
        for n, cell in enumerate(order, 1):
            _flushall(server)
            t = time.monotonic()
            try:
                result = cell.run(cell, i)
            except Exception as exc:  # report it and carry on: one broken peer must not sink the run
                cell.errors.append(f"{type(exc).__name__}: {exc}")
                print(f"[round {i + 1}/{runs} {n}/{len(order)}] {cell.label}: FAILED {cell.errors[-1]}", flush=True)
                continue
            cell.results.append(result)
            if cell.section == "handoff":
                shown = f"p50 {result['p50'] * 1000:.2f} ms, p99 {result['p99'] * 1000:.2f} ms"
            else:
                shown = f"{result['ops'] / result['seconds']:,.0f}/s"
            print(
                f"[round {i + 1}/{runs} {n}/{len(order)}] {cell.label}: {shown} ({time.monotonic() - t:.1f} s)",
                flush=True,
            )

    meta["elapsed_s"] = round(time.monotonic() - started, 1)
    meta["loadavg_end"] = _loadavg()
    data = {
        "meta": meta,
        "cells": [
            {
                "section": c.section,
                "contestant": c.contestant,
                "params": c.params,
                "results": c.results,
                "errors": c.errors,
                "unavailable": unavailable.get(c.contestant),
            }
            for c in cells
        ],
    }
    text = report.markdown(data)
    print()
    print(text)
    if not args.no_write:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "results.json").write_text(json.dumps(data, indent=1) + "\n")
        (args.out / "results.md").write_text(text)
        report.chart(data, args.out / "results.png")
        print(f"wrote {args.out / 'results.md'}, results.json and results.png in {meta['elapsed_s']} s")
    return 0


def _machine() -> str:
    model = "?"
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    model = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    return f"{model}, {os.cpu_count()} cores, {platform.system()} {platform.release()}"


def _pkg_version(name: str) -> str:
    done = subprocess.run(["pkg-config", "--modversion", name], capture_output=True, text=True, check=False)
    return done.stdout.strip() or "?"


def _loadavg() -> str:
    """The 1-, 5- and 15-minute load averages: how busy the machine was besides this run."""
    try:
        return " ".join(f"{x:.2f}" for x in os.getloadavg())
    except OSError:
        return "?"


def _git_head() -> str:
    done = subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=ROOT, check=False
    )
    return done.stdout.strip() or "?"
