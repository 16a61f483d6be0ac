"""Concurrency limits: what ``limit=N`` costs a cycle, and what it lets through under contention.

    python -m bench.limits [--runs 5] [--json PATH] [--before TREE] [--split]

On one redis-server this run starts, server and client pinned to the same core with
taskset (as the other benches' ``--one-core``; ``--split`` puts them on two cores):

- **cycle**: ``cache.lock(k, 30).unlock()`` on fresh keys (plain) against
  ``cache.lock(k, 30, limit=4).unlock()`` on fresh keys (limited: a hash of permits per
  key) and on one key over and over (limited, one key: the hash and its last fence stay
  between cycles), on the native backend and on the redis-py backend. Each measurement is
  a fresh interpreter: a short warm-up, then a timed window; ops/s, the client's CPU per
  cycle (getrusage), the server's CPU per cycle (INFO cpu) and the server's own
  usec_per_call of EVALSHA (INFO commandstats; an acquire and a release averaged).
- **contention**: 8 threads sharing one client, and 8 processes with a client each, on ONE
  key with ``lock_wait(key, ttl=5, wait=5, limit=4)``, holding it ~1 ms, against the same
  with ``limit=1`` (a plain lock), native backend: acquisitions/s, the most holders ever
  inside at once (counted by the workers themselves, so at most the server's count; it must
  be <= the limit and should reach it), wait p50/p99 and per-worker min/max.
- **scripts**: the server's cost of one acquire, extend and release script call on fresh
  keys, sent as EVALSHA from redis-py pipelined by 100: usec_per_call from commandstats and
  the server's CPU per call (INFO cpu), for a plain lock and for a permit (limit=4). With
  ``--before TREE`` (a checkout of an older hotlock) TREE's plain scripts are loaded on the
  same server too and sent the same arguments: the plain path's server cost before and after.

Rounds are interleaved (every measurement of round 1 in a shuffled order, then round 2,
...); the tables give medians over the rounds. The leftover hashes of the limited cycle
(a key of permits outlives its release until its TTL) are flushed between measurements.
"""

from __future__ import annotations

import argparse
import itertools
import json
import multiprocessing
import os
import random
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

from .server import Pinning, pinning, start_redis
from .workloads import cpu_seconds, percentile

ROOT = Path(__file__).resolve().parent.parent

LIMIT = 4
WORKERS = 8
HOLD_S = 0.001
WARM_S = 0.3
BACKENDS = ("native", "redis-py")
KINDS = ("plain", "plain, Python lock()", "limited", "limited, one key")
# The native lock() takes a plain lock in one C call; keywords only (lock(key=k, ttl=30))
# send it to the Python lock() that every limited lock goes through, and the same unlock:
# the row between plain and limited splits the client's extra cost into the Python path's
# and the permit's own. The redis-py backend has only the Python path.
NATIVE_ONLY = ("plain, Python lock()",)
# The scripts section: calls per script and per round, and how many go in one pipeline.
SCRIPT_CALLS = 20_000
SCRIPT_BATCH = 100

# A tree's plain scripts, as its hotlock._scripts defines them (run with PYTHONPATH=TREE/src).
DUMP_SCRIPTS = """
import json, hotlock._scripts as s
print(json.dumps({n: getattr(s, n).source.decode() for n in ("ACQUIRE", "EXTEND", "RELEASE")}))
"""


# -- the children: one measurement each, JSON on stdout -----------------------------------


class ServerSide:
    """A second connection to the server for its own figures, read around a timed window."""

    def __init__(self, url: str) -> None:
        import redis

        self.r = redis.Redis.from_url(url)

    def cpu(self) -> float:
        info = self.r.info("cpu")
        return float(info["used_cpu_user"]) + float(info["used_cpu_sys"])

    def evalsha(self) -> tuple[int, float]:
        stat = self.r.info("commandstats").get("cmdstat_evalsha", {})
        return int(stat.get("calls", 0)), float(stat.get("usec_per_call", 0.0))

    def close(self) -> None:
        self.r.close()


