"""What a credential provider costs per new connection: ``python -m bench.credentials``.

On a private server with an ACL user, each path (native and redis-py, sync and async)
opens ``--n`` new connections one after another (the cache's connections dropped, then one
lock and unlock, which reconnects first) with the password in the url, then with a
``credential_provider`` answering the same user and password, then with the provider and
``reauth_interval`` (long: never due here). Reported: the median over ``--runs`` runs of
the time of one such reconnect-and-cycle, and of the reconnect alone (that minus a warm
cycle of the same run), wall time and this process's CPU time (steadier on a loaded
machine); the difference between the url row and the provider row is the
provider's cost (its get_credentials() call; the AUTH it answers rides in the same round
trip as the url's would). Runs are interleaved across paths and modes. Each row names the
backend it measured.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import time
from typing import Any

import redis

import hotlock
import hotlock.aio

from .server import start_redis

USER, PASSWORD = "bench", "bench-password"


class Provider:
    def get_credentials(self) -> tuple[str, str]:
        return (USER, PASSWORD)


Timing = tuple[float, float, float, float]  # wall and CPU of a reconnect+cycle, then of a warm cycle


def _sync(url: str, backend: str, kwargs: dict[str, Any], n: int) -> Timing:
    cache = hotlock.connect(url, backend=backend, **kwargs)
    try:
        cache.lock("warm", 10).unlock()
        started, cpu = time.perf_counter(), time.process_time()
        for _ in range(n):
            cache.lock("warm", 10).unlock()
        warm, warm_cpu = (time.perf_counter() - started) / n, (time.process_time() - cpu) / n
        total = total_cpu = 0.0
        for _ in range(n):
            cache._backend.close()  # every connection dropped: the next call connects
            started, cpu = time.perf_counter(), time.process_time()
            cache.lock("new", 10).unlock()
            total += time.perf_counter() - started
            total_cpu += time.process_time() - cpu
        return total / n, total_cpu / n, warm, warm_cpu
    finally:
        cache.close()


async def _aio(url: str, backend: str, kwargs: dict[str, Any], n: int) -> Timing:
    cache = await hotlock.aio.connect(url, backend=backend, **kwargs)
    try:
        await (await cache.lock("warm", 10)).unlock()
        started, cpu = time.perf_counter(), time.process_time()
        for _ in range(n):
            await (await cache.lock("warm", 10)).unlock()
        warm, warm_cpu = (time.perf_counter() - started) / n, (time.process_time() - cpu) / n
        total = total_cpu = 0.0
        for _ in range(n):
            await cache._backend.close()
            started, cpu = time.perf_counter(), time.process_time()
            await (await cache.lock("new", 10)).unlock()
            total += time.perf_counter() - started
            total_cpu += time.process_time() - cpu
        return total / n, total_cpu / n, warm, warm_cpu
    finally:
        await cache.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--n", type=int, default=200, help="new connections per run (default 200)")
    parser.add_argument("--runs", type=int, default=5, help="runs; the median is reported (default 5)")
    parser.add_argument(
        "--url-only", action="store_true", help="the url-password rows alone (to measure a build without providers)"
    )
    args = parser.parse_args()
    server = start_redis()
    try:
        with redis.Redis(port=server.port) as admin:
            admin.execute_command("ACL", "SETUSER", USER, "on", f">{PASSWORD}", "~*", "&*", "+@all")
        plain = f"redis://127.0.0.1:{server.port}/0"
        with_password = f"redis://{USER}:{PASSWORD}@127.0.0.1:{server.port}/0"
        modes: list[tuple[str, str, dict[str, Any]]] = [
            ("url password", with_password, {}),
            ("credential_provider", plain, {"credential_provider": Provider()}),
            ("provider + reauth_interval=3600", plain, {"credential_provider": Provider(), "reauth_interval": 3600}),
        ]
        if args.url_only:
            modes = modes[:1]
        paths = ("native", "redis-py", "aio-native", "aio-redis-py")
        # Interleaved: each run measures every path and mode once, so a load that comes and
        # goes on a shared machine falls on all of them alike.
        new: dict[tuple[str, str], list[float]] = {}
        extra: dict[tuple[str, str], list[float]] = {}
        extra_cpu: dict[tuple[str, str], list[float]] = {}
        for _ in range(args.runs):
            for path in paths:
                backend = path.removeprefix("aio-")
                for label, url, kwargs in modes:
                    if path.startswith("aio-"):
                        a, a_cpu, w, w_cpu = asyncio.run(_aio(url, backend, kwargs, args.n))
                    else:
                        a, a_cpu, w, w_cpu = _sync(url, backend, kwargs, args.n)
                    new.setdefault((path, label), []).append(a)
                    extra.setdefault((path, label), []).append(a - w)
                    extra_cpu.setdefault((path, label), []).append(a_cpu - w_cpu)
        print(
            f"{'path':<14} {'credentials':<34} {'reconnect+cycle us':>19} {'reconnect only us':>18} "
            f"{'reconnect client CPU us':>24}"
        )
        for path in paths:
            for label, _, _ in modes:
                print(
                    f"{path:<14} {label:<34} {statistics.median(new[path, label]) * 1e6:>19.1f} "
                    f"{statistics.median(extra[path, label]) * 1e6:>18.1f} "
                    f"{statistics.median(extra_cpu[path, label]) * 1e6:>24.1f}"
                )
    finally:
        server.stop()


if __name__ == "__main__":
    main()
