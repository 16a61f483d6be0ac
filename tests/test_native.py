"""Native-only tests: what the behaviour suite cannot see from the public API.

The GIL really released, fork safety, leaks, the one-round-trip batch, the C backoff
schedule against hotlock._backoff, reconnects, unix sockets, ACL users, READONLY, and
coexistence with hiredis-py. Every test talks to a real redis-server started by the
fixtures; none of them mocks Redis.
"""

from __future__ import annotations

import os
import random
import re
import select
import shutil
import socket
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

import hotlock
from hotlock import _backoff, _scripts
from hotlock._config import parse_url
from hotlock._connect import choose
from hotlock.errors import CacheError, LockLost, LockNotAcquired

from .conftest import RedisServer, lock_name, native_for_module, start_redis

native = native_for_module()


@pytest.fixture
def ncache(redis_url: str) -> Iterator[hotlock.Cache]:
    c = hotlock.connect(redis_url, backend="native")
    assert c.backend == "native"
    yield c
    c.close()


def commandstat(server: RedisServer, command: str) -> int:
    """How many times the server ran ``command`` (INFO commandstats)."""
    entry = server.client().info("commandstats").get(f"cmdstat_{command}")
    return int(entry["calls"]) if entry else 0


def connections_received(server: RedisServer) -> int:
    return int(server.client().info("stats")["total_connections_received"])


def run_python(code: str, env: dict[str, str] | None = None, timeout: float = 100) -> str:
    """Run ``code`` in a fresh interpreter; its stdout, or a failure with its stderr."""
    proc = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        capture_output=True,
        text=True,
        timeout=timeout,
        env={**os.environ, **(env or {})},
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stdout


# -- the backoff schedule and the clock ----------------------------------------------------


def test_native_backoff_schedule_is_the_python_one() -> None:
    """The C loop's delay equals _backoff.delay_ms bit for bit, over every branch."""
    rng = random.Random(3)
    cases = [
        (attempt, u, remaining, holder, cap)
        for attempt in (0, 1, 2, 5, 6, 31, 32, 33, 1000)
        for u in (0.0, 0.25, 0.999999, rng.random())
        for remaining in (0.0, 0.5, 3.0, 10_000.0)
        for holder in (-1, 0, 1, 7, 100_000)
        for cap in (_backoff.CAP_MS, 1.0, 500.0)
    ]
    cases += [(rng.randrange(64), rng.random(), rng.uniform(0, 100), rng.randrange(-1, 80), 50.0) for _ in range(2000)]
    for attempt, u, remaining, holder, cap in cases:
        assert native._delay_ms(attempt, u, remaining, holder, cap) == _backoff.delay_ms(
            attempt, u, remaining, holder, cap
        ), (attempt, u, remaining, holder, cap)
    # The default cap is _backoff's, not a copy that could drift.
    assert native._delay_ms(40, 0.999, 1e9, -1) == _backoff.delay_ms(40, 0.999, 1e9, -1)


def test_native_sent_at_is_on_the_time_monotonic_clock(ncache: hotlock.Cache) -> None:
    before = time.monotonic()
    stamp = native._monotonic_now()
    after = time.monotonic()
    assert before <= stamp <= after
    backend = ncache._backend
    before = time.monotonic()
    result, sent, attempts = backend.acquire_wait(lock_name(b"clock"), os.urandom(16), 5000, 1000)
    after = time.monotonic()
    assert result > 0  # acquired: the fence
    assert before <= sent <= after
    assert attempts == 1  # uncontended


def test_native_lock_wait_wakes_when_the_holder_expires_and_never_passes_the_deadline(
    ncache: hotlock.Cache,
) -> None:
    started = time.monotonic()  # before the holder's TTL starts, so the wait is 0.2 s at least
    ncache.lock("short", ttl=0.2)
    lock = ncache.lock_wait("short", ttl=5, wait=5)
    # The holder's PTTL cuts the sleep: woken at its expiry, not seconds of backoff later.
    assert 0.19 <= time.monotonic() - started < 0.2 + 0.25
    assert lock.unlock() is True

    ncache.lock("long", ttl=30)
    started = time.monotonic()
    with pytest.raises(LockNotAcquired):
        ncache.lock_wait("long", ttl=5, wait=0.3)
    elapsed = time.monotonic() - started
    assert 0.3 <= elapsed < 0.3 + 0.25


