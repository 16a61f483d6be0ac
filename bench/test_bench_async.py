"""asyncio: 100 and 1000 concurrent tasks on one client, acquire+release on fresh keys,
on asyncio and on uvloop, for each hotlock.aio backend that is built."""

from __future__ import annotations

import asyncio
import itertools
import uuid

import pytest

from .contestants import open_async

TOTAL = 2000  # cycles per round, spread over the tasks


def _runner(loop_name: str) -> asyncio.Runner:
    if loop_name == "uvloop":
        import uvloop

        return asyncio.Runner(loop_factory=uvloop.new_event_loop)
    return asyncio.Runner()


@pytest.mark.parametrize("loop_name", ["uvloop", "asyncio"])
@pytest.mark.parametrize("tasks", [100, 1000])
def test_async_cycles(benchmark, aio_contestant: str, redis_url: str, tasks: int, loop_name: str) -> None:
    run = uuid.uuid4().hex
    serial = itertools.count()
    with _runner(loop_name) as runner:
        contestant = runner.run(open_async(aio_contestant, redis_url))

        async def round_() -> None:
            n = next(serial)

            async def worker(i: int) -> None:
                for j in range(TOTAL // tasks):
                    await contestant.cycle(f"bench:{run}:{n}:{i}:{j}")

            await asyncio.gather(*(worker(i) for i in range(tasks)))

        try:
            benchmark.pedantic(lambda: runner.run(round_()), rounds=5, iterations=1, warmup_rounds=1)
        finally:
            runner.run(contestant.close())
    benchmark.extra_info["cycles_per_round"] = TOTAL
    benchmark.extra_info["cycles_per_s"] = round(TOTAL / benchmark.stats.stats.median)