def child_cycle(url: str, backend: str, kind: str, seconds: float, tag: str) -> dict[str, Any]:
    import hotlock

    cache = hotlock.connect(url, backend=backend)
    side = ServerSide(url)
    serial = itertools.count()
    one_key = f"limits:{tag}:one"
    if kind == "plain":

        def op() -> None:
            cache.lock(f"limits:{tag}:{next(serial)}", 30).unlock()
    elif kind == "plain, Python lock()":

        def op() -> None:
            cache.lock(key=f"limits:{tag}:{next(serial)}", ttl=30).unlock()
    elif kind == "limited":

        def op() -> None:
            cache.lock(f"limits:{tag}:{next(serial)}", 30, limit=LIMIT).unlock()
    else:

        def op() -> None:
            cache.lock(one_key, 30, limit=LIMIT).unlock()

    end = time.perf_counter() + min(0.2, seconds / 5)
    while time.perf_counter() < end:
        for _ in range(16):
            op()
    side.r.config_resetstat()
    s0 = side.cpu()
    ops = 0
    c0, t0 = cpu_seconds(), time.perf_counter()
    end = t0 + seconds
    while True:
        for _ in range(16):
            op()
        ops += 16
        t1 = time.perf_counter()
        if t1 >= end:
            break
    cpu = cpu_seconds() - c0
    server_cpu = side.cpu() - s0
    calls, usec = side.evalsha()
    side.close()
    cache.close()
    return {
        "ops": ops,
        "seconds": t1 - t0,
        "rate": ops / (t1 - t0),
        "cpu_us": cpu / ops * 1e6,
        "server_cpu_us": server_cpu / ops * 1e6,
        "evalsha_per_cycle": calls / ops,
        "evalsha_usec": usec,
    }


class Tally:
    """How many are inside the section now and at most, shared by threads or forked processes."""

    def __init__(self, processes: bool) -> None:
        if processes:
            ctx = multiprocessing.get_context("fork")
            self._guard: Any = ctx.Lock()
            self._inside: Any = ctx.Value("i", 0, lock=False)
            self._most: Any = ctx.Value("i", 0, lock=False)
        else:
            self._guard = threading.Lock()
            self._inside = _Cell()
            self._most = _Cell()

    def enter(self) -> None:
        with self._guard:
            self._inside.value += 1
            if self._inside.value > self._most.value:
                self._most.value = self._inside.value

    def exit(self) -> None:
        with self._guard:
            self._inside.value -= 1

    @property
    def most(self) -> int:
        return int(self._most.value)


class _Cell:
    value = 0


def _contend(cache: Any, key: str, limit: int, tally: Tally, start_at: float, seconds: float) -> dict[str, Any]:
    """One worker's loop: lock_wait, ~1 ms inside, unlock; only acquisitions in the window count."""
    import hotlock

    measured_from = start_at + WARM_S
    end = measured_from + seconds
    waits: list[float] = []
    timeouts = 0
    while time.monotonic() < start_at:
        time.sleep(0.0005)
    while time.monotonic() < end:
        t0 = time.monotonic()
        try:
            lock = cache.lock_wait(key, ttl=5, wait=5, limit=limit)
        except hotlock.LockNotAcquired:
            timeouts += 1
            continue
        t1 = time.monotonic()
        tally.enter()
        time.sleep(HOLD_S)
        tally.exit()
        lock.unlock()
        if measured_from <= t1 < end:
            waits.append(t1 - t0)
    return {"n": len(waits), "waits": waits, "timeouts": timeouts}


def _contend_process(spec: tuple[str, str, str, int, float], tally: Tally, ready: Any, conn: Any) -> None:
    import hotlock

    url, backend, key, limit, seconds = spec
    cache = hotlock.connect(url, backend=backend)  # after the fork: a connection of its own
    try:
        ready.wait(60)
        conn.send(_contend(cache, key, limit, tally, time.monotonic() + 0.05, seconds))
    finally:
        cache.close()
        conn.close()


