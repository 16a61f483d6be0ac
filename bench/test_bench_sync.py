"""One connection, no contention: acquire+release, extend, batches of 100, lock_wait handoff."""

from __future__ import annotations

import itertools
import threading
import time
import uuid

import hotlock

from .workloads import BATCH, percentile

TTL = 30


def test_cycle(benchmark, cache: hotlock.Cache) -> None:
    """Acquire a fresh key and release it: two round trips."""
    serial = itertools.count()
    run = uuid.uuid4().hex

    def cycle() -> None:
        cache.lock(f"bench:{run}:{next(serial)}", TTL).unlock()

    benchmark(cycle)


def test_extend(benchmark, cache: hotlock.Cache) -> None:
    """Extend one held lock: one round trip."""
    lock = cache.lock(f"bench:{uuid.uuid4().hex}:held", TTL)
    benchmark(lock.extend, TTL)
    lock.unlock()


def test_batch_100(benchmark, cache: hotlock.Cache) -> None:
    """lock_many of 100 fresh keys, then unlock_many: one round trip each."""
    serial = itertools.count()
    run = uuid.uuid4().hex

    def batch() -> None:
        locks = cache.lock_many([f"bench:{run}:{next(serial)}" for _ in range(BATCH)], TTL)
        assert None not in locks
        cache.unlock_many(locks)

    benchmark(batch)


def test_lock_wait_handoff(benchmark, cache: hotlock.Cache) -> None:
    """A thread holds the key for 5 ms; lock_wait takes it once released.

    The benchmark time is hold + handoff; the handoff itself (release -> lock_wait
    returning) goes in extra_info as p50/p99 in ms.
    """
    key = f"bench:{uuid.uuid4().hex}:handoff"
    samples: list[float] = []

    def round_trip() -> None:
        held = cache.lock(key, TTL)
        released: list[float] = []

        def holder() -> None:
            time.sleep(0.005)
            released.append(time.monotonic())
            held.unlock()

        t = threading.Thread(target=holder)
        t.start()
        got = cache.lock_wait(key, TTL, wait=5)
        acquired = time.monotonic()
        t.join(10)
        got.unlock()
        samples.append(acquired - released[0])

    benchmark.pedantic(round_trip, rounds=50, iterations=1, warmup_rounds=2)
    benchmark.extra_info["handoff_p50_ms"] = round(percentile(samples, 50) * 1000, 3)
    benchmark.extra_info["handoff_p99_ms"] = round(percentile(samples, 99) * 1000, 3)
