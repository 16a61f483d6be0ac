"""The C ceiling: build and run bench/ceiling.c, and run redis-benchmark with hotlock's calls.

The C loop sends what hotlock sends: the acquire's transaction (hotlock._acquire) and the
EXTEND and RELEASE scripts with the token as the held value. Their Lua text is written
out from hotlock._scripts at run time (bench/out/*.lua), so the scripts stay defined in
one place; the C program loads them with SCRIPT LOAD.
"""

from __future__ import annotations

import csv
import io
import json
import os
import resource
import shutil
import subprocess
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from hotlock._ident import TOKEN_BYTES
from hotlock._scripts import ACQUIRE, EXTEND, RELEASE

__all__ = ["OUT", "build", "run_c", "run_redis_benchmark", "write_scripts"]

HERE = Path(__file__).resolve().parent
OUT = HERE / "out"


def write_scripts(out: Path = OUT) -> Path:
    """Write extend.lua and release.lua from hotlock._scripts; return the folder."""
    out.mkdir(parents=True, exist_ok=True)
    for name, script in (("extend", EXTEND), ("release", RELEASE)):
        (out / f"{name}.lua").write_bytes(script.source)
    return out


def build(out: Path = OUT) -> tuple[Path | None, str]:
    """Compile bench/ceiling.c against libhiredis; (path, "") or (None, why not)."""
    out.mkdir(parents=True, exist_ok=True)
    exe = out / "ceiling"
    cc = os.environ.get("CC", "cc")
    if shutil.which(cc) is None or shutil.which("pkg-config") is None:
        return None, "no C compiler or pkg-config"
    flags = subprocess.run(["pkg-config", "--cflags", "--libs", "hiredis"], capture_output=True, text=True, check=False)
    if flags.returncode != 0:
        return None, "libhiredis not found by pkg-config (apt-get install libhiredis-dev)"
    cmd = [cc, "-O2", "-Wall", "-Wextra", "-o", str(exe), str(HERE / "ceiling.c"), *flags.stdout.split()]
    done = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        return None, f"cc failed: {done.stderr.strip()[-500:]}"
    return exe, " ".join(cmd)


def run_c(
    exe: Path,
    host: str,
    port: int,
    mode: str,
    seconds: float,
    tag: str,
    taskset: list[str],
    cluster_ports: Sequence[int] = (),
) -> dict[str, Any]:
    """One run of the C loop; {"ops", "seconds", "cpu"}, ops counted in cycles/extends/batches.
    ``cluster_ports``: the other primaries of a cluster whose one primary is ``port`` (batch
    mode only: the keys routed to their slots' primaries)."""
    scripts = write_scripts()
    cmd = [*taskset, str(exe), host, str(port), mode, f"{seconds}", str(scripts), tag, *map(str, cluster_ports)]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=seconds + 60, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"ceiling {mode} failed: {done.stderr.strip()}")
    out = json.loads(done.stdout)
    return {"ops": out["ops"], "seconds": out["seconds"], "cpu": out["user"] + out["sys"]}


def _children_cpu() -> float:
    ru = resource.getrusage(resource.RUSAGE_CHILDREN)
    return ru.ru_utime + ru.ru_stime


def _bench(host: str, port: int, requests: int, pipeline: int, args: list[str], taskset: list[str]) -> dict[str, Any]:
    cmd = [
        *taskset,
        "redis-benchmark",
        "-h",
        host,
        "-p",
        str(port),
        "-c",
        "1",
        "-n",
        str(requests),
        "-P",
        str(pipeline),
        "-r",
        "100000000",
        "--csv",
        *args,
    ]
    c0 = _children_cpu()
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=120, check=False)
    cpu = _children_cpu() - c0
    if done.returncode != 0:
        raise RuntimeError(f"redis-benchmark failed: {done.stderr.strip()}")
    rows = [r for r in csv.reader(io.StringIO(done.stdout)) if r and r[0] != "test"]
    rps = float(rows[-1][1])
    return {"ops": requests, "seconds": requests / rps, "cpu": cpu, "rps": rps}


def _sized(host: str, port: int, seconds: float, pipeline: int, args: list[str], taskset: list[str]) -> dict[str, Any]:
    """redis-benchmark has no time limit: size -n from a short first pass to take about ``seconds``."""
    probe = _bench(host, port, 200 * pipeline, pipeline, args, taskset)
    requests = max(200 * pipeline, int(probe["rps"] * seconds) // pipeline * pipeline)
    return _bench(host, port, requests, pipeline, args, taskset)


def run_redis_benchmark(
    host: str, port: int, mode: str, seconds: float, tag: str, taskset: list[str]
) -> dict[str, Any]:
    """redis-benchmark, one connection, sending hotlock's calls where it can.

    It sends one command line over and over (``-P`` repeats that same command), so it can
    neither send the acquire's transaction (MULTI, SET NX PX, TIME, EXEC: four different
    commands in order on one connection) nor pair an acquire with the release of the same
    key. Its acquire is therefore the ACQUIRE script, which hotlock sends only where the
    transaction is not used (scripts='always', a key found held, permits): a second ceiling
    for the script path, not for the default acquire. A cycle is timed as two halves:
    acquires on random fresh keys, then releases of random keys (RELEASE with a plain
    lock's held value, the token: GET + compare, the same script work), and the cycle rate
    is 1 / (1/a + 1/r). ``batch`` runs both halves pipelined by 100 and counts a batch as
    100 cycles. ``extend`` extends one lock held with the token it names, exactly as hotlock
    does. CPU is the children's getrusage, so it includes starting the program.
    """
    import redis

    token = "rb-bench-token-0"  # a plain lock's token: TOKEN_BYTES long, its own held value
    assert len(token) == TOKEN_BYTES
    r = redis.Redis(host=host, port=port)
    try:
        sha = {s: _text(r.script_load(x.source)) for s, x in (("a", ACQUIRE), ("e", EXTEND), ("r", RELEASE))}
        key = f"hotlock:lock:bench:rb:{tag}:__rand_int__"
        if mode == "extend":
            held = f"hotlock:lock:bench:rb:{tag}:held"
            r.set(held, token, px=30000)
            return _sized(host, port, seconds, 1, ["EVALSHA", sha["e"], "1", held, token, "30000"], taskset)
        pipeline = 100 if mode == "batch" else 1
        a = _sized(host, port, seconds / 2, pipeline, ["EVALSHA", sha["a"], "1", key, token, "30000"], taskset)
        rel = _sized(host, port, seconds / 2, pipeline, ["EVALSHA", sha["r"], "1", key, token], taskset)
    finally:
        r.close()
    # Both halves ran the same number of calls: a cycle is one of each.
    cycles = 1.0 / (1.0 / a["rps"] + 1.0 / rel["rps"])
    ops = cycles if mode == "cycle" else cycles / 100
    cpu_per_call = a["cpu"] / a["ops"] + rel["cpu"] / rel["ops"]
    return {
        "ops": ops,
        "seconds": 1.0,
        "cpu": cpu_per_call * (1 if mode == "cycle" else 100) * ops,
        "acquire_rps": a["rps"],
        "release_rps": rel["rps"],
    }


def _text(value: bytes | str) -> str:
    return value.decode() if isinstance(value, bytes) else value
