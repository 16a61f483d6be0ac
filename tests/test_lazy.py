"""What the framework integrations stand on: connect(lazy=True), LockNotAcquired.retry_after
and several metrics listeners at once."""

from __future__ import annotations

import asyncio
import logging
import socket
import subprocess
import time

import pytest
import redis
import uvloop

import hotlock
import hotlock.aio
from hotlock.metrics import BaseListener, Listeners

from .conftest import free_port, open_cache, server_exe


def _clients(url: str) -> int:
    """The connections the server has now, this probe's own included."""
    with redis.Redis.from_url(url) as probe:
        return int(probe.info("clients")["connected_clients"])


@pytest.mark.parametrize("backend", ["native", "redis-py"])
def test_lazy_connect_sends_nothing_until_the_first_call(redis_url: str, backend: str) -> None:
    before = _clients(redis_url)
    cache = hotlock.connect(redis_url, backend=backend, lazy=True)
    try:
        assert _clients(redis_url) == before  # nothing opened at connect
        assert cache.backend == backend
        assert cache.server_info["reason"] == "not detected"
        with cache.lock("lazy:a", ttl=5) as lock:
            assert lock.fence > 0
        assert cache.server_info["reason"] != "not detected"  # the dialect was detected then
        with pytest.raises(hotlock.LockNotAcquired), cache.lock("lazy:b", ttl=5), cache.lock("lazy:b", ttl=5):
            pass
    finally:
        cache.close()


