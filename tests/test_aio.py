"""The async twin of the behaviour suite: hotlock.aio over every backend, on asyncio and uvloop.

No pytest-asyncio: each test builds its coroutine and the ``aio`` fixture runs it on a
fresh loop of the parametrized kind (asyncio.Runner with uvloop's loop factory, or the
default one). Ids read ``test_x[native-uvloop]``.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import os
import random
import statistics
import subprocess
import sys
import time
from collections.abc import Awaitable, Callable, Coroutine, Iterator
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, TypeVar

import pytest
import redis
import uvloop

import hotlock
import hotlock.aio
from hotlock.backends.native import native_aio

from .conftest import RedisServer, free_port, lock_name, server_exe, start_redis
from .faultproxy import FaultProxy

T = TypeVar("T")

REQUIRE_NATIVE = os.environ.get("HOTLOCK_REQUIRE_EXTENSIONS") == "1"


def _backend_params() -> list[str]:
    # As conftest does for sync: the native async backend joins when the extension carries
    # the protocol, and under HOTLOCK_REQUIRE_EXTENSIONS=1 its absence is a failure.
    params = ["memory", "redis-py"]
    if native_aio()[0] is not None or REQUIRE_NATIVE:
        params.append("native")
    return params


BACKENDS = _backend_params()
REDIS_BACKENDS = [b for b in BACKENDS if b != "memory"]
LOOPS = ["asyncio", "uvloop"]


@dataclass
class Aio:
    """One backend on one kind of loop, against the session's redis-server."""

    backend: str
    loop: str
    url: str
    server: RedisServer
    # On the cluster topology: a redis-py cluster client to look from the side with.
    cluster_side: redis.cluster.RedisCluster | None = None

    def run(self, coro: Coroutine[Any, Any, T]) -> T:
        if sys.version_info < (3, 11):
            # No asyncio.Runner before 3.11; asyncio.run and uvloop.run do the same work there
            # (a fresh loop, the leftover tasks cancelled, the loop closed).
            return uvloop.run(coro) if self.loop == "uvloop" else asyncio.run(coro)
        factory = uvloop.new_event_loop if self.loop == "uvloop" else None
        with asyncio.Runner(loop_factory=factory) as runner:
            return runner.run(coro)

    async def connect(self, **kwargs: Any) -> hotlock.aio.AsyncCache:
        if self.backend == "memory":
            return await hotlock.aio.connect(None, **kwargs)
        return await hotlock.aio.connect(self.url, backend=self.backend, **kwargs)

    @property
    def side(self) -> redis.Redis:
        """A plain sync client for looking at the server (or the cluster) from the side."""
        return self.cluster_side if self.cluster_side is not None else self.server.client()  # type: ignore[return-value]


def _require(backend: str) -> None:
    if backend == "native" and native_aio()[0] is None:
        pytest.fail(f"HOTLOCK_REQUIRE_EXTENSIONS=1 but the native async backend is not live: {native_aio()[1]}")


@pytest.fixture(params=LOOPS)
def loop_kind(request: pytest.FixtureRequest) -> str:
    return str(request.param)


@pytest.fixture(params=BACKENDS)
def aio(
    request: pytest.FixtureRequest,
    loop_kind: str,
    server_url: str,
    redis_server: RedisServer,
    topology: str,
    monkeypatch: pytest.MonkeyPatch,
) -> Iterator[Aio]:
    """On one server, or (tests marked topologies("single", "cluster")) on the Redis Cluster."""
    _require(request.param)
    if request.param == "memory" and topology != "single":
        pytest.fail("the memory backend has no cluster form (conftest deselects this pair)")
    monkeypatch.delenv("CACHE_URL", raising=False)
    side = None
    if topology == "cluster":
        port = request.getfixturevalue("redis_cluster").primary_ports()[0]
        side = redis.cluster.RedisCluster(host="127.0.0.1", port=port, socket_timeout=5)
    yield Aio(request.param, loop_kind, server_url, redis_server, side)
    if side is not None:
        side.close()


@pytest.fixture(params=REDIS_BACKENDS)
def raio(
    request: pytest.FixtureRequest,
    loop_kind: str,
    redis_url: str,
    redis_server: RedisServer,
    monkeypatch: pytest.MonkeyPatch,
) -> Aio:
    """The backends that talk to Redis (for tests that look at the server)."""
    _require(request.param)
    monkeypatch.delenv("CACHE_URL", raising=False)
    return Aio(request.param, loop_kind, redis_url, redis_server)


def lock_key(name: str) -> bytes:
    return lock_name(name)


def stored(aio: Aio, name: str) -> bytes | None:
    """What the server holds under a lock's key: its token, or None."""
    value = aio.side.get(lock_key(name))
    assert value is None or isinstance(value, bytes)
    return value


# -- the lock -------------------------------------------------------------------------


@pytest.mark.topologies("single", "cluster")
def test_lock_excludes_and_unlock_is_idempotent(aio: Aio) -> None:
    async def main() -> None:
        async with await aio.connect() as cache:
            lock = await cache.lock("job", ttl=5)
            with pytest.raises(hotlock.LockNotAcquired) as info:
                await cache.lock("job", ttl=5)
            assert info.value.key == "job"
            assert "job" in str(info.value) and cache.server in str(info.value)
            assert await lock.unlock() is True
            assert await lock.unlock() is False
            again = await cache.lock("job", ttl=5)
            assert await again.unlock() is True

    aio.run(main())


