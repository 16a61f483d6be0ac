"""Test harness: a private redis-server on a free loopback port, and one fixture per backend.

HOTLOCK_TEST_REDIS_URL names an existing server instead (it is flushed between tests).
Under HOTLOCK_REQUIRE_EXTENSIONS=1 a native backend that does not import fails the run.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass, field

import pytest
import redis

import hotlock
from hotlock._backend import native_module
from hotlock._keys import stored

LOCK_SPACE = b"hotlock:lock:"


def lock_name(key: str | bytes) -> bytes:
    """The Redis key of a lock on ``key`` under the default prefix (the README's layout)."""
    return stored(LOCK_SPACE, key.encode() if isinstance(key, str) else key)


REQUIRE_NATIVE = os.environ.get("HOTLOCK_REQUIRE_EXTENSIONS") == "1"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass
class RedisServer:
    """A redis-server this test session started (pid set) or was given (pid None)."""

    url: str
    host: str = "127.0.0.1"
    port: int = 6379
    pid: int | None = None
    proc: subprocess.Popen[bytes] | None = None
    workdir: str | None = None
    _client: redis.Redis | None = field(default=None, repr=False)

    def client(self) -> redis.Redis:
        """A plain redis-py client for looking at the server from the side."""
        if self._client is None:
            self._client = redis.Redis.from_url(self.url, socket_timeout=5)
        return self._client

    def stop(self) -> None:
        if self._client is not None:
            self._client.close()
        if self.proc is not None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        if self.workdir:
            shutil.rmtree(self.workdir, ignore_errors=True)


def start_redis(*extra: str) -> RedisServer:
    """Start redis-server on a free loopback port, without persistence; wait until it answers."""
    exe = shutil.which("redis-server")
    if exe is None:
        pytest.fail("redis-server is not installed (make test installs it)")
    port = free_port()
    workdir = tempfile.mkdtemp(prefix="hotlock-redis-")
    cmd = [
        exe,
        "--port",
        str(port),
        "--bind",
        "127.0.0.1",
        "--save",
        "",
        "--appendonly",
        "no",
        "--dir",
        workdir,
        "--daemonize",
        "no",
        "--loglevel",
        "warning",
        "--logfile",
        os.path.join(workdir, "redis.log"),
        *extra,
    ]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    server = RedisServer(url=f"redis://127.0.0.1:{port}/0", port=port, pid=proc.pid, proc=proc, workdir=workdir)
    deadline = time.monotonic() + 10
    while True:
        try:
            if server.client().ping():
                return server
        except redis.ConnectionError:
            pass
        if proc.poll() is not None or time.monotonic() > deadline:
            server.stop()
            with open(os.path.join(workdir, "redis.log")) as log:
                pytest.fail(f"redis-server did not start: {log.read()[-2000:]}")
        time.sleep(0.02)


@pytest.fixture(scope="session")
def redis_server() -> Iterator[RedisServer]:
    given = os.environ.get("HOTLOCK_TEST_REDIS_URL")
    if given:
        yield RedisServer(url=given)
        return
    server = start_redis()
    yield server
    server.stop()


@pytest.fixture
def redis_url(redis_server: RedisServer) -> str:
    """The server's URL, with its data and its script cache emptied for this test."""
    client = redis_server.client()
    client.flushall()
    # Every test starts with an empty script cache, so NOSCRIPT recovery runs all the time.
    client.script_flush()
    return redis_server.url


def _backend_params() -> list[str]:
    params = ["memory", "redis-py"]
    native, _ = native_module()
    if native is not None or REQUIRE_NATIVE:
        params.append("native")
    return params


BACKENDS = _backend_params()


@pytest.fixture(params=BACKENDS)
def backend(request: pytest.FixtureRequest) -> str:
    name: str = request.param
    if name == "native":
        native, why = native_module()
        if native is None:
            pytest.fail(f"HOTLOCK_REQUIRE_EXTENSIONS=1 but the native backend is not live: {why}")
    return name


@pytest.fixture(params=[b for b in BACKENDS if b != "memory"])
def redis_backend(request: pytest.FixtureRequest) -> str:
    """The backends that talk to Redis (for tests that look at the server)."""
    name: str = request.param
    if name == "native" and native_module()[0] is None:
        pytest.fail(f"HOTLOCK_REQUIRE_EXTENSIONS=1 but the native backend is not live: {native_module()[1]}")
    return name


def open_cache(backend: str, url: str, **kwargs: object) -> hotlock.Cache:
    if backend == "memory":
        return hotlock.connect(None, **kwargs)  # type: ignore[arg-type]
    return hotlock.connect(url, backend=backend, **kwargs)  # type: ignore[arg-type]


@pytest.fixture
def cache(backend: str, redis_url: str, monkeypatch: pytest.MonkeyPatch) -> Iterator[hotlock.Cache]:
    monkeypatch.delenv("CACHE_URL", raising=False)
    c = open_cache(backend, redis_url)
    yield c
    c.close()


@pytest.fixture
def rcache(redis_backend: str, redis_url: str) -> Iterator[hotlock.Cache]:
    """A cache on a Redis-backed backend."""
    c = open_cache(redis_backend, redis_url)
    yield c
    c.close()