# -- the GIL -------------------------------------------------------------------------------


class Counter(threading.Thread):
    """A pure-Python thread counting as fast as it can: it advances only while it has the GIL."""

    def __init__(self) -> None:
        super().__init__(daemon=True)
        self.count = 0
        self.stop = False
        self.rate = 0.0  # counts per second while the main thread sleeps (GIL free)

    def run(self) -> None:
        while not self.stop:
            self.count += 1

    def calibrate(self) -> None:
        before, started = self.count, time.monotonic()
        time.sleep(0.2)
        self.rate = (self.count - before) / (time.monotonic() - started)

    def ran_for(self, before: int) -> float:
        """Seconds' worth of counting since ``before``, at the calibrated rate."""
        return (self.count - before) / self.rate


@pytest.fixture
def counter() -> Iterator[Counter]:
    c = Counter()
    c.start()
    c.calibrate()
    yield c
    c.stop = True
    c.join()


def test_native_round_trip_releases_the_gil(ncache: hotlock.Cache, redis_server: RedisServer, counter: Counter) -> None:
    # CLIENT PAUSE holds every reply for 500 ms: the acquire waits on its socket that long.
    ncache.lock("warm").unlock()
    redis_server.client().execute_command("CLIENT", "PAUSE", 500, "ALL")
    # Give the counter the GIL back from the side client's call before measuring.
    time.sleep(0.01)
    before = counter.count
    started = time.monotonic()
    lock = ncache.lock("paused", ttl=5)
    elapsed = time.monotonic() - started
    ran = counter.ran_for(before)
    assert elapsed >= 0.3, "the server did not hold the reply; the test proves nothing"
    # Had the call kept the GIL, the counter would have run for a switch interval or two
    # (5 ms each, under 4% of the wait) at most; released, it counts through most of the
    # wait. 15%: a loaded machine gives the counter less of a core than it had when it was
    # calibrated, and the bound still stands well above what a held GIL allows.
    assert ran > 0.15 * elapsed, (ran, elapsed)
    assert lock.unlock() is True


def test_native_lock_wait_sleeps_without_the_gil(ncache: hotlock.Cache, counter: Counter) -> None:
    ncache.lock("held", ttl=30)
    before = counter.count
    started = time.monotonic()
    with pytest.raises(LockNotAcquired):
        ncache.lock_wait("held", ttl=5, wait=0.5)
    elapsed = time.monotonic() - started
    assert counter.ran_for(before) > 0.15 * elapsed  # as in the test above


class Interrupted(Exception):
    pass


def test_native_lock_wait_runs_signal_handlers_between_attempts(ncache: hotlock.Cache) -> None:
    """The C loop hands the GIL back between attempts, so Ctrl-C (any Python signal
    handler) ends a long wait promptly instead of after it."""
    import signal

    def interrupt(signum: int, frame: object) -> None:
        raise Interrupted

    ncache.lock("held-for-signal", ttl=30)
    previous = signal.signal(signal.SIGALRM, interrupt)
    try:
        signal.setitimer(signal.ITIMER_REAL, 0.2)
        started = time.monotonic()
        with pytest.raises(Interrupted):
            ncache.lock_wait("held-for-signal", ttl=5, wait=10)
        assert time.monotonic() - started < 0.2 + 0.3
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


def test_native_error_replies_are_cache_errors_naming_key_and_server(
    ncache: hotlock.Cache, redis_server: RedisServer
) -> None:
    redis_server.client().set(b"hotlock:count:{text}", b"not a number")
    with pytest.raises(CacheError, match="not an integer") as info:
        ncache.incr("text")
    assert info.value.key == "hotlock:count:{text}"
    assert info.value.server == ncache.server
    # A key of another type under the lock's name: the script's error, not contention.
    redis_server.client().rpush(lock_name(b"wrongtype"), b"x")
    with pytest.raises(CacheError, match="WRONGTYPE") as lock_info:
        ncache.lock("wrongtype", ttl=5)
    assert not isinstance(lock_info.value, LockNotAcquired)
    # The connection survives an error reply: nothing is left unread on it.
    connections = connections_received(redis_server)
    assert ncache.incr("fine", 2) == 2
    fields = ncache._backend.info()
    assert fields is not None and fields["redis_version"] == redis_server.client().info()["redis_version"]
    assert connections_received(redis_server) == connections