@pytest.mark.topologies("single", "cluster")
def test_async_with_releases_on_error_and_the_error_propagates(aio: Aio) -> None:
    class Boom(Exception):
        pass

    async def main() -> None:
        async with await aio.connect() as cache:
            with pytest.raises(Boom):
                async with cache.lock("job", ttl=5) as lock:
                    assert isinstance(lock, hotlock.aio.AsyncLock)
                    assert lock.valid_for() > 4
                    raise Boom
            # Released: a new acquisition succeeds at once.
            assert await (await cache.lock("job", ttl=5)).unlock()
            # An awaited lock is a context manager too.
            async with await cache.lock("job", ttl=5):
                with pytest.raises(hotlock.LockNotAcquired):
                    await cache.lock("job")
            assert await (await cache.lock("job", ttl=5)).unlock()

    aio.run(main())


@pytest.mark.topologies("single", "cluster")
def test_lock_wait_gets_the_lock_when_the_holder_releases(aio: Aio) -> None:
    async def main() -> None:
        async with await aio.connect() as cache:
            holder = await cache.lock("job", ttl=10)
            loop = asyncio.get_running_loop()
            loop.call_later(0.05, lambda: asyncio.ensure_future(holder.unlock()))
            start = loop.time()
            lock = await cache.lock_wait("job", ttl=5, wait=2)
            assert 0.03 < loop.time() - start < 2.0
            assert await lock.unlock()

    aio.run(main())


@pytest.mark.topologies("single", "cluster")
def test_lock_wait_gives_up_at_the_deadline_and_wait_zero_is_one_attempt(aio: Aio) -> None:
    async def main() -> None:
        async with await aio.connect() as cache:
            await cache.lock("job", ttl=10)
            loop = asyncio.get_running_loop()
            start = loop.time()
            with pytest.raises(hotlock.LockNotAcquired) as info:
                await cache.lock_wait("job", ttl=5, wait=timedelta(milliseconds=150))
            took = loop.time() - start
            assert 0.14 <= took < 1.5
            assert "after waiting 0.150 s" in str(info.value)
            start = loop.time()
            with pytest.raises(hotlock.LockNotAcquired):
                await cache.lock_wait("job", ttl=5, wait=0)
            assert loop.time() - start < 0.5
            # The module-level twin, usable with async with.
            async with hotlock.aio.lock_wait(cache, "other", 5, 0.1) as lock:
                assert lock.key == "other"

    aio.run(main())


@pytest.mark.topologies("single", "cluster")
def test_lock_wait_wakes_when_the_holders_ttl_runs_out(aio: Aio) -> None:
    async def main() -> None:
        async with await aio.connect() as cache:
            await cache.lock("job", ttl=0.1)  # never released: expires by its TTL
            loop = asyncio.get_running_loop()
            start = loop.time()
            lock = await cache.lock_wait("job", ttl=5, wait=5)
            assert loop.time() - start < 2.5
            assert await lock.unlock()

    aio.run(main())


@pytest.mark.topologies("single", "cluster")
def test_extend_sets_the_ttl_from_now_and_raises_lock_lost_when_gone(aio: Aio) -> None:
    async def main() -> None:
        async with await aio.connect() as cache:
            lock = await cache.lock("job", ttl=0.2)
            await lock.extend(30)
            assert 29 < lock.valid_for() <= 30 and lock.ttl == 30
            if aio.backend != "memory":
                assert 29_000 < aio.side.pttl(lock_key("job")) <= 30_000
            await lock.extend(0.1)  # shorter: never added to what is left
            assert lock.valid_for() <= 0.1 + 1e-9  # (float noise of sent + 0.1 - now)
            await asyncio.sleep(0.15)
            assert lock.valid_for() == 0.0
            with pytest.raises(hotlock.LockLost) as info:
                await lock.extend(5)
            assert info.value.key == "job" and "no longer held" in str(info.value)
            assert await lock.unlock() is False
            done = await cache.lock("done", ttl=5)
            await done.unlock()
            with pytest.raises(hotlock.LockLost, match="already released"):
                await done.extend()

    aio.run(main())


@pytest.mark.topologies("single", "cluster")
def test_an_expired_lock_never_releases_its_successor(aio: Aio) -> None:
    async def main() -> None:
        async with await aio.connect() as cache:
            old = await cache.lock("job", ttl=0.05)
            await asyncio.sleep(0.1)
            new = await cache.lock("job", ttl=5)
            assert await old.unlock() is False
            with pytest.raises(hotlock.LockLost):
                await old.extend(5)
            with pytest.raises(hotlock.LockNotAcquired):
                await cache.lock("job", ttl=5)
            assert await new.unlock() is True

    aio.run(main())


def test_the_token_belongs_to_the_lock_object_and_any_task_may_release_it(raio: Aio) -> None:
    async def main() -> None:
        async with await raio.connect() as cache:
            a, b = await asyncio.gather(cache.lock("a", ttl=5), cache.lock("b", ttl=5))
            stored_a, stored_b = stored(raio, "a"), stored(raio, "b")
            # The key layout under the prefix, and a fresh 16-byte token per acquisition
            # (the fence is not stored).
            assert stored_a is not None and stored_b is not None
            assert stored_a == a._token and stored_b == b._token and len(stored_a) == len(stored_b) == 16
            assert stored_a != stored_b
            assert stored_a[:16].hex() not in repr(a) and stored_a[:16] not in repr(a).encode()
            # Another task releases it through the object alone.
            assert await asyncio.get_running_loop().create_task(a.unlock()) is True
            assert raio.side.get(lock_key("a")) is None
            assert await b.unlock()

    raio.run(main())


