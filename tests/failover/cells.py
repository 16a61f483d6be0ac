"""The cells of the failover table (a fault, a setting, a Sentinel detection time) and one
seeded run of a cell: topology up, workload, fault, heal, histories checked.

Timeline of a run (seconds from the workload's start): 2 s of warm-up, the fault, and the
workload until the fault's own end plus a tail. Side A holds the primary, the nodes the
fault cuts off with it, and the clients ``ca``; side B the rest, sentinels included.
"""

from __future__ import annotations

import json
import signal
import sqlite3
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .check import Result, check
from .topology import REDIS_PORT, Topology, python
from .worker import init_store

KEYS = ["k0", "k1", "k2"]
# Longer than the 1.5 s a client cut off from the sentinels spends asking all three (0.5 s
# connect timeout each) before a call, so such a client still renews its leases.
TTL = 3.0
# The probe's holder renews every ttl/3 and each renewal first waits out that 1.5 s: a
# margin the loaded machine cannot eat, so a miss is the lock's and not the harness's.
PROBE_TTL = 5.0
TIMEOUT = 0.5
WARMUP = 2.0
WORKERS_PER_SIDE = 2

SETTINGS: dict[str, tuple[int, dict[str, str]]] = {
    # name: (wait_replicas, server config on every data node)
    "defaults": (0, {}),
    "wait_replicas=1": (1, {}),
    "min-replicas lag 1 s": (0, {"min-replicas-to-write": "1", "min-replicas-max-lag": "1"}),
    "min-replicas lag 10 s": (0, {"min-replicas-to-write": "1", "min-replicas-max-lag": "10"}),
}

FAULTS = {
    "none": "no fault",
    "cut-primary": "primary cut off from replicas and sentinels; clients beside it still reach it",
    "cut-primary+replica": "primary and one replica cut off together",
    "kill-9": "replication cut, then the primary killed (kill -9)",
    "sigstop": "primary paused (SIGSTOP) past the failover, then continued",
    "restart": "primary killed and restarted at once, without persistence",
    "restart-aof": "primary killed and restarted at once, with AOF (appendfsync everysec)",
}


@dataclass(frozen=True)
class Cell:
    fault: str
    setting: str = "defaults"
    detect_s: int = 1
    replicas: int = 2
    nolock: bool = False
    # The renewal probe: one key; side A holds it for seconds at a time from before the
    # fault, extending; side B starts contending at the fault. A renewal that reaches
    # only the cut-off primary then shows as a double grant.
    probe: bool = False

    @property
    def label(self) -> str:
        extra = f", {self.replicas} replicas" if self.replicas != 2 else ""
        what = "no lock (control)" if self.nolock else self.setting
        probe = " (renewal probe)" if self.probe else ""
        return f"{self.fault}{extra}{probe} | {what} | {self.detect_s} s"

    @property
    def side_a(self) -> tuple[str, ...]:
        return ("p", "r1") if self.fault == "cut-primary+replica" else ("p",)


def all_cells() -> list[Cell]:
    cells = [Cell("none", s) for s in ("defaults", "wait_replicas=1", "min-replicas lag 1 s")]
    cells += [Cell("none", nolock=True)]
    for fault in ("cut-primary", "cut-primary+replica"):
        cells += [Cell(fault, s) for s in SETTINGS]
    cells += [Cell("cut-primary+replica", s, replicas=3) for s in ("wait_replicas=1", "min-replicas lag 1 s")]
    for fault in ("kill-9", "sigstop", "restart", "restart-aof"):
        cells += [Cell(fault, s) for s in ("defaults", "wait_replicas=1")]
    cells += [
        Cell("cut-primary", s, probe=True) for s in ("wait_replicas=1", "min-replicas lag 1 s", "min-replicas lag 10 s")
    ]
    cells += [Cell("cut-primary", s, detect_s=5) for s in ("defaults", "wait_replicas=1")]
    cells += [Cell("sigstop", "defaults", detect_s=5)]
    return cells


@dataclass
class Run:
    cell: Cell
    seed: int
    result: Result
    duration_s: float
    notes: list[str] = field(default_factory=list)
    failover_s: float | None = None  # fault to the sentinels naming another primary


def _wait_failover(topo: Topology, old: str, limit: float) -> float | None:
    """Seconds until the sentinels name another primary, or None within ``limit``."""
    t0 = time.monotonic()
    while time.monotonic() - t0 < limit:
        now = topo.primary()
        if now and now != old:
            return time.monotonic() - t0
        time.sleep(0.1)
    return None


