"""The workloads, shared by the comparison run (bench/run.py) and the pytest-benchmark suite.

Every loop is bounded: it stops at a deadline or after a fixed count, and every blocking
acquire has a wait limit. CPU is the client's own, from getrusage (user + system).
"""

from __future__ import annotations

import asyncio
import itertools
import multiprocessing
import random
import resource
import statistics
import threading
import time
from collections.abc import Callable
from typing import Any

from .contestants import AsyncContestant, NotAcquired, SyncContestant, open_async, open_sync

__all__ = [
    "BATCH",
    "async_cycles",
    "contention_processes",
    "contention_threads",
    "handoff",
    "percentile",
    "sync_op",
    "timed",
]

BATCH = 100
CHUNK = 16  # operations between two looks at the clock (the C loop does the same)
WAIT = 5.0  # seconds any blocking acquire may wait before it counts as a timeout
# Contention runs the workers' loop this long before the measured window, uncounted: what
# a process does once (a library's first connections, the helper threads it starts on
# its first contended wait) is not steady-state throughput, and a 2 s window would
# count it (hotlock's wake-up subscriber, started on the first wait, was 1-2% of one
# core's 2 s with 4 processes).
WARM_S = 0.3


def cpu_seconds(who: int = resource.RUSAGE_SELF) -> float:
    ru = resource.getrusage(who)
    return ru.ru_utime + ru.ru_stime


def percentile(values: list[float], q: float) -> float:
    """The q-th percentile (0-100), nearest rank; 0.0 for no values."""
    if not values:
        return 0.0
    ordered = sorted(values)
    rank = max(0, min(len(ordered) - 1, round(q / 100.0 * len(ordered) + 0.5) - 1))
    return ordered[rank]


def timed(op: Callable[[], object], seconds: float) -> dict[str, Any]:
    """Run ``op`` for a short warm-up, then for ``seconds``; count, time and CPU the second part."""
    end = time.perf_counter() + min(0.2, seconds / 5)
    while time.perf_counter() < end:
        for _ in range(CHUNK):
            op()
    ops = 0
    c0 = cpu_seconds()
    t0 = time.perf_counter()
    end = t0 + seconds
    while True:
        for _ in range(CHUNK):
            op()
        ops += CHUNK
        t1 = time.perf_counter()
        if t1 >= end:
            break
    cpu = cpu_seconds() - c0
    return {"ops": ops, "seconds": t1 - t0, "cpu": cpu}


def sync_op(contestant: SyncContestant, workload: str, tag: str) -> Callable[[], object]:
    """The operation one sync run repeats: fresh keys for cycle and batch, one held lock for extend."""
    serial = itertools.count()
    if workload == "cycle":
        return lambda: contestant.cycle(f"bench:{tag}:{next(serial)}")
    if workload == "extend":
        contestant.hold(f"bench:{tag}:held")
        return contestant.extend
    if workload == "batch":
        return lambda: contestant.batch([f"bench:{tag}:{next(serial)}" for _ in range(BATCH)])
    raise ValueError(f"unknown workload {workload!r}")


# -- contention ----------------------------------------------------------------------


def _section(holder: dict[str, int] | None, key: str, me: int) -> int:
    """The tiny critical section. With threads it also checks exclusion: a lock that let
    two holders in would be fast and wrong, so overlaps are counted and reported."""
    if holder is None:
        return 0
    overlap = 1 if holder.get(key, -1) != -1 else 0
    holder[key] = me
    holder[key] = -1
    return overlap


def _contend(
    c: SyncContestant,
    keys: list[str],
    start_at: float,
    seconds: float,
    me: int,
    holder: dict[str, int] | None,
    limit: int | None = None,
    warm_s: float = WARM_S,
) -> dict[str, Any]:
    rng = random.Random(me)
    waits: list[float] = []
    timeouts = overlaps = 0
    while time.monotonic() < start_at:
        time.sleep(0.0005)
    # The first warm_s seconds run the same loop uncounted (see WARM_S).
    measured_from = start_at + warm_s
    end = measured_from + seconds
    c0 = 0.0
    counting = False
    warm = 0
    while (now := time.monotonic()) < end and (limit is None or len(waits) < limit):
        if not counting and now >= measured_from:
            counting = True
            c0 = cpu_seconds()
            timeouts = 0
        key = keys[rng.randrange(len(keys))]
        t0 = time.monotonic()
        try:
            handle = c.wait(key, WAIT)
        except NotAcquired:
            timeouts += 1
            continue
        t1 = time.monotonic()
        overlaps += _section(holder, key, me)
        c.release(handle)
        if counting:
            waits.append(t1 - t0)
        else:
            warm += 1
    cpu = cpu_seconds() - c0  # the process's: meaningful for one worker per process only
    return {
        "n": len(waits),
        "warm": warm,
        "waits": waits,
        "timeouts": timeouts,
        "overlaps": overlaps,
        "finished": time.monotonic(),
        "cpu": cpu,
    }