@pytest.mark.topologies("single", "cluster")
def test_with_lock_returns_the_result_and_releases_however_it_ends(aio: Aio) -> None:
    async def work(x: int, *, y: int) -> int:
        return x + y

    async def fail() -> None:
        raise KeyError("inner")

    async def main() -> None:
        async with await aio.connect() as cache:
            assert await cache.with_lock("job", 5, work, 1, y=2) == 3
            assert await hotlock.aio.with_lock(cache, "job", 5, work, 2, y=2) == 4
            with pytest.raises(KeyError, match="inner"):
                await cache.with_lock("job", 5, fail)
            await (await cache.lock("job", ttl=5)).unlock()

            started = asyncio.Event()

            async def forever() -> None:
                started.set()
                await asyncio.sleep(60)

            task = asyncio.get_running_loop().create_task(cache.with_lock("job", 5, forever))
            await started.wait()
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
            # Released on cancellation: free at once.
            await (await cache.lock("job", ttl=5)).unlock()

    aio.run(main())


@pytest.mark.topologies("single", "cluster")
def test_lock_many_extend_many_unlock_many(aio: Aio) -> None:
    async def main() -> None:
        async with await aio.connect() as cache, await aio.connect() as other:
            held = await cache.lock("b", ttl=5)
            locks = await cache.lock_many(["a", "b", b"c"], ttl=5)
            assert [lk is None for lk in locks] == [False, True, False]
            assert locks[0] is not None and locks[0].key == "a"
            assert locks[2] is not None and locks[2].key == b"c"
            assert await cache.lock_many([]) == []
            assert await cache.extend_many([*locks, held], 20) == [True, False, True, True]
            assert locks[0].valid_for() > 19
            assert await cache.unlock_many(locks) == [True, False, True]
            assert await cache.unlock_many(locks) == [False, False, False]
            assert await cache.extend_many(locks, 5) == [False, False, False]
            with pytest.raises(ValueError, match="another cache"):
                await other.unlock_many([held])
            assert await held.unlock()

    aio.run(main())


@pytest.mark.topologies("single", "cluster")
def test_set_nx_and_incr(aio: Aio) -> None:
    async def main() -> None:
        async with await aio.connect() as cache:
            assert await cache.set_nx("charged:1", "1", ttl=5) is True
            assert await cache.set_nx("charged:1", "1", ttl=5) is False
            assert await cache.incr("n") == 1
            assert await cache.incr("n", 41) == 42
            assert await cache.incr("n", -2) == 40
            if aio.backend != "memory":
                assert aio.side.get(b"hotlock:once:{charged:1}") == b"1"
                assert aio.side.get(b"hotlock:count:{n}") == b"40"

    aio.run(main())


@pytest.mark.topologies("single", "cluster")
def test_properties_and_prefix(aio: Aio) -> None:
    async def main() -> None:
        async with await aio.connect(prefix="app:") as cache:
            assert cache.backend == aio.backend
            assert cache.enabled is (aio.backend != "memory")
            assert cache.prefix == b"app:"
            lock = await cache.lock("job", ttl=5)
            if aio.backend != "memory":
                assert aio.side.exists(b"app:lock:{job}")
            assert await lock.unlock()

    aio.run(main())


def test_a_forked_child_never_uses_its_parents_lock(raio: Aio) -> None:
    async def main() -> None:
        async with await raio.connect() as cache:
            lock = await cache.lock("job", ttl=5)
            pid = os.fork()
            if pid == 0:  # the child: no loop of its own, so drive the coroutines by hand
                code = 0
                try:
                    unlock = lock.unlock()
                    try:
                        unlock.send(None)
                        code = 2  # it awaited I/O: it tried to send
                    except StopIteration as stop:
                        code = 0 if stop.value is False else 3
                    extend = lock.extend(5)
                    try:
                        extend.send(None)
                        code = 4
                    except hotlock.LockLost:
                        pass
                    if lock.valid_for() != 0.0:
                        code = 5
                finally:
                    os._exit(code)
            _, status = os.waitpid(pid, 0)
            assert os.waitstatus_to_exitcode(status) == 0
            # The parent's lock and connection are untouched.
            assert raio.side.get(lock_key("job")) is not None
            assert await lock.unlock() is True

    raio.run(main())


# -- bad input and connect ------------------------------------------------------------


def _commandstats(side: redis.Redis) -> dict[str, Any]:
    # Without INFO and CONFIG themselves: those are this test looking.
    stats = side.info("commandstats")
    return {k: v for k, v in stats.items() if k not in ("cmdstat_info", "cmdstat_config|resetstat")}