def child_contention(url: str, backend: str, mode: str, limit: int, seconds: float, tag: str) -> dict[str, Any]:
    import hotlock

    key = f"limits:{tag}:contended"
    tally = Tally(mode == "processes")
    parts: list[dict[str, Any]] = []
    if mode == "threads":
        cache = hotlock.connect(url, backend=backend)
        start_at = time.monotonic() + 0.1
        parts = [{} for _ in range(WORKERS)]

        def work(i: int) -> None:
            parts[i] = _contend(cache, key, limit, tally, start_at, seconds)

        threads = [threading.Thread(target=work, args=(i,), daemon=True) for i in range(WORKERS)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(seconds + WARM_S + 30)
        cache.close()
        if any(t.is_alive() for t in threads):
            raise RuntimeError("a contention thread did not finish")
    else:
        ctx = multiprocessing.get_context("fork")
        ready = ctx.Barrier(WORKERS + 1)
        pipes, procs = [], []
        for _ in range(WORKERS):
            mine, theirs = ctx.Pipe(duplex=False)
            spec = (url, backend, key, limit, seconds)
            p = ctx.Process(target=_contend_process, args=(spec, tally, ready, theirs), daemon=True)
            p.start()
            theirs.close()
            pipes.append(mine)
            procs.append(p)
        ready.wait(60)
        try:
            for mine in pipes:
                if not mine.poll(seconds + WARM_S + 30):
                    raise RuntimeError("a contention process did not report")
                parts.append(mine.recv())
        finally:
            for p in procs:
                p.join(10)
                if p.is_alive():
                    p.kill()
    waits = [w for p in parts for w in p["waits"]]
    counts = [p["n"] for p in parts]
    return {
        "ops": sum(counts),
        "rate": sum(counts) / seconds,
        "most": tally.most,
        "wait_p50": percentile(waits, 50),
        "wait_p99": percentile(waits, 99),
        "worker_min": min(counts),
        "worker_max": max(counts),
        "timeouts": sum(p["timeouts"] for p in parts),
    }


def child_scripts(url: str, sources_path: str, tag: str) -> dict[str, Any]:
    """Each tree's acquire, extend and release on fresh keys, pipelined: the server's figures.

    Plain locks with every tree's scripts; permits (limit=4) with this tree's."""
    from hotlock._ident import TOKEN_BYTES
    from hotlock._keys import stored

    with open(sources_path) as f:
        trees: dict[str, dict[str, str]] = json.load(f)
    side = ServerSide(url)
    r = side.r
    shas = {name: {op: r.script_load(src) for op, src in ops.items()} for name, ops in trees.items()}
    variants = [(name, name, False) for name in trees] + [("after, permit", "after", True)]
    random.Random(tag).shuffle(variants)
    out: dict[str, Any] = {}
    for name, tree, permit in variants:
        sha = shas[tree]
        # Every variant on an empty keyspace: one that ran while the server grew (rehashed)
        # its key table after another's 20,000 keys would pay for that growth.
        r.flushall()
        keys = [stored(b"hotlock:lock:", f"limits:{tag}:{name}:{i}".encode()) for i in range(SCRIPT_CALLS)]
        tokens = [os.urandom(TOKEN_BYTES) for _ in keys]
        ask = [t + b"#%d" % LIMIT for t in tokens] if permit else tokens
        held: list[bytes] = []
        row: dict[str, Any] = {}
        for op in ("ACQUIRE", "EXTEND", "RELEASE"):
            calls: list[tuple[bytes | int, ...]]
            if op == "ACQUIRE":
                calls = [(keys[i], ask[i], 30_000) for i in range(SCRIPT_CALLS)]
            elif op == "EXTEND":
                calls = [(keys[i], held[i], 30_000) for i in range(SCRIPT_CALLS)]
            else:
                calls = [(keys[i], held[i]) for i in range(SCRIPT_CALLS)]
            r.config_resetstat()
            s0 = side.cpu()
            replies: list[Any] = []
            for i in range(0, SCRIPT_CALLS, SCRIPT_BATCH):
                pipe = r.pipeline(transaction=False)
                for args in calls[i : i + SCRIPT_BATCH]:
                    pipe.evalsha(sha[op], 1, *args)
                replies += pipe.execute()
            spent = side.cpu() - s0
            n, usec = side.evalsha()
            if op == "ACQUIRE":
                if min(replies) <= 0:
                    raise RuntimeError(f"{name}: an acquire on a fresh key failed: {min(replies)}")
                mark = b"#" if permit else b""
                held = [tokens[i] + mark + b"%d" % replies[i] for i in range(SCRIPT_CALLS)]
            elif replies.count(1) != SCRIPT_CALLS:
                raise RuntimeError(f"{name}: {op.lower()} did not return 1 for every held lock")
            row[op.lower()] = {"usec_per_call": usec, "server_cpu_us": spent / n * 1e6, "calls": n}
        out[name] = row
    side.close()
    return out


def child(spec: dict[str, Any]) -> dict[str, Any]:
    what = spec["what"]
    if what == "cycle":
        return child_cycle(spec["url"], spec["backend"], spec["kind"], spec["seconds"], spec["tag"])
    if what == "contention":
        return child_contention(spec["url"], spec["backend"], spec["mode"], spec["limit"], spec["seconds"], spec["tag"])
    if what == "scripts":
        return child_scripts(spec["url"], spec["sources"], spec["tag"])
    raise ValueError(what)


# -- the parent: start the server, run the children interleaved, print the medians ------------


def run_child(pin: Pinning, spec: dict[str, Any]) -> dict[str, Any]:
    cmd = [*pin.prefix(pin.client), sys.executable, "-m", "bench.limits", "--child", json.dumps(spec)]
    done = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, check=False)
    if done.returncode != 0:
        raise SystemExit(f"bench.limits: {spec['what']} failed: {done.stderr.strip()[-1500:]}")
    result: dict[str, Any] = json.loads(done.stdout.strip().splitlines()[-1])
    return result


