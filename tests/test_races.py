"""The thread-race stress (tests/race_stress.py) in short runs: calls from eight threads
while another closes the cache every 0-2 ms, another flushes the scripts every 3 ms (so
NOSCRIPT replies and script reloads are in flight when the cache closes), and another
forks; the interpreter switching threads every 10 us. Each run is its own process: a
crash is a signal in its exit status. The long form is `make stress`.

Before the connection rules of ext/_sync.pxi (close() leaves a connection a call is using
to that call), the native run died with SIGSEGV within a second; on redis-py, close()
disconnected sockets under other threads' reads, and TypeError/ValueError escaped to the
callers, and a forked child hung resetting the parent's pool.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from .cluster import Cluster
from .conftest import RedisServer, native_for_module, start_redis
from .tls import Pki, start_tls_redis

ROOT = Path(__file__).resolve().parent.parent
SECONDS = float(os.environ.get("HOTLOCK_STRESS_SECONDS", "2"))
# make stress runs each for minutes: the subprocess's own bound (below) is the test's.
pytestmark = pytest.mark.timeout(SECONDS * 10 + 120)


def stress(url: str, backend: str, *extra: str) -> str:
    """Run the stress; its summary line. Fails on a signal, an escaped exception or a hang."""
    argv = [sys.executable, "-W", "ignore::DeprecationWarning", "-m", "tests.race_stress", url, backend]
    # Bounded loosely: the run itself takes SECONDS, every call has a 1 s timeout.
    proc = subprocess.run(
        [*argv, str(SECONDS), *extra], cwd=ROOT, capture_output=True, text=True, timeout=SECONDS * 10 + 60
    )
    assert proc.returncode == 0, f"exit {proc.returncode}\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"
    summary = proc.stdout.strip().splitlines()[-1]
    assert "'ok'" in summary, summary  # the calls did run
    return summary


@pytest.mark.parametrize("backend", ["native", "redis-py"])
def test_race_stress_one_server(backend: str, redis_server: RedisServer) -> None:
    if backend == "native":
        native_for_module()
    stress(redis_server.url, backend, "--fork")


def test_race_stress_cluster_native(redis_cluster: Cluster) -> None:
    native_for_module()
    stress(redis_cluster.url, "native", *[a for n in redis_cluster.nodes for a in ("--flush", n.url)])


def test_race_stress_unix_socket_native() -> None:
    native_for_module()
    with tempfile.TemporaryDirectory(prefix="hotlock-race-") as d:
        path = f"{d}/redis.sock"
        server = start_redis("--unixsocket", path, "--unixsocketperm", "700")
        try:
            stress(f"unix://{path}", "native", "--flush", server.url)
        finally:
            server.stop()


@pytest.mark.parametrize("backend", ["native", "redis-py"])
def test_race_stress_tls(backend: str) -> None:
    """Over TLS a close() also frees the SSL object. No fork here: a child forked while
    other threads are inside OpenSSL can wait for ever on a lock of OpenSSL's own (seen in
    ssl.create_default_context), whatever hotlock does; the fork runs are over TCP."""
    if backend == "native":
        native_for_module()
    with tempfile.TemporaryDirectory(prefix="hotlock-race-pki-") as d:
        server = start_tls_redis(Pki.make(Path(d)), "race", "DNS:localhost")
        try:
            stress(server.url(ssl_ca_certs=str(server.ca)), backend, "--flush", server.plain.url)
        finally:
            server.stop()