def test_bad_input_raises_before_any_io(raio: Aio) -> None:
    async def noop() -> None:
        return None

    async def main() -> None:
        async with await raio.connect() as cache:
            lock = await cache.lock("held", ttl=5)
            raio.side.config_resetstat()
            before = _commandstats(raio.side)
            bad: list[tuple[type[Exception], Callable[[], Awaitable[Any]]]] = [
                (TypeError, lambda: cache.lock(1)),  # type: ignore[arg-type]
                (ValueError, lambda: cache.lock("")),
                (ValueError, lambda: cache.lock("x" * 1025)),
                (ValueError, lambda: cache.lock("\ud800")),
                (ValueError, lambda: cache.lock("k", ttl=0)),
                (ValueError, lambda: cache.lock("k", ttl=-1)),
                (ValueError, lambda: cache.lock("k", ttl=float("nan"))),
                (ValueError, lambda: cache.lock("k", ttl=float("inf"))),
                (TypeError, lambda: cache.lock("k", ttl=True)),
                (ValueError, lambda: cache.lock("k", ttl=timedelta(days=8))),
                (ValueError, lambda: cache.lock_wait("k", ttl=5, wait=-1)),
                (TypeError, lambda: cache.lock_wait("k", ttl=5, wait="1")),  # type: ignore[arg-type]
                (TypeError, lambda: cache.lock_many("abc")),
                (TypeError, lambda: cache.lock_many([b"a", 2])),  # type: ignore[list-item]
                (ValueError, lambda: cache.lock_many(["a", "a"])),
                (ValueError, lambda: cache.lock_many(["a"], ttl=0)),
                (TypeError, lambda: cache.extend_many("x", 5)),  # type: ignore[arg-type]
                (TypeError, lambda: cache.unlock_many([lock, "x"])),  # type: ignore[list-item]
                (ValueError, lambda: cache.extend_many([lock], 0)),
                (TypeError, lambda: cache.set_nx("k", 1.5, 5)),  # type: ignore[arg-type]
                (ValueError, lambda: cache.set_nx("k", "v", 0)),
                (TypeError, lambda: cache.incr("k", True)),
                (ValueError, lambda: cache.incr("k", 2**63)),
                (TypeError, lambda: cache.with_lock("k", 5, "not callable")),  # type: ignore[arg-type]
                (ValueError, lambda: cache.with_lock("k", 0, noop)),
                (ValueError, lambda: lock.extend(0)),
            ]
            for error, call in bad:
                with pytest.raises(error):
                    await call()
            assert _commandstats(raio.side) == before, "a bad argument reached the server"
            assert await lock.unlock()

    raio.run(main())


def test_connect_checks_its_arguments_and_logs_like_sync(aio: Aio, caplog: pytest.LogCaptureFixture) -> None:
    async def main() -> None:
        cases: list[tuple[dict[str, Any], type[Exception]]] = [
            ({"timeout": 0}, ValueError),
            ({"connect_timeout": "2"}, TypeError),
            ({"timeout": True}, TypeError),
            ({"prefix": ""}, ValueError),
            ({"backend": "nope"}, ValueError),
        ]
        for kwargs, error in cases:
            with pytest.raises(error):
                await hotlock.aio.connect("redis://127.0.0.1:1/0", **kwargs)
        with pytest.raises(ValueError, match="needs a url"):
            await hotlock.aio.connect(None, backend="redis-py")
        with caplog.at_level(logging.INFO, logger="hotlock"):
            cache = await aio.connect()
        await cache.close()

    aio.run(main())
    if aio.backend == "memory":
        assert "no cache configured: locks exclude nothing outside this process" in caplog.text
    else:
        assert f"with the {aio.backend} backend" in caplog.text
        assert f"({aio.server.named}, " in caplog.text


def test_an_unreachable_server_is_a_cache_error_naming_it(raio: Aio) -> None:
    async def main() -> None:
        with pytest.raises(hotlock.CacheError) as info:
            await hotlock.aio.connect("redis://127.0.0.1:1/0", backend=raio.backend, connect_timeout=0.5)
        assert "redis://127.0.0.1:1/0" in str(info.value)

    raio.run(main())


def test_backend_info_says_which_async_backend_is_live() -> None:
    info = hotlock.aio.backend_info()
    assert info["backend"] == ("native" if native_aio()[0] is not None else "redis-py")
    assert (info["reason"] is None) is (info["backend"] == "native")
    assert info.keys() == hotlock.backend_info().keys()  # one shape, sync and async
    assert info["tls"] == info["backend"]  # the loop's transport does TLS on either
    if REQUIRE_NATIVE:
        assert info["backend"] == "native", info["reason"]


# -- faults ---------------------------------------------------------------------------


def test_noscript_after_script_flush_is_recovered(raio: Aio) -> None:
    async def main() -> None:
        async with await raio.connect() as cache:
            lock = await cache.lock("a", ttl=5)
            raio.side.script_flush()
            await lock.extend(10)
            raio.side.script_flush()
            assert await lock.unlock() is True
            raio.side.script_flush()
            locks = await cache.lock_many(["x", "y"], ttl=5)
            raio.side.script_flush()
            assert await cache.extend_many(locks, 5) == [True, True]
            raio.side.script_flush()
            assert await cache.unlock_many(locks) == [True, True]
            raio.side.script_flush()
            # Many tasks at once, all meeting NOSCRIPT on one connection.
            many = await asyncio.gather(*(cache.lock(f"k{i}", ttl=5) for i in range(200)))
            assert all(await asyncio.gather(*(lk.unlock() for lk in many)))

    raio.run(main())


