"""pytest-benchmark suite: ``pytest bench`` (not collected by ``make test``, whose testpaths is tests/).

One private redis-server on a free loopback port for the session, pinned to the first
core when taskset exists (the comparison run, ``python -m bench``, also pins the client).
Every hotlock backend that is built is measured; one that is not is skipped with the
reason ("not built: ..."), so the report says which ones ran.
"""

from __future__ import annotations

import importlib
from collections.abc import Iterator

import pytest

import hotlock

from .contestants import ASYNC, sync_unavailable
from .server import RedisServer, pinning, start_redis


def pytest_report_header(config: pytest.Config) -> list[str]:
    info = hotlock.backend_info()
    lines = [f"hotlock: default backend {info['backend']}" + (f" ({info['reason']})" if info["reason"] else "")]
    try:
        aio = importlib.import_module("hotlock.aio").backend_info()
        why = f" ({aio['reason']})" if aio["reason"] else ""
        lines.append(f"hotlock.aio: default backend {aio['backend']}{why}")
    except ImportError as exc:
        lines.append(f"hotlock.aio: not built ({exc})")
    return lines


@pytest.fixture(scope="session")
def redis_server() -> Iterator[RedisServer]:
    pin = pinning()
    server = start_redis(pin.server)
    yield server
    server.stop()


@pytest.fixture(scope="session")
def redis_url(redis_server: RedisServer) -> str:
    return redis_server.url


@pytest.fixture(params=["native", "redis-py"])
def backend(request: pytest.FixtureRequest) -> str:
    name: str = request.param
    why = sync_unavailable(f"hotlock-{name}")
    if why:
        pytest.skip(f"hotlock {name}: {why}")
    return name


@pytest.fixture
def cache(backend: str, redis_url: str) -> Iterator[hotlock.Cache]:
    c = hotlock.connect(redis_url, backend=backend)
    yield c
    c.close()


@pytest.fixture(params=[n for n in ASYNC if n.startswith("hotlock")])
def aio_contestant(request: pytest.FixtureRequest, redis_url: str) -> str:
    from .contestants import async_unavailable

    name: str = request.param
    why = async_unavailable(name, redis_url)
    if why:
        pytest.skip(f"{name}: {why}")
    return name
