"""``python -m tests.failover``: every cell of the failover table, several seeds each, then
the cost of each setting when nothing fails; writes the table (Markdown) and every run's
figures (JSON) under --out. ``make failover`` runs it. Linux, root (ip netns).
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from collections.abc import Sequence
from pathlib import Path

from .cells import SETTINGS, Cell, Run, all_cells, run_cell
from .topology import Topology, cleanup_stale, install_signal_handlers, netns_available, python

COLUMNS = [
    # (result field, header, format)
    ("double_grants", "double grants", "{:.0f}"),
    ("overlap_s", "two holders (s)", "{:.2f}"),
    ("stale_refused", "stale writes refused", "{:.0f}"),
    ("stale_accepted", "stale writes accepted", "{:.0f}"),
    ("lost_fenced", "lost updates, fenced", "{:.0f}"),
    ("lost_unfenced", "lost updates, unfenced", "{:.0f}"),
    ("lost_locks", "lost locks", "{:.0f}"),
    ("errors", "client errors", "{:.0f}"),
    ("max_no_grant_s", "longest without a grant (s)", "{:.1f}"),
    ("two_primaries_s", "two primaries (s)", "{:.1f}"),
]


def cell_row(cell: Cell, runs: Sequence[Run]) -> str:
    fault, setting, detect = cell.label.split(" | ")
    out = [fault, setting, detect]
    failovers = [r.failover_s for r in runs if r.failover_s is not None]
    out.append(f"{statistics.median(failovers):.1f}" if failovers else "-")
    for name, _header, fmt in COLUMNS:
        values = [getattr(r.result, name) for r in runs]
        med = statistics.median(values)
        worst = max(values)
        out.append(fmt.format(med) if med == worst else f"{fmt.format(med)} ({fmt.format(worst)})")
    return "| " + " | ".join(out) + " |"


def table(runs: Sequence[Run]) -> str:
    headers = ["fault", "setting", "detection", "failover (s)", *(h for _n, h, _f in COLUMNS)]
    lines = ["| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)]
    cells: dict[Cell, list[Run]] = {}
    for r in runs:
        cells.setdefault(r.cell, []).append(r)
    lines += [cell_row(c, rs) for c, rs in cells.items()]
    return "\n".join(lines)


def latency(rounds: int = 3, count: int = 1000) -> dict[str, dict[str, float]]:
    """Acquire latency (p50, p99 in ms) per setting with no fault: one client beside the
    sentinels, sequential acquire and release of fresh keys, the settings interleaved."""
    samples: dict[str, list[float]] = {"defaults": [], "wait_replicas=1": [], "min-replicas-to-write 1": []}
    with Topology() as topo:
        topo.start({}, 1000)
        for rnd in range(rounds):
            for setting in samples:
                server = {"min-replicas-to-write 1": "1"}.get(setting, "0")
                topo.cli("p", "config", "set", "min-replicas-to-write", server)
                out = topo.workdir / f"lat-{rnd}-{len(samples[setting])}.json"
                argv = [python(), "-m", "tests.failover.worker", "latency", "--url", topo.sentinel_url(),
                        "--name", f"{rnd}", "--count", str(count), "--out", str(out), "--timeout", "2",
                        "--wait-replicas", "1" if setting == "wait_replicas=1" else "0"]  # fmt: skip
                proc = topo.spawn("cb", argv, topo.workdir / "latency.log")
                proc.wait(300)
                samples[setting] += json.loads(out.read_text())
    result = {}
    for setting, xs in samples.items():
        xs.sort()
        result[setting] = {
            "p50_ms": xs[len(xs) // 2] * 1000,
            "p99_ms": xs[int(len(xs) * 0.99)] * 1000,
            "n": len(xs),
        }
    return result


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m tests.failover", description=__doc__)
    p.add_argument("--seeds", type=int, default=3)
    p.add_argument("--only", default="", help="run only the cells whose label contains this")
    p.add_argument("--out", default="build/failover")
    p.add_argument("--keep", action="store_true", help="keep every run's histories under --out/histories")
    p.add_argument("--no-latency", action="store_true")
    a = p.parse_args(argv)
    why = netns_available()
    if why is not None:
        print(f"make failover needs Linux network namespaces: {why}", file=sys.stderr)
        return 2
    install_signal_handlers()
    stale = cleanup_stale()
    if stale:
        print(f"deleted {len(stale)} namespaces left by an interrupted run")
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    cells = [c for c in all_cells() if a.only in c.label]
    began = time.monotonic()
    runs: list[Run] = []
    for cell in cells:
        for seed in range(1, a.seeds + 1):
            run = run_cell(cell, seed, out / "histories" if a.keep else None)
            runs.append(run)
            r = run.result
            print(
                f"{cell.label} seed {seed}: {run.duration_s:.0f} s; double grants {r.double_grants} "
                f"({r.overlap_s:.2f} s), stale refused {r.stale_refused} accepted {r.stale_accepted}, "
                f"lost {r.lost_fenced}/{r.lost_unfenced}, lost locks {r.lost_locks}, errors {r.errors}, "
                f"no grant {r.max_no_grant_s:.1f} s, two primaries {r.two_primaries_s:.1f} s; {'; '.join(run.notes)}",
                flush=True,
            )
    lat = {} if a.no_latency else latency()
    took = time.monotonic() - began
    text = [table(runs), ""]
    if lat:
        text += ["| setting, no fault | acquire p50 (ms) | acquire p99 (ms) |", "|---|---|---|"]
        text += [f"| {s} | {v['p50_ms']:.3f} | {v['p99_ms']:.3f} |" for s, v in lat.items()]
        text.append("")
    text.append(
        f"{len(cells)} cells x {a.seeds} seeds in {took / 60:.1f} min on {platform.node()} "
        f"({platform.machine()}, Linux {platform.release()})"
    )
    (out / "table.md").write_text("\n".join(text) + "\n")
    (out / "results.json").write_text(
        json.dumps(
            {
                "runs": [
                    {
                        "cell": r.cell.label,
                        "seed": r.seed,
                        "duration_s": r.duration_s,
                        "notes": r.notes,
                        "failover_s": r.failover_s,
                        **r.result.as_dict(),
                    }
                    for r in runs
                ],
                "latency": lat,
                "settings": {k: {"wait_replicas": w, "server": c} for k, (w, c) in SETTINGS.items()},
                "minutes": took / 60,
            },
            indent=1,
        )
    )
    print("\n".join(text))
    return 0


if __name__ == "__main__":
    sys.exit(main())