def _kill_clients(side: redis.Redis) -> int:
    return int(side.execute_command("CLIENT", "KILL", "TYPE", "normal", "SKIPME", "yes"))  # type: ignore[no-untyped-call]


def test_reconnects_after_client_kill(raio: Aio) -> None:
    async def main() -> None:
        async with await raio.connect() as cache:
            lock = await cache.lock("a", ttl=5)
            assert _kill_clients(raio.side) >= 1
            await asyncio.sleep(0.05)  # the loop sees the close
            assert await lock.unlock() is True
            assert await cache.incr("n") == 1
            # Killed with no pause: an acquire whose reply is lost is retried with the same
            # token, so it still ends acquired.
            _kill_clients(raio.side)
            lock = await cache.lock("b", ttl=5)
            assert raio.side.get(lock_key("b")) is not None
            assert await lock.unlock() is True

    raio.run(main())


def test_a_silent_server_costs_one_reply_timeout_and_then_it_reconnects(raio: Aio) -> None:
    async def main(proxy: FaultProxy) -> None:
        loop = asyncio.get_running_loop()
        async with await hotlock.aio.connect(proxy.url, backend=raio.backend, timeout=0.2) as cache:
            await (await cache.lock("warm", ttl=5)).unlock()
            proxy.blackhole(True)
            start = loop.time()
            with pytest.raises(hotlock.CacheError, match="no reply within the timeout") as info:
                await cache.incr("n")
            # One reply timeout (0.2 s), not redis-py's default ten retries (2 s).
            assert loop.time() - start < 1.5
            assert "hotlock:count:{n}" in str(info.value) and cache.server in str(info.value)
            proxy.blackhole(False)
            assert await cache.incr("m") == 1

    with FaultProxy(raio.server.port) as proxy:
        raio.run(main(proxy))


def test_a_lost_acquire_reply_is_retried_with_the_same_token(raio: Aio) -> None:
    async def main(proxy: FaultProxy) -> None:
        async with await hotlock.aio.connect(proxy.url, backend=raio.backend, timeout=0.3) as cache:
            await (await cache.lock("warm", ttl=5)).unlock()
            proxy.drop_replies(1)  # the acquire runs on the server; its reply never arrives
            lock = await cache.lock("job", ttl=5)
            assert proxy.dropped_replies == 1
            # Acquired, not "held elsewhere" by our own first try, and the key holds our token.
            assert raio.side.get(lock_key("job")) == lock._token
            proxy.drop_replies(1)  # a lost release reply is retried too, and never raises
            assert await lock.unlock() in (True, False)
            assert raio.side.get(lock_key("job")) is None

    with FaultProxy(raio.server.port) as proxy:
        raio.run(main(proxy))


def test_wait_replicas_undoes_an_acquire_too_few_replicas_confirmed(raio: Aio) -> None:
    async def main() -> None:
        # The session's server has no replica: WAIT 1 confirms nothing.
        async with await raio.connect(wait_replicas=1, wait_timeout=0.05) as cache:
            with pytest.raises(hotlock.CacheError, match="0 of 1 replicas confirmed") as info:
                await cache.lock("job", ttl=5)
            assert "hotlock:lock:{job}" in str(info.value)
            with pytest.raises(hotlock.CacheError, match="replicas"):
                await cache.lock_many(["a", "b"], ttl=5)
        # Undone: none of them is held.
        assert not raio.side.exists(lock_key("job"), lock_key("a"), lock_key("b"))

    raio.run(main())


def test_auth_and_select_from_the_url(raio: Aio) -> None:
    raio.side.acl_setuser("hotlock-aio", enabled=True, passwords=["+s3cret"], keys=["*"], commands=["+@all"])
    host, port = raio.server.host, raio.server.port

    async def main() -> None:
        url = f"redis://hotlock-aio:s3cret@{host}:{port}/3"
        async with await hotlock.aio.connect(url, backend=raio.backend) as cache:
            lock = await cache.lock("job", ttl=5)
            db3 = redis.Redis(host=host, port=port, db=3)
            assert db3.get(lock_key("job")) == lock._token  # SELECTed db 3, as that user
            assert not raio.side.exists(lock_key("job"))
            db3.close()
            assert await lock.unlock()
        with pytest.raises(hotlock.CacheError) as info:
            await hotlock.aio.connect(f"redis://hotlock-aio:wrong@{host}:{port}/3", backend=raio.backend)
        assert "wrong" not in str(info.value)  # the password never shows

    try:
        raio.run(main())
    finally:
        raio.side.acl_deluser("hotlock-aio")


def test_unix_socket_url(raio: Aio, tmp_path: Any) -> None:
    path = str(tmp_path / "redis.sock")
    server = start_redis("--unixsocket", path, "--unixsocketperm", "700", kind=raio.server.kind)

    async def main() -> None:
        async with await hotlock.aio.connect(f"unix://{path}?db=2", backend=raio.backend) as cache:
            lock = await cache.lock("job", ttl=5)
            with redis.Redis(unix_socket_path=path, db=2) as admin:
                assert admin.get(lock_key("job")) == lock._token
            assert await lock.unlock()

    try:
        raio.run(main())
    finally:
        server.stop()