def _summary(parts: list[dict[str, Any]], start_at: float) -> dict[str, Any]:
    waits = [w for p in parts for w in p["waits"]]
    counts = [p["n"] for p in parts]
    elapsed = max(p["finished"] for p in parts) - start_at
    return {
        "ops": sum(counts),
        "ops_warm": sum(p["warm"] for p in parts),  # the warm-up's, not in ops (see WARM_S)
        "seconds": elapsed,
        "cpu": sum(p["cpu"] for p in parts),
        "wait_p50": percentile(waits, 50),
        "wait_p99": percentile(waits, 99),
        "wait_max": max(waits, default=0.0),
        "wait_mean": statistics.fmean(waits) if waits else 0.0,
        "worker_min": min(counts),
        "worker_max": max(counts),
        "timeouts": sum(p["timeouts"] for p in parts),
        "overlaps": sum(p["overlaps"] for p in parts),
    }


def contention_threads(
    c: SyncContestant,
    tag: str,
    workers: int = 8,
    nkeys: int = 16,
    seconds: float = 2.0,
    limit: int | None = None,
    warm_s: float = WARM_S,
) -> dict[str, Any]:
    """``workers`` threads sharing one client, each locking a random one of ``nkeys`` keys,
    for ``seconds`` (or until each did ``limit`` sections) after ``warm_s`` uncounted."""
    keys = [f"bench:{tag}:k{i}" for i in range(nkeys)]
    holder: dict[str, int] = {}
    parts: list[dict[str, Any]] = [{} for _ in range(workers)]
    start_at = time.monotonic() + 0.1

    def work(i: int) -> None:
        parts[i] = _contend(c, keys, start_at, seconds, i, holder, limit, warm_s)

    threads = [threading.Thread(target=work, args=(i,), daemon=True) for i in range(workers)]
    for t in threads:
        t.start()
    time.sleep(max(0.0, start_at + warm_s - time.monotonic()))
    c0 = cpu_seconds()  # the whole process, from the measured window on: a library's helper threads count too
    for t in threads:
        t.join(seconds + warm_s + WAIT + 30)
    if any(t.is_alive() for t in threads):
        raise RuntimeError("a contention thread did not finish")
    summary = _summary(parts, start_at + warm_s)
    summary["cpu"] = cpu_seconds() - c0
    return summary


def _contend_in_child(
    name: str,
    url: str,
    keys: list[str],
    ready: Any,
    seconds: float,
    me: int,
    limit: int | None,
    warm_s: float,
    conn: Any,
) -> None:
    c = open_sync(name, url)  # after the fork: a connection of its own
    try:
        ready.wait(60)
        conn.send(_contend(c, keys, time.monotonic(), seconds, me, None, limit, warm_s))
    finally:
        c.close()
        conn.close()


def contention_processes(
    name: str,
    url: str,
    tag: str,
    workers: int = 4,
    nkeys: int = 16,
    seconds: float = 2.0,
    limit: int | None = None,
    warm_s: float = WARM_S,
) -> dict[str, Any]:
    """``workers`` processes, each with its own client, on ``nkeys`` keys (as contention_threads).

    They start together once all have connected (a barrier), so forking and connecting
    are not timed.
    """
    ctx = multiprocessing.get_context("fork")
    keys = [f"bench:{tag}:k{i}" for i in range(nkeys)]
    ready = ctx.Barrier(workers + 1)
    pipes, procs = [], []
    for i in range(workers):
        mine, theirs = ctx.Pipe(duplex=False)
        args = (name, url, keys, ready, seconds, i, limit, warm_s, theirs)
        p = ctx.Process(target=_contend_in_child, args=args, daemon=True)
        p.start()
        theirs.close()
        pipes.append(mine)
        procs.append(p)
    ready.wait(60)
    start_at = time.monotonic() + warm_s  # the workers' measured window (see _contend)
    parts = []
    try:
        for mine in pipes:
            if not mine.poll(seconds + warm_s + WAIT + 30):
                raise RuntimeError("a contention process did not report")
            parts.append(mine.recv())
    finally:
        for p in procs:
            p.join(10)
            if p.is_alive():
                p.kill()
    return _summary(parts, start_at)