def test_lazy_connect_to_a_server_that_comes_up_later() -> None:
    port = free_port()
    cache = hotlock.connect(f"redis://127.0.0.1:{port}/0", lazy=True, connect_timeout=0.5, timeout=0.5)
    server = None
    try:
        # Down: the call, not connect(), raises, and as a CacheError (never LockNotAcquired).
        with pytest.raises(hotlock.CacheError):
            cache.lock("lazy:down")
        server = subprocess.Popen(
            [*server_exe("redis"), "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        deadline = time.monotonic() + 10
        while True:
            try:
                with cache.lock("lazy:down", ttl=5) as lock:  # a later call connects
                    assert lock.fence > 0
                break
            except hotlock.CacheError:
                assert time.monotonic() < deadline, "the server never came up"
                time.sleep(0.05)
    finally:
        cache.close()
        if server is not None:
            server.terminate()
            server.wait(10)


def test_lazy_rejects_bad_arguments_before_any_io() -> None:
    with pytest.raises(TypeError, match="lazy must be a bool"):
        hotlock.connect("redis://127.0.0.1:1/0", lazy=1)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="timeout"):
        hotlock.connect("redis://127.0.0.1:1/0", lazy=True, timeout=-1)


@pytest.mark.parametrize("loop", ["asyncio", "uvloop"])
@pytest.mark.parametrize("backend", ["native", "redis-py"])
def test_async_lazy_connect(redis_url: str, backend: str, loop: str) -> None:
    before = _clients(redis_url)

    async def main() -> None:
        cache = await hotlock.aio.connect(redis_url, backend=backend, lazy=True)
        try:
            assert _clients(redis_url) == before
            # Callers that arrive together share one connect.
            locks = await asyncio.gather(*(cache.lock(f"lazy:{i}", ttl=5) for i in range(5)))
            assert all(lk.fence > 0 for lk in locks)
            with pytest.raises(hotlock.LockNotAcquired) as held:
                await cache.lock("lazy:0", ttl=5)
            assert held.value.retry_after is not None and 0 < held.value.retry_after <= 5
            for lk in locks:
                assert await lk.unlock()
        finally:
            await cache.close()

    (uvloop.run if loop == "uvloop" else asyncio.run)(main())


def test_async_lazy_connect_down_is_a_cache_error() -> None:
    async def main() -> None:
        cache = await hotlock.aio.connect(
            f"redis://127.0.0.1:{free_port()}/0", lazy=True, connect_timeout=0.5, timeout=0.5
        )
        try:
            with pytest.raises(hotlock.CacheError):
                await cache.lock("lazy:down")
            with pytest.raises(hotlock.CacheError):  # tried again, not a stored failure
                await cache.set_nx("lazy:down", "1", 5)
        finally:
            await cache.close()

    asyncio.run(main())


# -- LockNotAcquired.retry_after -------------------------------------------------------


def test_retry_after_is_the_holders_remaining_ttl(cache: hotlock.Cache) -> None:
    with cache.lock("ra:1", ttl=20):
        with pytest.raises(hotlock.LockNotAcquired) as try_once:
            cache.lock("ra:1", ttl=5)
        with pytest.raises(hotlock.LockNotAcquired) as waited:
            cache.lock_wait("ra:1", ttl=5, wait=0.05)
    for error in (try_once.value, waited.value):
        assert error.retry_after is not None
        assert 15 < error.retry_after <= 20


def test_retry_after_with_a_limit(cache: hotlock.Cache) -> None:
    first = cache.lock("ra:n", ttl=10, limit=2)
    second = cache.lock("ra:n", ttl=20, limit=2)
    with pytest.raises(hotlock.LockNotAcquired) as full:
        cache.lock("ra:n", ttl=5, limit=2)
    # The first place to free is the shorter permit's.
    assert full.value.retry_after is not None and 5 < full.value.retry_after <= 10
    # Held as the other kind: no TTL to tell.
    with pytest.raises(hotlock.LockNotAcquired) as other_kind:
        cache.lock("ra:n", ttl=5)
    assert other_kind.value.retry_after is None
    first.unlock()
    second.unlock()


# -- several listeners -------------------------------------------------------------------


class Recorder(BaseListener):
    def __init__(self) -> None:
        self.events: list[tuple[str, object]] = []

    def acquired(self, key: str | bytes, wait_s: float, attempts: int | None) -> None:
        self.events.append(("acquired", key))

    def released(self, key: str | bytes, held_s: float) -> None:
        self.events.append(("released", key))

    def not_acquired(self, key: str | bytes, outcome: str, wait_s: float) -> None:  # type: ignore[override]
        self.events.append(("not_acquired", key))


class Broken(BaseListener):
    def acquired(self, key: str | bytes, wait_s: float, attempts: int | None) -> None:
        raise RuntimeError("exporter down")


def test_several_listeners_each_hear_every_event(
    backend: str, server_url: str, caplog: pytest.LogCaptureFixture
) -> None:
    first, second = Recorder(), Recorder()
    cache = open_cache(backend, server_url, metrics=[first, Broken(), second])
    try:
        with caplog.at_level(logging.WARNING, logger="hotlock"):
            for _ in range(2):
                with cache.lock("many:a", ttl=5), pytest.raises(hotlock.LockNotAcquired):
                    cache.lock("many:a", ttl=5)
        expected = [("acquired", "many:a"), ("not_acquired", "many:a"), ("released", "many:a")] * 2
        assert first.events == expected
        assert second.events == expected  # the broken one in between silenced nothing
        assert sum("raised; its events are dropped" in r.getMessage() for r in caplog.records) == 1
    finally:
        cache.close()


def test_listeners_are_checked_before_any_io() -> None:
    with pytest.raises(TypeError, match=r"metrics\[1\] must be a hotlock.metrics.Listener"):
        hotlock.connect("redis://127.0.0.1:1/0", metrics=[Recorder(), object()])  # type: ignore[list-item]
    both = Listeners(Recorder(), Recorder())
    assert len(both.listeners) == 2


def test_async_lazy_connect_survives_a_cancelled_caller() -> None:
    # A server that accepts and never answers: the connect's INFO waits out its timeout.
    with socket.socket() as mute:
        mute.bind(("127.0.0.1", 0))
        mute.listen(8)
        url = f"redis://127.0.0.1:{mute.getsockname()[1]}/0"

        async def main() -> None:
            cache = await hotlock.aio.connect(url, lazy=True, timeout=0.3, connect_timeout=0.3)
            try:
                first = asyncio.ensure_future(cache.lock("lazy:mute"))
                await asyncio.sleep(0.05)
                first.cancel()
                with pytest.raises(asyncio.CancelledError):
                    await first
                # The connect the cancelled caller started goes on; this call awaits it.
                started = time.monotonic()
                with pytest.raises(hotlock.CacheError):
                    await cache.lock("lazy:mute")
                assert time.monotonic() - started < 3.0
            finally:
                await cache.close()

        asyncio.run(main())
