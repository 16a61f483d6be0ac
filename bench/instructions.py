"""User-space instructions per operation under callgrind: ``python -m bench.instructions``.

The steadiest evidence on a noisy machine: each workload runs under
``valgrind --tool=callgrind`` for N and 5N operations, and the difference divided by 4N
is the cost of one operation, start-up cancelled out, split by shared object (libpython,
libhiredis, libc, the extension). The C loop runs a fixed count (CEILING_COUNT). Kernel
work is not counted. Needs valgrind; takes a few minutes (Python under callgrind is slow).
``batch-cluster`` is the batch on a 3-primary cluster it starts, hotlock's and the C loop's
each key routed to its slot's primary.
"""

from __future__ import annotations

import argparse
import collections
import itertools
import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from . import ceiling
from .server import start_redis

ROOT = Path(__file__).resolve().parent.parent
WORKLOADS = ("cycle", "cycle-metrics", "cycle-reauth", "extend", "batch", "batch-cluster", "python-layer")


class _DefaultUser:
    """A credential provider for cycle-reauth: the default user (nopass takes any password)."""

    def get_credentials(self) -> tuple[str, str]:
        return ("default", "any")


def _workload(url: str, what: str, n: int) -> None:
    """Run ``n`` operations of ``what`` (the child side, under callgrind)."""
    import hotlock
    from hotlock._cache import Cache

    from .layers import _Nothing

    serial = itertools.count()
    if what == "python-layer":
        cache = Cache(_Nothing(), b"hotlock:")  # type: ignore[arg-type]
        for _ in range(n):
            cache.lock(f"bench:i:{next(serial)}", 30).unlock()
        return
    metrics = None
    if what == "cycle-metrics":
        # The same cycle with the Prometheus adapter listening (the target: at most 15% more
        # client CPU than "cycle"), on a registry of its own.
        from prometheus_client import CollectorRegistry

        from hotlock.metrics import PrometheusMetrics

        metrics = PrometheusMetrics(CollectorRegistry())
    # cycle-reauth: the same cycle with a credential provider and reauth_interval (never due
    # here): what checking the interval before each command costs.
    credentials = {"credential_provider": _DefaultUser(), "reauth_interval": 3600} if what == "cycle-reauth" else {}
    cache = hotlock.connect(url, backend="native", metrics=metrics, **credentials)
    if what in ("cycle", "cycle-metrics", "cycle-reauth"):
        for _ in range(n):
            cache.lock(f"bench:i:{next(serial)}", 30).unlock()
    elif what == "extend":
        lock = cache.lock(f"bench:i:held:{os.getpid()}", 30)
        for _ in range(n):
            lock.extend(30)
        lock.unlock()
    elif what in ("batch", "batch-cluster"):
        for _ in range(n):
            cache.unlock_many(cache.lock_many([f"bench:i:{next(serial)}" for _ in range(100)], 30))
    cache.close()


def _by_object(cmd: list[str], env: dict[str, str]) -> collections.Counter[str]:
    with tempfile.NamedTemporaryFile(suffix=".callgrind") as out:
        subprocess.run(
            ["valgrind", "--tool=callgrind", f"--callgrind-out-file={out.name}", *cmd],
            capture_output=True,
            text=True,
            env=env,
            check=False,
        )
        text = subprocess.run(
            ["callgrind_annotate", "--threshold=100", out.name], capture_output=True, text=True, check=False
        ).stdout
    counts: collections.Counter[str] = collections.Counter()
    for line in text.splitlines():
        m = re.match(r"\s*([\d,]+) \([\s\d.]+%\)\s+.*\[(.*)\]\s*$", line)
        if m:
            counts[os.path.basename(m.group(2))] += int(m.group(1).replace(",", ""))
    return counts


def _per_op(cmd_for: object, n: int, env: dict[str, str]) -> dict[str, float]:
    lo = _by_object(cmd_for(n), env)  # type: ignore[operator]
    hi = _by_object(cmd_for(5 * n), env)  # type: ignore[operator]
    return {obj: (hi[obj] - lo[obj]) / (4 * n) for obj in hi}