# -- handoff -------------------------------------------------------------------------


def _waiter(name: str, url: str, key: str, conn: Any) -> None:
    c = open_sync(name, url)
    try:
        conn.send("ready")
        while conn.poll(30):
            if conn.recv() is None:
                break
            try:
                handle = c.wait(key, WAIT)
            except NotAcquired:
                conn.send(None)
                continue
            got = time.monotonic()
            c.release(handle)
            conn.send(got)
    finally:
        c.close()


def handoff(
    name: str, url: str, tag: str, rounds: int = 40, hold: tuple[float, float] = (0.005, 0.015)
) -> dict[str, Any]:
    """Release -> waiter's acquire, in seconds, ``rounds`` times.

    This process holds the key; a forked waiter blocks on it in its library's own wait
    loop (polling, BLPOP, backoff). The holder keeps it a random 5-15 ms, so the waiter
    is in the middle of its schedule, then notes the time and releases; the waiter notes
    the time its acquire returned. Both clocks are CLOCK_MONOTONIC, shared by processes.
    """
    ctx = multiprocessing.get_context("fork")
    key = f"bench:{tag}:handoff"
    mine, theirs = ctx.Pipe()
    p = ctx.Process(target=_waiter, args=(name, url, key, theirs), daemon=True)
    p.start()
    c = open_sync(name, url)
    rng = random.Random(7)
    samples: list[float] = []
    timeouts = 0
    try:
        if not mine.poll(30) or mine.recv() != "ready":
            raise RuntimeError("the handoff waiter did not start")
        for i in range(rounds):
            handle = c.try_acquire(key)
            mine.send(i)
            time.sleep(rng.uniform(*hold))
            released = time.monotonic()
            c.release(handle)
            if not mine.poll(WAIT + 10):
                raise RuntimeError("the handoff waiter did not answer")
            got = mine.recv()
            if got is None:
                timeouts += 1
            else:
                samples.append(got - released)
        mine.send(None)
    finally:
        p.join(10)
        if p.is_alive():
            p.kill()
        c.close()
    return {
        "ops": len(samples),
        "samples": samples,
        "timeouts": timeouts,
        "p50": percentile(samples, 50),
        "p99": percentile(samples, 99),
        "max": max(samples, default=0.0),
    }


# -- async ---------------------------------------------------------------------------


async def _async_phase(c: AsyncContestant, tasks: int, seconds: float, tag: str) -> int:
    loop = asyncio.get_running_loop()
    end = loop.time() + seconds
    counts = [0] * tasks

    async def worker(i: int) -> None:
        j = 0
        while loop.time() < end:
            await c.cycle(f"bench:{tag}:{i}:{j}")
            j += 1
        counts[i] = j

    await asyncio.gather(*(worker(i) for i in range(tasks)))
    return sum(counts)


async def async_cycles(name: str, url: str, tag: str, tasks: int, seconds: float) -> dict[str, Any]:
    """``tasks`` concurrent tasks on one client, each doing acquire+release on fresh keys."""
    c = await open_async(name, url)
    try:
        await _async_phase(c, tasks, min(0.3, seconds / 3), tag + ":w")
        c0 = cpu_seconds()
        t0 = time.perf_counter()
        ops = await _async_phase(c, tasks, seconds, tag + ":m")
        elapsed = time.perf_counter() - t0
        cpu = cpu_seconds() - c0
    finally:
        await c.close()
    return {"ops": ops, "seconds": elapsed, "cpu": cpu}


def run_async(coro_fn: Callable[[], Any], loop_name: str) -> Any:
    """Run a coroutine to completion on a fresh asyncio or uvloop loop."""
    if loop_name == "uvloop":
        import uvloop

        with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
            return runner.run(coro_fn())
    with asyncio.Runner() as runner:
        return runner.run(coro_fn())