def test_native_reply_timeout_bounds_every_read(redis_url: str, redis_server: RedisServer) -> None:
    cache = hotlock.connect(redis_url, backend="native", timeout=0.3)
    try:
        lock = cache.lock("t", ttl=5)
        redis_server.client().execute_command("CLIENT", "PAUSE", 2000, "ALL")
        started = time.monotonic()
        with pytest.raises(CacheError, match=r"retried after a lost reply.*no reply within the timeout"):
            cache.lock("u", ttl=5)  # one same-token retry, within one more reply timeout
        assert time.monotonic() - started < 2 * 0.3 + 0.3
        started = time.monotonic()
        # The lost reply dropped the connection, so the extend opens a new one: its
        # handshake's reply is lost and retried once (an extend is never sent twice, but a
        # handshake carries nothing of it), within the same two reply timeouts. The error
        # names the handshake's first command (CLIENT SETINFO, the connection's name).
        with pytest.raises(CacheError, match=r"extend \(retried after a lost reply\).*CLIENT SETINFO: no reply"):
            lock.extend(5)
        assert time.monotonic() - started < 2 * 0.3 + 0.3
    finally:
        redis_server.client().execute_command("CLIENT", "UNPAUSE")
        cache.close()
    cache = hotlock.connect(redis_url, backend="native", timeout=0.3)
    cache.lock("after", ttl=5).unlock()  # the server is fine again, and so is a new cache
    cache.close()


# -- threads -------------------------------------------------------------------------------


