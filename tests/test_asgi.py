"""hotlock.asgi against real processes: ``uvicorn --workers 2`` serving tests/webapps/asgi_app.py
(FastAPI and a Starlette route) and an aiohttp server process, driven by httpx, over a
private Redis. Overlaps are counted across the processes by tests/webapps/checker.py, which
is shown to count them on a route without the lock."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

httpx = pytest.importorskip("httpx")
pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")

from .conftest import RedisServer, free_port, start_redis  # noqa: E402
from .webapps.checker import FileChecker  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def server() -> Iterator[RedisServer]:
    redis_server = start_redis()
    yield redis_server
    redis_server.stop()


def _serve(cmd: list[str], env: dict[str, str], port: int, log: Path) -> subprocess.Popen[bytes]:
    with open(log, "wb") as out:
        proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 30
    while True:
        try:
            httpx.get(f"http://127.0.0.1:{port}/nothing-here", timeout=1)
            return proc
        except httpx.TransportError:
            if proc.poll() is not None or time.monotonic() > deadline:
                proc.kill()
                proc.wait()
                raise AssertionError(f"{cmd[2]} did not start:\n{log.read_text()[-3000:]}") from None
            time.sleep(0.1)


def _stop(proc: subprocess.Popen[bytes]) -> None:
    proc.terminate()
    try:
        proc.wait(15)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def _env(server: RedisServer, checker: Path) -> dict[str, str]:
    env = dict(os.environ)
    env.update(CACHE_URL=server.url, CHECKER=str(checker), DOWN_URL=f"redis://127.0.0.1:{free_port()}/0")
    return env


@pytest.fixture(scope="class")
def uvicorn_app(server: RedisServer, tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, FileChecker]]:
    tmp = tmp_path_factory.mktemp("asgi")
    port = free_port()
    cmd = [sys.executable, "-m", "uvicorn", "tests.webapps.asgi_app:app", "--workers", "2", "--port", str(port)]
    cmd += ["--log-level", "warning"]
    proc = _serve(cmd, _env(server, tmp / "checker.json"), port, tmp / "uvicorn.log")
    yield f"http://127.0.0.1:{port}", FileChecker(str(tmp / "checker.json"))
    _stop(proc)


@pytest.fixture(scope="module")
def aiohttp_app(server: RedisServer, tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, FileChecker]]:
    pytest.importorskip("aiohttp")
    tmp = tmp_path_factory.mktemp("aiohttp")
    port = free_port()
    cmd = [sys.executable, "-m", "tests.webapps.aiohttp_app", str(port)]
    proc = _serve(cmd, _env(server, tmp / "checker.json"), port, tmp / "aiohttp.log")
    yield f"http://127.0.0.1:{port}", FileChecker(str(tmp / "checker.json"))
    _stop(proc)


def burst(url: str, n: int, rounds: int = 1) -> list[httpx.Response]:
    """``n`` requests at once, ``rounds`` times over."""

    async def main() -> list[httpx.Response]:
        got: list[httpx.Response] = []
        async with httpx.AsyncClient(timeout=30, limits=httpx.Limits(max_connections=n)) as client:
            for _ in range(rounds):
                got += await asyncio.gather(*(client.get(url) for _ in range(n)))
        return got

    return asyncio.run(main())


def statuses(responses: list[httpx.Response]) -> dict[int, int]:
    counts: dict[int, int] = {}
    for r in responses:
        counts[r.status_code] = counts.get(r.status_code, 0) + 1
    return counts


def check_conflicts(responses: list[httpx.Response], ttl: int = 5) -> None:
    for r in responses:
        if r.status_code == 409:
            # The holder's remaining TTL, whole seconds, rounded up.
            assert 1 <= int(r.headers["Retry-After"]) <= ttl, r.headers


class TestUvicorn:
    """The FastAPI app (and its Starlette route) on uvicorn --workers 2: the server is up for
    this class only, so no more than four processes run at once (uvicorn's three, pytest)."""

    def test_fastapi_one_holder_across_two_workers(self, uvicorn_app: tuple[str, FileChecker]) -> None:
        base, checker = uvicorn_app
        responses = burst(f"{base}/work/a?hold=0.15", 12, rounds=6)
        counts = statuses(responses)
        assert set(counts) <= {200, 409}, counts
        assert counts.get(200, 0) >= 6  # at least one per round
        assert counts.get(409, 0) >= 6 * 6
        check_conflicts(responses)
        sections, overlaps, most = checker.of("work:a")
        assert (sections, overlaps, most) == (counts[200], 0, 1)
        # Both workers served the burst: the exclusion held across processes.
        pids = {r.json()["pid"] for r in responses if r.status_code == 200}
        deadline = time.monotonic() + 20
        while len(set(checker.read()["pids"])) < 2 and time.monotonic() < deadline:
            burst(f"{base}/work/b?hold=0.01", 8)
        assert len(set(checker.read()["pids"])) == 2, pids
        print(f"\nfastapi one holder: {counts} from 2 workers, {overlaps} overlaps")

    def test_the_checker_catches_overlaps_without_the_lock(self, uvicorn_app: tuple[str, FileChecker]) -> None:
        base, checker = uvicorn_app
        counts = statuses(burst(f"{base}/unlocked/a?hold=0.15", 8))
        assert counts == {200: 8}
        _, overlaps, most = checker.of("unlocked:a")
        assert overlaps > 0 and most > 1
        print(f"\nfastapi without the lock: {overlaps} overlaps, {most} inside at once")

    def test_fastapi_limit_lets_two_in(self, uvicorn_app: tuple[str, FileChecker]) -> None:
        base, checker = uvicorn_app
        responses = burst(f"{base}/limited/a?hold=0.2", 8, rounds=4)
        counts = statuses(responses)
        assert counts.get(200, 0) >= 4 * 2 - 2 and counts.get(409, 0) > 0, counts
        check_conflicts(responses)
        _, overlaps, most = checker.of("limited:a")
        assert overlaps == 0 and most == 2

    def test_fastapi_wait_serializes_instead_of_refusing(self, uvicorn_app: tuple[str, FileChecker]) -> None:
        base, checker = uvicorn_app
        counts = statuses(burst(f"{base}/waits/a?hold=0.05", 8))
        assert counts == {200: 8}
        assert checker.of("waits:a") == (8, 0, 1)

    def test_fastapi_lock_covers_the_streamed_body_and_is_released_after_it(
        self, uvicorn_app: tuple[str, FileChecker]
    ) -> None:
        base, checker = uvicorn_app

        async def main() -> None:
            async with httpx.AsyncClient(timeout=30) as client:
                async with client.stream("GET", f"{base}/stream/a?chunks=6&gap=0.1") as streaming:
                    assert streaming.status_code == 200
                    chunks = streaming.aiter_lines()
                    assert await anext(chunks) == "0"
                    # Mid-body: the response is not sent yet, so the lock is held.
                    busy = await client.get(f"{base}/stream/a?chunks=1&gap=0")
                    assert busy.status_code == 409
                    assert [line async for line in chunks] == ["1", "2", "3", "4", "5"]
                # Sent: released right after (by the dependency's exit, FastAPI >= 0.118).
                deadline = time.monotonic() + 2
                while (again := await client.get(f"{base}/stream/a?chunks=1&gap=0")).status_code == 409:
                    assert time.monotonic() < deadline, "the lock was not released after the response"
                    await asyncio.sleep(0.02)
                assert again.status_code == 200

        asyncio.run(main())
        sections, overlaps, _ = checker.of("stream:a")
        assert sections >= 2 and overlaps == 0

    def test_fastapi_outage_is_503_not_409(self, uvicorn_app: tuple[str, FileChecker]) -> None:
        base, _ = uvicorn_app
        r = httpx.get(f"{base}/down/a", timeout=10)
        assert r.status_code == 503
        assert r.headers["Retry-After"] == "1"

    def test_starlette_endpoint_decorator(self, uvicorn_app: tuple[str, FileChecker]) -> None:
        base, checker = uvicorn_app
        responses = burst(f"{base}/plain/a?hold=0.15", 8, rounds=3)
        counts = statuses(responses)
        assert counts.get(200, 0) >= 3 and counts.get(409, 0) > 0, counts
        check_conflicts(responses)
        assert checker.of("plain:a")[1:] == (0, 1)


def test_aiohttp_handler_decorator(aiohttp_app: tuple[str, FileChecker]) -> None:
    base, checker = aiohttp_app
    responses = burst(f"{base}/work/a?hold=0.15", 8, rounds=3)
    counts = statuses(responses)
    assert counts.get(200, 0) >= 3 and counts.get(409, 0) > 0, counts
    check_conflicts(responses)
    assert checker.of("aio:a")[1:] == (0, 1)

    async def main() -> None:
        async with httpx.AsyncClient(timeout=30) as client:
            async with client.stream("GET", f"{base}/stream/a") as streaming:
                chunks = streaming.aiter_lines()
                assert await anext(chunks) == "0"
                assert (await client.get(f"{base}/stream/a")).status_code == 409
                assert [line async for line in chunks] == ["1", "2", "3", "4"]
            deadline = time.monotonic() + 2
            while (await client.get(f"{base}/stream/a")).status_code == 409:
                assert time.monotonic() < deadline, "the lock was not released after the response"
                await asyncio.sleep(0.02)

    asyncio.run(main())