def test_readonly_is_a_cache_error_that_drops_the_connection(raio: Aio) -> None:
    replica = start_redis("--replicaof", raio.server.host, str(raio.server.port), kind=raio.server.kind)

    async def main() -> None:
        side = replica.client()

        def ours() -> set[str]:
            return {c["id"] for c in side.client_list()} - {str(side.client_id())}

        async with await hotlock.aio.connect(replica.url, backend=raio.backend) as cache:
            before = ours()
            assert before
            with pytest.raises(hotlock.CacheError, match="READONLY") as info:
                await cache.lock("job", ttl=5)
            assert "hotlock:lock:{job}" in str(info.value)
            await asyncio.sleep(0.05)  # the server notices the close
            # A demoted primary is not used again: the connection that met READONLY is
            # gone (the release of the failed acquire may have opened a new one).
            assert not before & ours()

    try:
        raio.run(main())
    finally:
        replica.stop()


def test_sentinel_url_finds_the_primary(raio: Aio, tmp_path: Any) -> None:
    """A one-sentinel topology over the session's server: enough to see the async backends
    ask the sentinel for the primary (failover itself is tests/test_sentinel.py's)."""
    port = free_port()
    conf = tmp_path / "sentinel.conf"
    conf.write_text(
        f"port {port}\nbind 127.0.0.1\ndir {tmp_path}\n"
        f"sentinel monitor aiomaster {raio.server.host} {raio.server.port} 1\n"
    )
    # The server's own sentinel: redis-sentinel over Redis, valkey-server --sentinel over Valkey.
    exe = server_exe(raio.server.kind, sentinel=True)
    proc = subprocess.Popen([exe[0], str(conf), *exe[1:]], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)

    async def main() -> None:
        deadline = time.monotonic() + 10
        while True:  # until the sentinel answers
            try:
                cache = await hotlock.aio.connect(f"redis+sentinel://127.0.0.1:{port}/aiomaster", backend=raio.backend)
                break
            except hotlock.CacheError:
                if time.monotonic() > deadline:
                    raise
                await asyncio.sleep(0.05)
        async with cache:
            lock = await cache.lock("job", ttl=5)
            assert stored(raio, "job") == lock._token  # it landed on the primary
            assert await lock.unlock()
        with pytest.raises(hotlock.CacheError, match="nosuch"):
            await hotlock.aio.connect(f"redis+sentinel://127.0.0.1:{port}/nosuch", backend=raio.backend)

    try:
        raio.run(main())
    finally:
        proc.terminate()
        proc.wait(5)


# -- cancellation ---------------------------------------------------------------------


@pytest.mark.topologies("single", "cluster")
def test_cancelling_unlock_still_releases(aio: Aio) -> None:
    async def main() -> int:
        interrupted = 0
        async with await aio.connect() as cache:
            for i in range(30):
                lock = await cache.lock(f"k{i}", ttl=30)
                task = asyncio.get_running_loop().create_task(lock.unlock())
                for _ in range(1 + i % 6):  # cancel at a different step of the release each time
                    await asyncio.sleep(0)
                task.cancel()
                try:
                    assert await task is True
                except asyncio.CancelledError:
                    interrupted += 1
                assert lock.valid_for() == 0.0
        # close() let the background releases land: every key is free.
        async with await aio.connect() as cache:
            assert all(lk is not None for lk in await cache.lock_many([f"k{i}" for i in range(30)], ttl=5))
        return interrupted

    interrupted = aio.run(main())
    if aio.backend != "memory":  # its release has no await inside: nothing to interrupt
        assert interrupted > 0, "no cancellation landed inside unlock(): the test tests nothing"


@pytest.mark.topologies("single", "cluster")
def test_a_thousand_random_cancellations_strand_no_token(aio: Aio) -> None:
    """1000 tasks each take a lock of its own (by lock, lock_wait, with_lock or lock_many,
    some releasing it again), each cancelled at a random moment. Afterwards no key may hold
    a token whose acquisition was cancelled."""
    rng = random.Random(4)

    async def main() -> None:
        # A generous reply timeout: on a loaded CI machine a 2 s one can run out, and a
        # release that times out leaves its key to the TTL by design, not by a bug.
        cache = await aio.connect(timeout=15)
        loop = asyncio.get_running_loop()
        kept: dict[str, hotlock.aio.AsyncLock] = {}
        cancelled = 0

        async def body() -> None:
            await asyncio.sleep(rng.uniform(0, 0.002))

        async def attempt(i: int) -> None:
            key, kind = f"c{i}", i % 5
            if kind == 0:
                kept[key] = await cache.lock(key, ttl=30)
            elif kind == 1:
                await (await cache.lock(key, ttl=30)).unlock()
            elif kind == 2:
                await cache.with_lock(key, 30, body)
            elif kind == 3:
                kept[key] = await cache.lock_wait(key, ttl=30, wait=5)
            else:
                (lock,) = await cache.lock_many([key], ttl=30)
                assert lock is not None
                kept[key] = lock

        # A timing pass measures one round trip, so the cancel points spread over before
        # the send, in flight, and after the reply on every backend and loop. Warmed first
        # (a cluster connects to each primary at its first key there), and the median of
        # five: one slow probe on a loaded machine would spread the cancels so wide that
        # most land after their task has ended.
        warm = [f"warm{i}" for i in range(32)]
        await cache.unlock_many([lock for lock in await cache.lock_many(warm, ttl=5) if lock is not None])
        probes = []
        for _ in range(5):
            start = loop.time()
            await (await cache.lock("probe", ttl=5)).unlock()
            probes.append(loop.time() - start)
        span = max(statistics.median(probes), 0.0005) * 3
        for wave in range(10):
            tasks = []
            for i in range(wave * 100, wave * 100 + 100):
                task = loop.create_task(attempt(i))
                tasks.append(task)
                if rng.random() < 0.1:
                    task.cancel()  # before it ever ran
                else:
                    loop.call_later(rng.uniform(0, span), task.cancel)
            for outcome in await asyncio.gather(*tasks, return_exceptions=True):
                if isinstance(outcome, asyncio.CancelledError):
                    cancelled += 1
                elif outcome is not None:
                    raise outcome
        await cache.close()  # lets the background releases land
        # The in-process backend has no await inside an operation, so fewer cancels land.
        assert cancelled > (150 if aio.backend == "memory" else 300), "the cancellations mostly missed"

        # Every key not held by a surviving lock object is free; the held ones hold their token.
        async with await aio.connect() as check:
            free = [f"c{i}" for i in range(1000) if f"c{i}" not in kept]
            taken = await check.lock_many(free, ttl=5)
            stranded = [k for k, lk in zip(free, taken, strict=True) if lk is None]
            assert not stranded, f"{len(stranded)} keys hold a cancelled acquisition's token: {stranded[:5]}"
            if aio.backend != "memory":
                for key, lock in kept.items():
                    assert aio.side.get(lock_key(key)) == lock._token

    aio.run(main())