def run_cell(cell: Cell, seed: int, keep: Path | None = None, short: bool = False) -> Run:
    """One seeded run of ``cell``; ``short`` trims the warm-up, the fault and the tail
    (the make test form) while leaving room for the failover."""
    started = time.monotonic()
    warmup = 1.5 if short else WARMUP
    wait_replicas, config = SETTINGS[cell.setting]
    topo = Topology(replicas=cell.replicas, side_a=cell.side_a)
    notes: list[str] = []
    took: float | None = None
    try:
        topo.start(config, cell.detect_s * 1000, aof=cell.fault == "restart-aof")
        store = topo.workdir / "store.sqlite"
        init_store(store, KEYS)
        fault_len = cell.detect_s + (4.0 if short else 5.0)  # long enough for the failover to finish
        tail = 2.5 if short else 4.0
        total = warmup + fault_len + tail
        t_start = time.monotonic() + 1.0  # the workers' interpreters start meanwhile
        until = t_start + total
        outs = []
        keys = KEYS[:1] if cell.probe else KEYS
        for side, node in (("A", "ca"), ("B", "cb")):
            for i in range(WORKERS_PER_SIDE):
                name = f"{side}{i}"
                out = topo.workdir / f"worker-{name}.json"
                outs.append(out)
                argv = [
                    python(), "-m", "tests.failover.worker", "worker",
                    "--url", topo.sentinel_url(), "--name", name, "--side", side,
                    "--seed", str(seed * 100 + len(outs)), "--keys", ",".join(keys),
                    "--until", repr(until), "--ttl", str(PROBE_TTL if cell.probe else TTL), "--timeout", str(TIMEOUT),
                    "--wait-replicas", str(wait_replicas), "--store", str(store), "--out", str(out),
                    "--p-long", "0.08", "--long-max", str(cell.detect_s + 5.0),
                ]  # fmt: skip
                if cell.probe and side == "A":
                    # From the start to well past any failover: the hold the cut falls in.
                    hold = str(warmup + fault_len + 3.0)
                    argv += ["--p-long", "1", "--long-min", hold, "--long-max", hold]
                elif cell.probe:
                    argv += ["--p-long", "0", "--start", repr(t_start + warmup)]
                if cell.nolock:
                    argv.append("--nolock")
                topo.extra.append(topo.spawn(node, argv, topo.workdir / f"worker-{name}.log"))
        role_outs = {}
        for node in topo.data_nodes:
            out = topo.workdir / f"roles-{node}.json"
            role_outs[node] = out
            argv = [python(), "-m", "tests.failover.worker", "roles", "--until", repr(until), "--out", str(out)]
            topo.extra.append(topo.spawn(node, argv))
        time.sleep(max(0.0, t_start + warmup - time.monotonic()))
        if cell.probe:
            # The probe needs side A holding the key when the cut comes: on a loaded machine
            # the workers' interpreters can take the whole warm-up to start.
            held = time.monotonic() + 5
            while not topo.cli("p", "keys", "hotlock:lock:*").strip() and time.monotonic() < held:
                time.sleep(0.05)
            if time.monotonic() >= held:
                notes.append("no hold before the cut")
        fault_at = time.monotonic()
        old = topo.primary()
        heal_at = None
        if cell.fault in ("cut-primary", "cut-primary+replica"):
            topo.cut()
            took = _wait_failover(topo, old, fault_len)
            notes.append(f"failover after {took:.1f} s" if took is not None else "no failover")
            time.sleep(max(0.0, fault_at + fault_len - time.monotonic()))
            topo.heal()
            heal_at = time.monotonic()
        elif cell.fault == "kill-9":
            topo.cut()
            time.sleep(0.3)  # acquires keep landing on the primary alone
            topo.kill("p")
            topo.heal()
            took = _wait_failover(topo, old, fault_len)
            notes.append(f"failover after {took:.1f} s" if took is not None else "no failover")
        elif cell.fault == "sigstop":
            topo.signal("p", signal.SIGSTOP)
            took = _wait_failover(topo, old, fault_len)
            notes.append(f"failover after {took:.1f} s" if took is not None else "no failover")
            time.sleep(max(0.0, fault_at + fault_len - time.monotonic()))
            topo.signal("p", signal.SIGCONT)
            heal_at = time.monotonic()
        elif cell.fault in ("restart", "restart-aof"):
            took = None
            topo.kill("p")
            # At once, on the same address: within the detection time, so no failover,
            # and the replicas resync from whatever the primary came back with.
            topo.start_data("p", config, aof=cell.fault == "restart-aof")
        for proc in topo.extra:
            try:
                proc.wait(max(1.0, until + 15 - time.monotonic()))
            except Exception:
                notes.append(f"pid {proc.pid} did not stop by itself")
        workers = [json.loads(o.read_text()) for o in outs if o.exists()]
        if len(workers) != len(outs):
            notes.append(f"{len(outs) - len(workers)} worker(s) left no history")
        roles = {n: json.loads(o.read_text()) for n, o in role_outs.items() if o.exists()}
        db = sqlite3.connect(str(store))
        final = {
            k: (f, c)
            for k, f, c in db.execute("SELECT f.key, f.value, c.value FROM fenced f JOIN counter c USING(key)")
        }
        log = db.execute("SELECT seq, key, hold, fence, accepted, t FROM log").fetchall()
        db.close()
        result = check(workers, final, log, roles, (fault_at, until))
        if heal_at is not None:
            notes.append(f"healed {heal_at - fault_at:.1f} s after the fault")
        if keep is not None:
            keep.mkdir(parents=True, exist_ok=True)
            dump: dict[str, Any] = {
                "cell": cell.label,
                "seed": seed,
                "workers": workers,
                "roles": roles,
                "log": log,
                "final": final,
                "fault_at": fault_at,
                "heal_at": heal_at,
                "notes": notes,
            }
            name = f"{cell.label}-{seed}".replace(" | ", "_").replace(" ", "").replace("/", "")
            (keep / f"{name}.json").write_text(json.dumps(dump))
    finally:
        topo.close()
    return Run(cell, seed, result, time.monotonic() - started, notes, took)


__all__ = ["FAULTS", "REDIS_PORT", "SETTINGS", "Cell", "Run", "all_cells", "run_cell"]