def tree_scripts(tree: Path) -> dict[str, str]:
    env = dict(os.environ, PYTHONPATH=str(tree.resolve() / "src"))
    done = subprocess.run(
        [sys.executable, "-c", DUMP_SCRIPTS], env=env, capture_output=True, text=True, cwd="/", check=False
    )
    if done.returncode != 0:
        raise SystemExit(f"bench.limits: the scripts of {tree}: {done.stderr.strip()[-500:]}")
    scripts: dict[str, str] = json.loads(done.stdout)
    return scripts


def kinds(backend: str) -> tuple[str, ...]:
    return tuple(k for k in KINDS if backend == "native" or k not in NATIVE_ONLY)


def med(values: list[float]) -> float:
    return statistics.median(values) if values else float("nan")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.limits", description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--json", type=Path, help="write the raw runs and the medians here")
    ap.add_argument("--seconds", type=float, default=1.0, help="the timed window of one cycle measurement")
    ap.add_argument("--contention-seconds", type=float, default=2.0)
    ap.add_argument("--before", type=Path, help="a checkout whose plain scripts to compare with this tree's")
    ap.add_argument("--split", action="store_true", help="server and client on different cores")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child:
        print(json.dumps(child(json.loads(args.child))))
        return 0

    import redis

    import hotlock

    pin = pinning(one_core=not args.split)
    info = hotlock.backend_info()
    jobs: list[tuple[str, ...]] = [("cycle", b, k) for b in BACKENDS for k in kinds(b)]
    jobs += [("contention", "native", mode, str(limit)) for mode in ("threads", "processes") for limit in (1, LIMIT)]
    sources = {"after": tree_scripts(ROOT)}
    if args.before is not None:
        sources["before"] = tree_scripts(args.before)
    sources_path = ROOT / "bench" / "out" / "limits-scripts.json"
    sources_path.parent.mkdir(exist_ok=True)
    sources_path.write_text(json.dumps(sources))
    jobs.append(("scripts",))
    raw: dict[str, list[dict[str, Any]]] = {" / ".join(j): [] for j in jobs}
    with start_redis(pin.server) as server:
        side = redis.Redis.from_url(server.url)
        version = side.info("server")["redis_version"]
        print(f"# bench.limits: limit={LIMIT} against plain; {args.runs} interleaved rounds, medians")
        print(f"# backends: native (hiredis {info['hiredis']}), redis-py {redis.__version__} (cycle only)")
        print(f"# server: redis-server {version} on 127.0.0.1:{server.port}, no persistence, started by this run")
        print(f"# placement: {pin.note}", flush=True)
        for rnd in range(args.runs):
            order = list(jobs)
            random.Random(rnd).shuffle(order)
            for n, job in enumerate(order):
                tag = f"r{rnd}j{n}"
                spec: dict[str, Any] = {"what": job[0], "url": server.url, "tag": tag}
                if job[0] == "cycle":
                    spec.update(backend=job[1], kind=job[2], seconds=args.seconds)
                elif job[0] == "contention":
                    spec.update(backend=job[1], mode=job[2], limit=int(job[3]), seconds=args.contention_seconds)
                else:
                    spec.update(sources=str(sources_path))
                raw[" / ".join(job)].append(run_child(pin, spec))
                side.flushall()
            print(f"# round {rnd + 1}/{args.runs} done; load {os.getloadavg()[0]:.2f}", file=sys.stderr, flush=True)
        side.close()
        load = os.getloadavg()
    medians: dict[str, Any] = {}
    cores = len(os.sched_getaffinity(0))
    print(f"# machine: {cores} cores; load average at the end {load[0]:.2f} {load[1]:.2f} {load[2]:.2f}")

    print("\n## cycle: lock(k, 30).unlock() against lock(k, 30, limit=4).unlock()")
    head = f"{'backend':9} {'kind':20} {'ops/s':>8} {'x plain':>7} {'CPU us':>7} {'x plain':>7}"
    print(f"{head} {'srv us':>7} {'EVALSHA us':>10}")
    for backend in BACKENDS:
        base: dict[str, float] = {}
        for kind in kinds(backend):
            runs = raw[f"cycle / {backend} / {kind}"]
            m = {f: med([r[f] for r in runs]) for f in ("rate", "cpu_us", "server_cpu_us", "evalsha_usec")}
            if kind == "plain":
                base = m
            m["rate_x"] = m["rate"] / base["rate"]
            m["cpu_x"] = m["cpu_us"] / base["cpu_us"]
            # The ratio of the medians, and the median of each round's own ratio (paired).
            plain = raw[f"cycle / {backend} / plain"]
            m["rate_x_paired"] = med([r["rate"] / p["rate"] for r, p in zip(runs, plain, strict=True)])
            medians[f"cycle / {backend} / {kind}"] = m
            print(
                f"{backend:9} {kind:20} {m['rate']:8,.0f} {m['rate_x']:7.2f} {m['cpu_us']:7.2f} {m['cpu_x']:7.2f}"
                f" {m['server_cpu_us']:7.2f} {m['evalsha_usec']:10.2f}"
            )
    print("  CPU us: the client's user + system per cycle; srv us: the server's CPU per cycle (INFO cpu);")
    print("  EVALSHA us: the server's usec_per_call (commandstats), an acquire and a release averaged")
    for backend in BACKENDS:
        m = medians[f"cycle / {backend} / limited"]
        verdict = "met" if m["rate_x"] >= 0.8 else "missed"
        print(
            f"  target limited >= 0.8x plain ({backend}): {m['rate_x']:.3f}x"
            f" (paired per round {m['rate_x_paired']:.3f}x): {verdict}"
        )

    print(f"\n## contention: {WORKERS} workers on one key, lock_wait(key, ttl=5, wait=5, limit=N), ~1 ms held")
    print(f"   native; {args.contention_seconds:g} s measured after {WARM_S:g} s uncounted")
    print(
        f"{'workers':10} {'limit':>5} {'acq/s':>7} {'most inside':>11} {'wait p50':>9} {'p99 ms':>7} {'per worker':>11}"
    )
    for mode in ("threads", "processes"):
        for limit in (1, LIMIT):
            runs = raw[f"contention / native / {mode} / {limit}"]
            m = {f: med([r[f] for r in runs]) for f in ("rate", "wait_p50", "wait_p99", "worker_min", "worker_max")}
            m["most_max"] = max(r["most"] for r in runs)
            m["most_min"] = min(r["most"] for r in runs)
            m["timeouts"] = sum(r["timeouts"] for r in runs)
            medians[f"contention / native / {mode} / {limit}"] = m
            most = f"{m['most_min']}-{m['most_max']}" if m["most_min"] != m["most_max"] else f"{m['most_max']}"
            print(
                f"{mode:10} {limit:5} {m['rate']:7,.0f} {most:>11} {m['wait_p50'] * 1e3:9.2f}"
                f" {m['wait_p99'] * 1e3:7.2f} {m['worker_min']:>5.0f}-{m['worker_max']:<5.0f}"
            )
        x = (
            medians[f"contention / native / {mode} / {LIMIT}"]["rate"]
            / medians[f"contention / native / {mode} / 1"]["rate"]
        )
        print(f"  {mode}: limit={LIMIT} lets through {x:.2f}x the acquisitions of limit=1")
    worst = max(medians[f"contention / native / {mode} / {LIMIT}"]["most_max"] for mode in ("threads", "processes"))
    reached = min(medians[f"contention / native / {mode} / {LIMIT}"]["most_min"] for mode in ("threads", "processes"))
    print(
        f"  most inside at once over every round: at most {worst} (must be <= {LIMIT}); every round reached {reached}"
    )
    print("  most inside: min-max over the rounds; per worker: the fewest and the most acquisitions of one")
    print("  worker in the window (each a median over the rounds); wait: from calling lock_wait to holding")
    timeouts = sum(medians[k]["timeouts"] for k in medians if k.startswith("contention"))
    print(f"  timeouts (LockNotAcquired after wait=5): {timeouts}")

    names = ["before", "after", "after, permit"] if args.before is not None else ["after", "after, permit"]
    print("\n## scripts: the server's cost of each call, EVALSHA with the same arguments, one server")
    print(f"   {SCRIPT_CALLS:,} fresh keys per round, pipelined by {SCRIPT_BATCH} (redis-py): plain locks", end="")
    print(f" with the scripts of {args.before} (before) and of this tree (after)," if args.before else "", end="")
    print(f" permits (limit={LIMIT}) with this tree's (after, permit)")
    print(f"{'':14}" + "".join(f"{name:>16}" for name in names) + "   (usec_per_call, then server CPU us per call)")
    for op in ("acquire", "extend", "release"):
        m = {
            f"{name} / {f}": med([r[name][op][f] for r in raw["scripts"]])
            for name in names
            for f in ("usec_per_call", "server_cpu_us")
        }
        medians[f"scripts / {op}"] = m
        cells = "".join(f"{m[f'{name} / usec_per_call']:16.2f}" for name in names)
        cpu_cells = "".join(f"{m[f'{name} / server_cpu_us']:16.2f}" for name in names)
        ratio = ""
        if args.before is not None:
            ratio = f"   after/before {m['after / usec_per_call'] / m['before / usec_per_call']:.2f}x"
            ratio += f", CPU {m['after / server_cpu_us'] / m['before / server_cpu_us']:.2f}x"
        print(f"{op + ' usec':14}{cells}{ratio}")
        print(f"{op + ' CPU us':14}{cpu_cells}")

    if args.json is not None:
        meta = {
            "runs": args.runs,
            "placement": pin.note,
            "server": f"redis-server {version}",
            "hiredis": info["hiredis"],
            "redis_py": redis.__version__,
            "load": load,
            "before": str(args.before) if args.before else None,
        }
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({"meta": meta, "medians": medians, "raw": raw}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