def _short(obj: str) -> str:
    for prefix in ("libpython", "libhiredis", "libc.", "_native", "ceiling"):
        if obj.startswith(prefix):
            return prefix.rstrip(".")
    return "other"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.instructions", description=__doc__.splitlines()[0])
    ap.add_argument("--child", nargs=3, metavar=("URL", "WORKLOAD", "N"), help=argparse.SUPPRESS)
    ap.add_argument(
        "--only",
        default=",".join(WORKLOADS),
        help=f"comma-separated workloads (default: all of {', '.join(WORKLOADS)})",
    )
    args = ap.parse_args(argv)
    only = args.only.split(",")
    if unknown := set(only) - set(WORKLOADS):
        ap.error(f"unknown workload(s): {', '.join(sorted(unknown))}")
    if args.child:
        _workload(args.child[0], args.child[1], int(args.child[2]))
        return 0
    if shutil.which("valgrind") is None or shutil.which("callgrind_annotate") is None:
        raise SystemExit("bench.instructions needs valgrind (apt-get install valgrind)")
    exe, why = ceiling.build()
    env = dict(os.environ, PYTHONPATH=os.pathsep.join((str(ROOT), str(ROOT / "src"))))
    rows: dict[str, dict[str, float]] = {}
    with start_redis() as server:
        scripts = ceiling.write_scripts()
        for what, n in (
            ("cycle", 1000),
            ("cycle-metrics", 1000),
            ("cycle-reauth", 1000),
            ("extend", 1000),
            ("batch", 10),
            ("python-layer", 2000),
        ):
            if what not in only:
                continue
            py = [sys.executable, "-m", "bench.instructions", "--child", server.url, what]
            rows[f"hotlock native {what}" if what != "python-layer" else "public layer, no-op backend"] = _per_op(
                lambda k, py=py: [*py, str(k)], n, env
            )
            if exe is not None and what not in ("python-layer", "cycle-metrics", "cycle-reauth"):
                c_cmd = [str(exe), server.host, str(server.port), what, "1", str(scripts), f"instr{what}{os.getpid()}"]
                rows[f"C loop {what}"] = _c_per_op(c_cmd, n, env)
    if "batch-cluster" in only:
        rows.update(_cluster_batch(exe, env))
    cols = ("libpython", "libhiredis", "libc", "_native", "ceiling", "other")
    print("user-space instructions per operation (callgrind); batch = lock_many(100) + unlock_many")
    print(f"{'':<32}{'total':>12}" + "".join(f"{c:>12}" for c in cols))
    for name, per in rows.items():
        split = collections.Counter()
        for obj, v in per.items():
            split[_short(obj)] += v
        print(f"{name:<32}{sum(per.values()):>12,.0f}" + "".join(f"{split[c]:>12,.0f}" for c in cols))
    if exe is None:
        print(f"C loop: {why}")
    return 0


def _cluster_batch(exe: Path | None, env: dict[str, str]) -> dict[str, dict[str, float]]:
    """The batch on a 3-primary cluster (tests/cluster.py starts it), hotlock and the C loop
    routing each key to its slot's primary: set beside the one-server batch, what routing
    adds in user space."""
    sys.path.insert(0, str(ROOT))
    from tests.cluster import start_cluster

    rows = {}
    cluster = start_cluster(replicas=0)
    try:
        py = [sys.executable, "-m", "bench.instructions", "--child", cluster.url, "batch-cluster"]
        rows["hotlock native batch-cluster"] = _per_op(lambda k: [*py, str(k)], 10, env)
        if exe is not None:
            ports = [str(p) for p in cluster.primary_ports()]
            scripts = ceiling.write_scripts()
            c_cmd = [str(exe), "127.0.0.1", ports[0], "batch", "1", str(scripts), f"instrcl{os.getpid()}", *ports[1:]]
            rows["C loop batch-cluster"] = _c_per_op(c_cmd, 10, env)
    finally:
        cluster.stop()
    return rows


def _c_per_op(c_cmd: list[str], n: int, env: dict[str, str]) -> dict[str, float]:
    lo = _by_object(c_cmd, {**env, "CEILING_COUNT": str(n)})
    hi = _by_object(c_cmd, {**env, "CEILING_COUNT": str(5 * n)})
    return {obj: (hi[obj] - lo[obj]) / (4 * n) for obj in hi}


if __name__ == "__main__":
    raise SystemExit(main())