def test_a_cancelled_wait_ends_at_once_as_cancelled_error(aio: Aio) -> None:
    """Rounds of 200 tasks in lock_wait (wait 10 s) on 20 held keys, after other traffic:
    the holders release at random moments within 50 ms and every waiter is cancelled at a
    random moment within 80 ms. A cancelled waiter ends with CancelledError, at once (not
    at its 10 s deadline, as a cancellation dropped in the loop turn of a wake-up made it),
    and no key is left behind.

    "At once" is bounded at 1 s: a few ms is typical, but on redis-py each cancelled call
    drops its connection, and 200 reconnects on one loop under make test's load have kept
    a loop turn busy for 160 ms."""
    rng = random.Random(20)

    async def main() -> None:
        cache = await aio.connect(timeout=15)
        loop = asyncio.get_running_loop()

        # Other traffic first: waits that subscribe, release and wake, so that the wake-up
        # channels and the connections are warm when the cancellations start.
        async def wait(key: str, ttl: float, wait: float) -> hotlock.aio.AsyncLock:
            return await cache.lock_wait(key, ttl=ttl, wait=wait)

        warm = [await cache.lock(f"w{i}", ttl=5) for i in range(5)]
        waits = [loop.create_task(wait(f"w{i}", 5, 5)) for i in range(5)]
        await asyncio.sleep(0.05)
        for lock in warm:
            await lock.unlock()
        for lock in await asyncio.gather(*waits):
            await lock.unlock()

        late: list[tuple[str, float]] = []
        wrong: list[BaseException | object] = []
        cancelled_at: dict[asyncio.Task[hotlock.aio.AsyncLock], float] = {}
        ended_at: dict[asyncio.Task[hotlock.aio.AsyncLock], float] = {}

        def cancel(task: asyncio.Task[hotlock.aio.AsyncLock]) -> None:
            if not task.done():
                cancelled_at[task] = loop.time()
                task.cancel()

        def ended(task: asyncio.Task[hotlock.aio.AsyncLock]) -> None:
            ended_at[task] = loop.time()

        for round_ in range(8):
            keys = [f"r{round_}k{i}" for i in range(20)]
            holders = [await cache.lock(key, ttl=30) for key in keys]

            tasks = []
            for i in range(200):
                task = loop.create_task(wait(keys[i % 20], 30, 10))
                task.add_done_callback(ended)
                loop.call_later(rng.uniform(0, 0.08), cancel, task)
                tasks.append(task)
            for lock in holders:
                loop.call_later(rng.uniform(0, 0.05), lambda lk=lock: loop.create_task(lk.unlock()))
            outcomes = await asyncio.gather(*tasks, return_exceptions=True)
            for task, outcome in zip(tasks, outcomes, strict=True):
                if isinstance(outcome, hotlock.aio.AsyncLock):
                    await outcome.unlock()  # acquired before its cancel came
                elif not isinstance(outcome, asyncio.CancelledError):
                    wrong.append(outcome)
                elif ended_at[task] - cancelled_at[task] > 1.0:
                    late.append((task.get_name(), ended_at[task] - cancelled_at[task]))
        await cache.close()  # lets the background releases land
        assert not wrong, f"{len(wrong)} cancelled waits ended otherwise, the first: {wrong[0]!r}"
        assert not late, f"{len(late)} cancelled waits ended late, the latest after {max(t for _, t in late):.3f} s"
        async with await aio.connect() as check:
            taken = await check.lock_many([f"r{r}k{i}" for r in range(8) for i in range(20)], ttl=5)
            assert all(lock is not None for lock in taken), "a cancelled wait left its key behind"

    aio.run(main())


# -- many tasks, one connection -------------------------------------------------------