def test_native_threads_share_a_cache_each_on_its_own_connection(
    ncache: hotlock.Cache, redis_server: RedisServer
) -> None:
    errors: list[BaseException] = []
    counts = [0] * 6

    def work(i: int) -> None:
        try:
            for n in range(300):
                with ncache.lock(f"t{i}-{n}", ttl=5):
                    counts[i] += 1
                # A lock taken in one thread released in another: tokens live in the Lock.
            lock = ncache.lock(f"handoff-{i}", ttl=5)
            t = threading.Thread(target=lambda: lock.unlock())
            t.start()
            t.join()
            assert lock.unlock() is False
        except BaseException as exc:
            errors.append(exc)

    clients_before = int(redis_server.client().info("clients")["connected_clients"])
    threads = [threading.Thread(target=work, args=(i,)) for i in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    assert counts == [300] * 6
    assert redis_server.client().keys("hotlock:lock:*") == []
    # Each finished thread's connection died with it (threading.local dropped it).
    deadline = time.monotonic() + 5
    while int(redis_server.client().info("clients")["connected_clients"]) > clients_before:
        assert time.monotonic() < deadline, "connections of finished threads were not closed"
        time.sleep(0.02)


def test_native_close_while_another_thread_waits_on_a_reply(ncache: hotlock.Cache, redis_server: RedisServer) -> None:
    outcome: list[object] = []

    def blocked() -> None:
        try:
            outcome.append(ncache.lock("mid-close", ttl=5))
        except CacheError as exc:
            outcome.append(exc)

    ncache.lock("warm").unlock()
    redis_server.client().execute_command("CLIENT", "PAUSE", 300, "ALL")
    t = threading.Thread(target=blocked)
    t.start()
    time.sleep(0.1)
    ncache.close()  # must not free the context under the waiting thread
    t.join()
    assert len(outcome) == 1
    lock = ncache.lock("after-close", ttl=5)  # a call after close() reconnects
    assert lock.unlock() is True


# -- fork ----------------------------------------------------------------------------------


# Python 3.12+ warns about fork() with other threads alive (a daemon thread of an earlier
# test may be); these tests fork on purpose, and the child touches only what they check.
def _in_child(fn: object) -> int:
    """Run fn() in a forked child; its exit status (0: fn returned; 1: it raised)."""
    pid = os.fork()
    if pid == 0:
        code = 1
        try:
            fn()  # type: ignore[operator]
            code = 0
        except BaseException as exc:
            print(f"child failed: {exc!r}", file=sys.stderr)
        finally:
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    return os.waitstatus_to_exitcode(status)


@pytest.mark.filterwarnings("ignore:This process .* is multi-threaded:DeprecationWarning")
def test_native_forked_child_inherited_lock_does_nothing(ncache: hotlock.Cache, redis_server: RedisServer) -> None:
    lock = ncache.lock("parent", ttl=30)
    evalsha = commandstat(redis_server, "evalsha")
    connections = connections_received(redis_server)

    def child() -> None:
        try:
            lock.extend(10)
        except LockLost:
            pass
        else:
            raise AssertionError("extend of an inherited lock did not raise LockLost")
        assert lock.unlock() is False
        assert lock.valid_for() == 0.0
        assert ncache.extend_many([lock], 10) == [False]
        assert ncache.unlock_many([lock]) == [False]

    assert _in_child(child) == 0
    # Nothing was sent: not a command, not even a connection.
    assert commandstat(redis_server, "evalsha") == evalsha
    assert connections_received(redis_server) == connections
    # The parent's lock and connection are untouched by the child's life and death.
    lock.extend(30)
    assert connections_received(redis_server) == connections
    assert lock.unlock() is True


@pytest.mark.filterwarnings("ignore:This process .* is multi-threaded:DeprecationWarning")
def test_native_forked_child_reconnects_and_locks(ncache: hotlock.Cache, redis_server: RedisServer) -> None:
    parent_lock = ncache.lock("p", ttl=30)
    connections = connections_received(redis_server)

    def child() -> None:
        # The child's own locks work, over a connection of its own.
        with ncache.lock("c", ttl=30) as mine:
            mine.extend(30)
        assert ncache.lock_many(["c1", "c2"], ttl=30)[0] is not None
        with pytest.raises(LockNotAcquired):
            ncache.lock("p", ttl=30)  # the parent's lock still excludes the child

    assert _in_child(child) == 0
    assert connections_received(redis_server) == connections + 1
    assert redis_server.client().exists(lock_name(b"c1")) == 1
    # The parent goes on over its own socket, which the child neither used nor closed.
    parent_lock.extend(30)
    assert ncache.lock("after-fork", ttl=5).unlock() is True
    assert connections_received(redis_server) == connections + 1
    assert parent_lock.unlock() is True

    # And the other direction: a lock taken in the child before the parent uses it again.
    def child2() -> None:
        ncache.lock("from-child", ttl=30)

    assert _in_child(child2) == 0
    with pytest.raises(LockNotAcquired):
        ncache.lock("from-child", ttl=30)


@pytest.mark.filterwarnings("ignore:This process .* is multi-threaded:DeprecationWarning")
def test_native_fork_while_another_thread_is_mid_call(ncache: hotlock.Cache, redis_server: RedisServer) -> None:
    """The child inherits a context another thread was using without the GIL: it must
    neither crash on it nor send on it."""
    done: list[object] = []

    def blocked() -> None:
        done.append(ncache.lock("mid-fork", ttl=5))

    ncache.lock("warm").unlock()
    redis_server.client().execute_command("CLIENT", "PAUSE", 400, "ALL")
    t = threading.Thread(target=blocked)
    t.start()
    time.sleep(0.1)

    def child() -> None:
        with ncache.lock("child-during", ttl=5):
            pass

    assert _in_child(child) == 0
    t.join()
    assert len(done) == 1 and isinstance(done[0], hotlock.Lock)


# -- leaks ---------------------------------------------------------------------------------


@pytest.mark.timeout(240)
@pytest.mark.parametrize(
    "cycles", [pytest.param(20_000, id="20k"), pytest.param(100_000, id="100k", marks=pytest.mark.slow)]
)
def test_native_no_leak_over_many_cycles(redis_url: str, cycles: int) -> None:
    out = run_python(
        f"""
        import os, hotlock
        from hotlock import LockNotAcquired

        def rss():
            with open("/proc/self/statm") as f:
                return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")

        cache = hotlock.connect({redis_url!r}, backend="native")
        held = cache.lock("held", ttl=600)

        def cycle(i):
            lock = cache.lock(f"k{{i % 1000}}", ttl=5)
            lock.extend(5)
            lock.unlock()
            if i % 50 == 0:
                locks = cache.lock_many([f"b{{j}}" for j in range(20)], ttl=5)
                cache.extend_many(locks, 5)
                cache.unlock_many(locks)
                try:  # the error paths must not leak either
                    cache.lock("held", ttl=5)
                except LockNotAcquired:
                    pass
                cache.set_nx(f"once{{i % 100}}", "1", ttl=1)
                cache.incr("n")

        for i in range(10_000):
            cycle(i)
        start = rss()
        for i in range({cycles}):
            cycle(i)
        print(start, rss())
        """,
        timeout=230,
    )
    start, end = (int(x) for x in out.split())
    # A leaked reply or token per call (100 bytes or so) would be 30 MB over the 3*10^5
    # calls of 100k cycles (make test-slow), 6 MB over the 6*10^4 of 20k (make test).
    assert end - start < 3 * 1024 * 1024, (start, end)


# -- pipelining ----------------------------------------------------------------------------


class TurnCountingProxy:
    """A TCP proxy that counts the client's round trips.

    It holds the server's replies until the client has been quiet for ``quiet`` seconds,
    then forwards them. A client that writes a whole batch before reading is one turn;
    one that waits for each reply before the next command is a turn per command.
    """

    def __init__(self, upstream_port: int, quiet: float = 0.05) -> None:
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = self.listener.getsockname()[1]
        self.upstream_port = upstream_port
        self.quiet = quiet
        self.turns = 0
        self.stopping = False
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        client, _ = self.listener.accept()
        server = socket.create_connection(("127.0.0.1", self.upstream_port))
        held = b""
        last_client = time.monotonic()
        delivered = True  # replies were delivered since the client last wrote
        with client, server:
            while not self.stopping:
                readable, _, _ = select.select([client, server], [], [], 0.01)
                if client in readable:
                    data = client.recv(65536)
                    if not data:
                        return
                    if delivered:
                        self.turns += 1
                        delivered = False
                    last_client = time.monotonic()
                    server.sendall(data)
                if server in readable:
                    data = server.recv(65536)
                    if not data:
                        return
                    held += data
                if held and time.monotonic() - last_client >= self.quiet:
                    client.sendall(held)
                    held = b""
                    delivered = True

    def close(self) -> None:
        self.stopping = True
        self.thread.join(5)
        self.listener.close()


def test_native_batches_are_one_round_trip_with_results_in_order(redis_url: str, redis_server: RedisServer) -> None:
    proxy = TurnCountingProxy(redis_server.port)
    cache = hotlock.connect(f"redis://127.0.0.1:{proxy.port}/0", backend="native")
    try:
        keys = [f"batch-{i}" for i in range(1000)]
        held_elsewhere = set(range(0, 1000, 7))
        for i in held_elsewhere:
            redis_server.client().set(lock_name(keys[i].encode()), b"someone-else", px=30_000)
        turns = proxy.turns
        locks = cache.lock_many(keys, ttl=30)
        # Every key's transaction in one write, then the keys held elsewhere by script in a
        # second: two turns, the second only for a batch that meets a held key.
        assert proxy.turns == turns + 2
        assert [i for i, lk in enumerate(locks) if lk is None] == sorted(held_elsewhere)
        for key, lock in zip(keys, locks, strict=True):
            if lock is not None:
                assert lock.key == key
                assert redis_server.client().get(lock_name(key.encode())) == lock._token

        turns = proxy.turns
        redis_server.client().delete(lock_name(keys[1].encode()))  # lock 1 lost meanwhile
        assert cache.extend_many(locks, 60) == [lk is not None and i != 1 for i, lk in enumerate(locks)]
        # On the Lua-free path SET IFEQ misses a value a waiter marked ('+'), so what it
        # missed (here the lost lock) is asked once more, by script: one more turn, only
        # for a batch with a lost or waited-on lock.
        assert proxy.turns == turns + (2 if redis_server.lua_free else 1)
        assert 59_000 < redis_server.client().pttl(lock_name(keys[2].encode())) <= 60_000

        turns = proxy.turns
        assert cache.unlock_many(locks) == [lk is not None and i != 1 for i, lk in enumerate(locks)]
        assert proxy.turns == turns + (2 if redis_server.lua_free else 1)  # DELIFEQ too (above)
        assert len(redis_server.client().keys("hotlock:lock:{batch-*")) == len(held_elsewhere)

        # The same proxy counts a turn per command for single calls: it can tell.
        turns = proxy.turns
        for i in range(3):
            cache.lock(f"single-{i}", ttl=5)
        assert proxy.turns == turns + 3
    finally:
        cache.close()
        proxy.close()


# -- scripts, reconnects, transports, auth ----------------------------------------------


def test_native_noscript_is_recovered_invisibly(redis_url: str, redis_server: RedisServer) -> None:
    # The script path, forced on every server (the Lua-free path sends no script to lose:
    # tests/test_dialect.py checks that).
    ncache = hotlock.connect(redis_url, backend="native", scripts="always")
    side = redis_server.client()
    lock = ncache.lock("a", ttl=5)
    loads = commandstat(redis_server, "script|load")
    side.script_flush()
    lock.extend(10)  # NOSCRIPT, load every script, the same call again
    assert commandstat(redis_server, "script|load") == loads + len(hotlock._scripts.SCRIPTS)
    assert 9_000 < side.pttl(lock_name(b"a")) <= 10_000
    side.script_flush()
    assert lock.unlock() is True
    side.script_flush()
    locks = ncache.lock_many(["b", "c", "d"], ttl=5)
    assert all(locks)
    side.script_flush()
    # Each release ran once: a NOSCRIPT retry resends only what did not run.
    assert ncache.unlock_many(locks) == [True, True, True]
    assert side.keys("hotlock:lock:*") == []
    ncache.close()


def test_native_scripts_are_loaded_at_connect(redis_url: str, redis_server: RedisServer) -> None:
    cache = hotlock.connect(redis_url, backend="native")
    try:
        shas = [s.sha.decode() for s in hotlock._scripts.SCRIPTS]
        assert redis_server.client().script_exists(*shas) == [True] * len(shas)
    finally:
        cache.close()


def test_native_reconnects_after_client_kill(ncache: hotlock.Cache, redis_server: RedisServer) -> None:
    lock = ncache.lock("k", ttl=30)
    connections = connections_received(redis_server)
    killed = redis_server.client().execute_command("CLIENT", "KILL", "TYPE", "normal", "SKIPME", "yes")
    assert killed >= 1
    # Not one call lost to the dead socket: it is noticed before sending, and replaced.
    lock.extend(30)
    assert connections_received(redis_server) == connections + 1
    assert lock.unlock() is True
    redis_server.client().execute_command("CLIENT", "KILL", "TYPE", "normal", "SKIPME", "yes")
    assert ncache.incr("n") == 1  # even a call that is never retried
    redis_server.client().execute_command("CLIENT", "KILL", "TYPE", "normal", "SKIPME", "yes")
    assert ncache.set_nx("once", "v", ttl=5) is True


def test_native_unix_socket(server_kind: str, tmp_path: object) -> None:
    path = os.path.join(str(tmp_path), "redis.sock")
    server = start_redis("--unixsocket", path, "--unixsocketperm", "700", kind=server_kind)
    try:
        cache = hotlock.connect(f"unix://{path}?db=2", backend="native")
        assert cache.backend == "native"
        with cache.lock("over-unix", ttl=5) as lock:
            side = server.client()
            side.select(2)
            assert side.get(lock_name(b"over-unix")) == lock._token
            clients = side.execute_command("CLIENT", "LIST")
            # A unix-socket client: flags=U (its addr= is the path, cut short by Redis when
            # long, bracketed by Valkey: [/path:0]:0).
            assert " flags=U " in (clients if isinstance(clients, str) else clients.decode())
        cache.close()
    finally:
        server.stop()


def test_native_acl_user_password_and_db(server_kind: str) -> None:
    server = start_redis(kind=server_kind)
    try:
        side = server.client()
        # A user that may run what hotlock needs on its own keys, and not INFO.
        side.execute_command("ACL", "SETUSER", "locker", "on", ">s3cret", "~hotlock:*", "+@all", "-info")
        cache = hotlock.connect(f"redis://locker:s3cret@127.0.0.1:{server.port}/3", backend="native")
        assert cache.backend == "native"
        assert cache._backend.info() is None  # NOPERM: INFO refused, not an error
        with cache.lock("acl", ttl=5) as lock:
            side.select(3)
            assert side.get(lock_name(b"acl")) == lock._token
            users = side.execute_command("CLIENT", "LIST")
            assert "user=locker" in (users if isinstance(users, str) else users.decode())
        cache.close()
        with pytest.raises(CacheError) as info:
            hotlock.connect(f"redis://locker:wrong@127.0.0.1:{server.port}/0", backend="native")
        assert "AUTH" in str(info.value) and str(server.port) in str(info.value)
        assert "wrong" not in str(info.value)  # never the password
    finally:
        server.stop()


def test_native_readonly_is_a_cache_error_that_drops_the_connection(redis_server: RedisServer) -> None:
    replica = start_redis("--replicaof", "127.0.0.1", str(redis_server.port), kind=redis_server.kind)
    try:
        cache = hotlock.connect(replica.url, backend="native", timeout=0.5)
        connections = connections_received(replica)
        with pytest.raises(CacheError, match="READONLY") as info:
            cache.lock("ro", ttl=5)
        assert not isinstance(info.value, LockNotAcquired)
        # Resent on a new connection each time, for the call's timeout (hotlock._transient).
        assert "retried" in str(info.value)
        after = connections_received(replica)
        assert after > connections + 1
        # The demoted server is promoted (as after a failover the address now leads to a
        # primary): the next call reconnects and succeeds.
        replica.client().execute_command("REPLICAOF", "NO", "ONE")
        lock = cache.lock("ro", ttl=5)
        assert connections_received(replica) == after + 1
        assert lock.unlock() is True
        cache.close()
    finally:
        replica.stop()


def test_native_unreachable_server_is_a_cache_error_naming_it() -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # bound, not listening: connection refused
        with pytest.raises(CacheError, match=f"127.0.0.1:{port}"):
            hotlock.connect(f"redis://127.0.0.1:{port}/0", backend="native", connect_timeout=0.5)


# -- the module, the environment, and hiredis-py -------------------------------------------


def _pinned_hiredis() -> str | None:
    """The hiredis version of the pinned sources in vendor/hiredis/ (make vendor), if present."""
    header = Path(__file__).resolve().parent.parent / "vendor" / "hiredis" / "hiredis.h"
    if not header.exists():
        return None
    text = header.read_text()
    parts = [re.search(rf"#define HIREDIS_{p} (\d+)", text) for p in ("MAJOR", "MINOR", "PATCH")]
    return ".".join(m.group(1) for m in parts if m is not None)


def test_native_module_facts() -> None:
    assert isinstance(native.HIREDIS_VERSION, str) and native.HIREDIS_VERSION.count(".") == 2
    pinned = _pinned_hiredis()
    if os.environ.get("HOTLOCK_REQUIRE_EXTENSIONS") == "1":
        # make test builds on the pinned sources, never on a system libhiredis.
        assert pinned is not None, "vendor/hiredis/ is missing: make vendor"
    if pinned is not None:
        assert pinned == native.HIREDIS_VERSION
    info = hotlock.backend_info()
    name, why = choose(parse_url("rediss://127.0.0.1:6380/0", connect_timeout=1, timeout=1), None)
    if pinned is not None and os.environ.get("HOTLOCK_REQUIRE_EXTENSIONS") == "1":
        # make test: the TLS build, on the libssl of Python's own ssl module.
        import ssl

        assert native.__name__ == "hotlock._native_tls"
        assert native.HAS_TLS is True and native.OPENSSL_VERSION == ssl.OPENSSL_VERSION
        assert (name, why) == ("native", None)
        assert info["tls"] == "native" and info["tls_reason"] is None
    if not native.HAS_TLS:
        # rediss:// goes to redis-py, saying why.
        assert name == "redis-py" and why is not None and "TLS" in why
        assert info["tls"] == "redis-py" and info["tls_reason"]
    assert {k: info[k] for k in ("backend", "reason", "hiredis")} == {
        "backend": "native",
        "reason": None,
        "hiredis": native.HIREDIS_VERSION,
    }


def test_native_builds_export_only_their_init_function() -> None:
    """hiredis is linked in with hidden symbols: nothing of it is visible to, or resolved
    against, another hiredis in the process (hiredis-py's, a system libhiredis)."""
    if _pinned_hiredis() is None:
        pytest.skip("built on the system libhiredis: no vendor/hiredis/")
    nm = shutil.which("nm")
    assert nm is not None, "nm (binutils) is needed"
    built = sorted(Path(native.__file__).parent.glob("_native*.so"))
    assert built
    for so in built:
        out = subprocess.run([nm, "-D", "--defined-only", str(so)], capture_output=True, text=True, check=True)
        names = {line.split()[-1] for line in out.stdout.splitlines() if line.strip()}
        assert names == {f"PyInit_{so.name.split('.')[0]}"}, (so.name, sorted(names)[:10])
        undefined = subprocess.run([nm, "-D", "--undefined-only", str(so)], capture_output=True, text=True, check=True)
        assert "redis" not in undefined.stdout, so.name


def test_native_pure_python_env_really_runs_redis_py(redis_url: str) -> None:
    out = run_python(
        f"""
        import sys, hotlock
        info = hotlock.backend_info()
        cache = hotlock.connect({redis_url!r})
        with cache.lock("pure", ttl=5):
            pass
        print(info["backend"], info["reason"], cache.backend, "hotlock._native" in sys.modules, sep="|")
        """,
        env={"HOTLOCK_PURE_PYTHON": "1"},
    )
    assert out.strip() == "redis-py|HOTLOCK_PURE_PYTHON is set|redis-py|False"


@pytest.mark.parametrize("first", ["hiredis-py", "native"])
def test_native_and_hiredis_py_in_one_process(redis_url: str, first: str) -> None:
    """redis-py parses with hiredis-py (its own copy of hiredis); the two must not clash,
    whichever loads first."""
    imports = ["import hiredis, redis", "import hotlock._native"]
    if first == "native":
        imports.reverse()
    out = run_python(
        "\n".join(imports)
        + f"""
import hotlock
from redis.utils import HIREDIS_AVAILABLE
assert HIREDIS_AVAILABLE and redis.connection.DefaultParser.__name__ == "_HiredisParser"
r = redis.Redis.from_url({redis_url!r})
cache = hotlock.connect({redis_url!r}, backend="native")
reader = hiredis.Reader()
for i in range(200):
    with cache.lock(f"both-{{i}}", ttl=5) as lock:
        assert r.get(b"hotlock:lock:{{both-%d}}" % i) == lock._token
        reader.feed(b"*2\\r\\n$3\\r\\nabc\\r\\n:%d\\r\\n" % i)
        assert reader.gets() == [b"abc", i]
    r.set("plain", i)
    assert cache.incr("n") == i + 1
print("ok")
""",
    )
    assert out.strip() == "ok"


def test_native_held_value_is_the_python_definition() -> None:
    # The Lock takes its held value from the C one (a permit's token '#' fence formatted
    # there); the scripts define it in Python.
    rng = random.Random(10)
    fences = [1, 9, 10, 99, 100, 1_764_582_723_123_456, 2**53, 2**63 - 1]
    fences += [rng.randrange(1, 2**63) for _ in range(20_000)]
    for fence in fences:
        token = os.urandom(rng.randrange(0, 20))
        assert native.held_value(token, fence) == _scripts.held_value(token, fence), (token, fence)
    with pytest.raises(ValueError):
        native.held_value(b"t" * 16, 0)


def test_native_wire_form_is_hiredis_own() -> None:
    # Acquire, extend and release are written as RESP by the extension itself
    # (ext/_sync.pxi _resp) instead of by redisAppendCommandArgv: the same bytes.
    rng = random.Random(11)
    sha = _scripts.ACQUIRE.sha
    commands = [
        [b"EVALSHA", sha, b"1", lock_name("k"), os.urandom(16), b"30000"],
        [b"EVALSHA", sha, b"1", lock_name("k"), os.urandom(16) + b"1764582723123456"],
        [b"SET", b"k", b"v", b"IFEQ", b"v", b"PX", b"604800000"],
        [b"DELIFEQ", b"", b"\r\n$3\r\n"],  # empty and RESP-looking arguments are plain bytes
        [b"X"],
        [b"EVALSHA", sha, b"1", b"k" * 1024 + b"\x00\xff", b"t"],
        [b"EVALSHA", sha, b"1", b"k" * 3000, b"t"],  # longer than the stack buffer _append_resp uses
    ]
    commands += [[os.urandom(rng.randrange(0, 300)) for _ in range(rng.randrange(1, 16))] for _ in range(2000)]
    for args in commands:
        ours, hiredis = native._resp_pair(args)
        assert ours == hiredis, args
