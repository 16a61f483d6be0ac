"""Contention: 8 threads and 4 processes on 16 keys, a tiny critical section, fixed work per round.

The benchmark time is the time for every worker to finish its SECTIONS sections (the
processes' time also covers forking them and connecting; no warm-up, unlike the
comparison's contention runs); sections/s, p50/p99 wait and
per-worker counts go in extra_info.
"""

from __future__ import annotations

import uuid

import pytest

import hotlock

from .contestants import Hotlock
from .workloads import contention_processes, contention_threads

SECTIONS = 200  # per worker per round
LIMIT_S = 60.0  # a bound on a round, never reached unless something is badly wrong


def _record(benchmark, result: dict) -> None:
    benchmark.extra_info.update(
        sections_per_s=round(result["ops"] / result["seconds"]),
        wait_p50_ms=round(result["wait_p50"] * 1000, 3),
        wait_p99_ms=round(result["wait_p99"] * 1000, 3),
        wait_max_ms=round(result["wait_max"] * 1000, 3),
        worker_min=result["worker_min"],
        worker_max=result["worker_max"],
    )
    # Not timing assertions: a lock that let two holders in, or gave up, measured nothing.
    assert result["overlaps"] == 0
    assert result["timeouts"] == 0


def test_contention_8_threads(benchmark, backend: str, redis_url: str) -> None:
    contestant = Hotlock(redis_url, backend)
    results: list[dict] = []

    def run() -> None:
        results.append(
            contention_threads(
                contestant, uuid.uuid4().hex, workers=8, nkeys=16, seconds=LIMIT_S, limit=SECTIONS, warm_s=0.0
            )
        )

    try:
        benchmark.pedantic(run, rounds=3, iterations=1)
    finally:
        contestant.close()
    _record(benchmark, results[-1])


@pytest.mark.parametrize("workers", [4])
def test_contention_4_processes(benchmark, backend: str, redis_url: str, workers: int) -> None:
    results: list[dict] = []

    def run() -> None:
        results.append(
            contention_processes(
                f"hotlock-{backend}",
                redis_url,
                uuid.uuid4().hex,
                workers=workers,
                nkeys=16,
                seconds=LIMIT_S,
                limit=SECTIONS,
                warm_s=0.0,
            )
        )

    benchmark.pedantic(run, rounds=3, iterations=1)
    _record(benchmark, results[-1])


def test_backend_reported(backend: str) -> None:
    """Say in the report which backend the parameter really is (not a speed test)."""
    info = hotlock.backend_info()
    if backend == "native":
        assert info["backend"] == "native"
