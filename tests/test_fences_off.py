"""connect(fences=False): every lock's fence is 0, and a free key is taken by SET NX PX
alone (no MULTI, no TIME, no script), on each backend, sync and async, on Redis and on
Valkey; everything else a lock does (exclusion, extend, release, lock_many, permits,
lock_wait and its wake-ups, a lost reply resent with the same token) as with fences on.

What the server ran is read from its INFO commandstats."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest

import hotlock
import hotlock.aio
from hotlock.errors import LockNotAcquired

from .conftest import RedisServer, free_port, lock_name
from .faultproxy import FaultProxy

COUNTED = ("set", "multi", "exec", "time", "evalsha")


class Api:
    """One cache, sync or async, driven from sync test code."""

    def __init__(self, mode: str, url: str | None, **kwargs: Any) -> None:
        self.loop = asyncio.new_event_loop() if mode == "async" else None
        try:
            if self.loop is None:
                self.cache: Any = hotlock.connect(url, **kwargs)
            else:
                self.cache = self.run(hotlock.aio.connect(url, **kwargs))
        except BaseException:
            # A connect refused (a bad argument, say) leaves no loop behind to be found
            # unclosed by the garbage collector in another test.
            if self.loop is not None:
                self.loop.close()
            raise

    def run(self, value: Any) -> Any:
        return value if self.loop is None else self.loop.run_until_complete(value)

    def lock(self, key: str, ttl: float = 10, **kwargs: Any) -> Any:
        return self.run(self.cache.lock(key, ttl, **kwargs))

    def lock_wait(self, key: str, ttl: float = 10, wait: float = 10) -> Any:
        return self.run(self.cache.lock_wait(key, ttl, wait))

    def lock_many(self, keys: list[str], ttl: float = 10) -> Any:
        return self.run(self.cache.lock_many(keys, ttl))

    def extend(self, lock: Any, ttl: float) -> None:
        self.run(lock.extend(ttl))

    def unlock(self, lock: Any) -> bool:
        return bool(self.run(lock.unlock()))

    def close(self) -> None:
        self.run(self.cache.close())
        if self.loop is not None:
            self.loop.close()


@pytest.fixture(params=["sync", "async"])
def mode(request: pytest.FixtureRequest) -> str:
    return str(request.param)


@pytest.fixture
def which(redis_backend: str) -> str:
    """native and redis-py (conftest's: a run that requires the extension fails without it)."""
    return redis_backend


@pytest.fixture
def opened(mode: str, which: str) -> Iterator[Callable[..., Api]]:
    made: list[Api] = []

    def open_(url: str, **kwargs: Any) -> Api:
        made.append(Api(mode, url, backend=which, **kwargs))
        assert made[-1].cache.backend == which
        return made[-1]

    yield open_
    for each in made:
        each.close()


def calls(server: RedisServer) -> dict[str, int]:
    stats = server.client().info("commandstats")
    return {c: int(stats.get(f"cmdstat_{c}", {}).get("calls", 0)) for c in COUNTED}


def sent(server: RedisServer, action: Callable[[], Any]) -> tuple[Any, dict[str, int]]:
    before = calls(server)
    result = action()
    after = calls(server)
    return result, {c: after[c] - before[c] for c in COUNTED}


def test_a_lock_has_fence_zero_and_excludes_as_ever(opened: Callable[..., Api], redis_url: str) -> None:
    cache = opened(redis_url, fences=False)
    info = cache.cache.server_info
    assert info["fences"] is False and info["acquire"] == "SET NX"
    lock = cache.lock("one")
    assert lock.fence == 0
    with pytest.raises(LockNotAcquired) as refused:
        cache.lock("one")
    assert refused.value.retry_after is not None and 9 < refused.value.retry_after <= 10
    cache.extend(lock, 20)
    assert 19 < lock.valid_for() <= 20
    assert cache.unlock(lock) is True
    assert cache.unlock(lock) is False  # idempotent: the key is gone
    again = cache.lock("one")
    assert again.fence == 0
    assert cache.unlock(again) is True
    locks = cache.lock_many(["m1", "m2", "m3"])
    assert all(locks) and [lk.fence for lk in locks] == [0, 0, 0]
    permits = [cache.lock("p", limit=2), cache.lock("p", limit=2)]
    assert [p.fence for p in permits] == [0, 0]
    with pytest.raises(LockNotAcquired):
        cache.lock("p", limit=2)
    assert all(cache.unlock(p) for p in [*locks, *permits])
    waited = cache.lock_wait("w", wait=1)
    assert waited.fence == 0 and cache.unlock(waited)


def test_fences_on_is_the_default(opened: Callable[..., Api], redis_url: str) -> None:
    cache = opened(redis_url)
    assert cache.cache.server_info["fences"] is True
    assert cache.cache.server_info["acquire"] == "SET NX in MULTI"
    lock = cache.lock("fenced")
    assert lock.fence > 1_000_000_000_000_000  # the server's clock in microseconds
    assert cache.unlock(lock)


def test_a_free_key_costs_one_set_and_no_script(
    opened: Callable[..., Api], which: str, redis_url: str, redis_server: RedisServer
) -> None:
    cache = opened(redis_url, fences=False)
    cache.lock("warm")  # connected
    lock, counts = sent(redis_server, lambda: cache.lock("free"))
    assert counts == {"set": 1, "multi": 0, "exec": 0, "time": 0, "evalsha": 0}
    assert redis_server.client().get(lock_name(b"free")) == lock._token and len(lock._token) == 16
    assert 9_000 < redis_server.client().pttl(lock_name(b"free")) <= 10_000
    locks, counts = sent(redis_server, lambda: cache.lock_many(["b1", "b2", "b3"]))
    # The redis-py backend ends a pipeline with a TIME that frames its replies (one per
    # write, not per key).
    framed = 1 if which == "redis-py" else 0
    assert all(locks) and counts == {"set": 3, "multi": 0, "exec": 0, "time": framed, "evalsha": 0}
    # A held key: the SET finds it (nil), the script says for how long.
    before = calls(redis_server)
    with pytest.raises(LockNotAcquired):
        cache.lock("free")
    after = calls(redis_server)
    assert (after["set"] - before["set"], after["evalsha"] - before["evalsha"], after["multi"] - before["multi"]) == (
        1,
        1,
        0,
    )


def test_a_lost_reply_is_resent_with_the_same_token(
    opened: Callable[..., Api], redis_url: str, redis_server: RedisServer
) -> None:
    with FaultProxy(redis_server.port) as proxy:
        cache = opened(proxy.url, timeout=0.5, connect_timeout=0.5, fences=False)
        cache.lock("warm")  # connected, scripts loaded
        proxy.drop_replies(1)
        lock, counts = sent(redis_server, lambda: cache.lock("lost"))
        assert proxy.dropped_replies == 1
        # The first SET took the key; the resent one found it (nil) and the script found
        # its own token there: one lock, held by this caller.
        assert counts["set"] == 2 and counts["evalsha"] == 1
        assert lock.fence == 0
        assert redis_server.client().get(lock_name(b"lost")) == lock._token
        assert cache.unlock(lock) is True
        assert redis_server.client().get(lock_name(b"lost")) is None


def test_a_release_wakes_a_waiter(mode: str, which: str, redis_url: str) -> None:
    holder = Api("sync", redis_url, backend=which, fences=False)
    waiter = Api(mode, redis_url, backend=which, fences=False)
    try:
        held = holder.lock("wake", ttl=30)
        timer = threading.Timer(0.3, holder.unlock, [held])
        timer.start()
        started = time.monotonic()
        got = waiter.lock_wait("wake", ttl=10, wait=20)
        waited = time.monotonic() - started
        timer.join()
        assert got.fence == 0
        # Woken by the release, not by the 30 s TTL running out (nor by the wait's end).
        assert waited < 15
        assert waiter.unlock(got)
    finally:
        waiter.close()
        holder.close()


def test_a_cluster_lock_has_fence_zero(mode: str, cluster_url: str) -> None:
    cache = Api(mode, cluster_url, fences=False)
    try:
        info = cache.cache.server_info
        # A cluster's router sends the transaction still; the fence is 0 all the same.
        assert info["fences"] is False and info["acquire"] == "SET NX in MULTI"
        lock = cache.lock("c")
        assert lock.fence == 0
        with pytest.raises(LockNotAcquired):
            cache.lock("c")
        locks = cache.lock_many(["c1", "c2", "c3"])
        assert [lk.fence for lk in locks] == [0, 0, 0]
        assert all(cache.unlock(lk) for lk in [lock, *locks])
    finally:
        cache.close()


@pytest.mark.parametrize("mode_", ["sync", "async"])
def test_the_in_process_fallback_and_a_lazy_cache_keep_the_choice(
    mode_: str, redis_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("CACHE_URL", raising=False)
    for url, kwargs in [(None, {}), (redis_url, {"lazy": True})]:
        cache = Api(mode_, url, fences=False, **kwargs)
        try:
            lock = cache.lock("fallback")
            assert lock.fence == 0
            assert cache.cache.server_info["fences"] is False
            assert cache.unlock(lock)
        finally:
            cache.close()


@pytest.mark.parametrize("mode_", ["sync", "async"])
@pytest.mark.parametrize("bad", ["no", 0, None])
def test_fences_must_be_a_bool_before_any_io(mode_: str, bad: object) -> None:
    # A port nothing listens on: a check that came after a connect would raise CacheError.
    url = f"redis://127.0.0.1:{free_port()}/0"
    with pytest.raises(TypeError, match="fences must be a bool"):
        Api(mode_, url, fences=bad)