@pytest.mark.parametrize("raio", ["native"], indirect=True)  # the write coalescing is the native protocol's
def test_native_commands_of_one_loop_iteration_leave_in_one_write(raio: Aio) -> None:

    async def main() -> None:
        async with await raio.connect() as cache:
            proto: Any = cache._backend._proto  # type: ignore[attr-defined]
            before = proto.writes
            # 100 tasks, each sending an acquire in the same loop iteration: one write.
            locks = await asyncio.gather(*(cache.lock(f"k{i}", ttl=5) for i in range(100)))
            assert proto.writes == before + 1
            assert all(await asyncio.gather(*(lk.unlock() for lk in locks)))
            assert proto.writes == before + 2

    raio.run(main())


@pytest.mark.topologies("single", "cluster")
def test_concurrent_tasks_each_get_their_own_reply(aio: Aio) -> None:
    n = 10_000 if aio.backend != "redis-py" else 1_000  # redis.asyncio queues on its pool

    async def main() -> None:
        # What it proves is each reply's owner, not speed: 10,000 replies queued on one
        # connection can outlast the default 2 s reply timeout on a loaded machine.
        async with await aio.connect(timeout=30) as cache:
            clients_before = int(aio.side.info("clients")["connected_clients"])

            async def one(i: int) -> None:
                # Distinct keys and amounts: a reply handed to the wrong task shows up as a
                # wrong count or a foreign token.
                assert await cache.incr(f"n{i}", i + 1) == i + 1
                lock = await cache.lock(f"k{i}", ttl=30)
                if i % 97 == 0 and aio.backend != "memory":
                    assert aio.side.get(lock_key(f"k{i}")) == lock._token
                assert await lock.unlock() is True

            await asyncio.gather(*(one(i) for i in range(n)))
            if aio.backend == "native":
                # All of it went through the one connection opened at connect.
                assert int(aio.side.info("clients")["connected_clients"]) == clients_before

    aio.run(main())


# -- fencing (the sync tests are in test_fencing.py) ---------------------------------------


def _server_us(server: RedisServer) -> int:
    seconds, micros = server.client().time()
    return int(seconds) * 1_000_000 + int(micros)


def _increasing(fences: list[int]) -> bool:
    return all(a < b for a, b in itertools.pairwise(fences))


@pytest.mark.topologies("single", "cluster")
def test_async_fence_on_lock_lock_wait_and_lock_many(aio: Aio) -> None:
    async def main() -> None:
        async with await aio.connect() as cache:
            fences = []
            for _ in range(300):
                async with cache.lock("hot", ttl=5) as lock:
                    fences.append(lock.fence)
                async with cache.lock_wait("hot", ttl=5, wait=1) as lock:
                    fences.append(lock.fence)
                many = await cache.lock_many(["hot", "other"], ttl=5)
                assert many[0] is not None and many[1] is not None
                fences.append(many[0].fence)
                await many[0].extend(5)
                assert many[0].fence == fences[-1]
                assert await cache.unlock_many(many) == [True, True]
            assert _increasing(fences)
            assert all(type(f) is int for f in fences)

    aio.run(main())


def test_async_fence_increases_across_an_expiry_and_flushall(raio: Aio) -> None:
    async def main() -> None:
        async with await raio.connect() as cache:
            first = await cache.lock("e", ttl=0.05)
            await asyncio.sleep(0.1)
            second = await cache.lock("e", ttl=30)
            raio.side.flushall()
            third = await cache.lock("e", ttl=30)
            assert first.fence < second.fence < third.fence

    raio.run(main())


def test_async_lost_acquire_reply_retried_holds_the_lock_with_the_retrys_fence(raio: Aio) -> None:
    async def main(proxy: FaultProxy) -> None:
        cache = await hotlock.aio.connect(proxy.url, backend=raio.backend, timeout=0.5, connect_timeout=0.5)
        try:
            before = _server_us(raio.server)
            proxy.drop_replies(1)
            lock = await cache.lock("lost", ttl=10)
            assert proxy.dropped_replies == 1
            assert raio.side.get(lock_name(b"lost")) == lock._token
            # The retry's fence, sent after one reply timeout (0.5 s): later than the lost one's.
            assert lock.fence >= before + 250_000
            assert await lock.unlock() is True
        finally:
            await cache.close()

    with FaultProxy(raio.server.port) as proxy:
        raio.run(main(proxy))


def test_async_uncontended_acquire_is_one_round_trip(raio: Aio) -> None:
    def calls() -> dict[str, int]:
        return {k: int(v["calls"]) for k, v in raio.side.info("commandstats").items()}

    async def main() -> None:
        async with await raio.connect() as cache:
            await (await cache.lock("warm", ttl=5)).unlock()  # connected, scripts loaded
            before = calls()
            lock = await cache.lock("one-trip", ttl=5)
            after = calls()
            ran = {k: after[k] - before.get(k, 0) for k in after if after[k] != before.get(k, 0)}
            # One transaction from the client (MULTI, SET, TIME, EXEC: hotlock._acquire),
            # or one EVALSHA (a backend that takes a free key by script), inside which GET,
            # SET and TIME ran; and the INFO that read `before`.
            by_script = {"cmdstat_evalsha": 1, "cmdstat_get": 1}
            by_transaction = {"cmdstat_multi": 1, "cmdstat_exec": 1}
            assert ran == {
                "cmdstat_info": 1,
                "cmdstat_set": 1,
                "cmdstat_time": 1,
                **(by_transaction if "cmdstat_exec" in ran else by_script),
            }
            assert lock.fence > 0
            await lock.unlock()

    raio.run(main())
