"""The native backends' transaction acquire (hotlock._acquire) against a real server: a
free key is taken by MULTI, SET NX PX, TIME, EXEC with no script run; every other case
(a held key, a lost reply resent, permits, a server that refuses MULTI) ends in the
ACQUIRE script, with the same results as before. Sync and async native alike."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Iterator
from typing import Any

import pytest

import hotlock
import hotlock.aio
from hotlock._scripts import ACQUIRE
from hotlock.errors import CacheError, HotlockError, LockNotAcquired

from .conftest import RedisServer, lock_name, native_for_module, start_redis
from .fakeserver import FakeRedis, bulk, fence_of
from .faultproxy import FaultProxy

native_for_module()

PATHS = ["sync", "async"]


class Paths:
    """One cache on the sync or the async native backend, driven from sync test code."""

    def __init__(self, path: str, url: str, **kwargs: Any) -> None:
        self.path = path
        self.loop = asyncio.new_event_loop() if path == "async" else None
        try:
            if self.loop is None:
                self.cache: Any = hotlock.connect(url, backend="native", **kwargs)
            else:
                self.cache = self.run(hotlock.aio.connect(url, backend="native", **kwargs))
        except BaseException:
            if self.loop is not None:  # no loop left unclosed for the garbage collector
                self.loop.close()
            raise
        assert self.cache.backend == "native"

    def run(self, value: Any) -> Any:
        return value if self.loop is None else self.loop.run_until_complete(value)

    def lock(self, key: str, ttl: float, **kwargs: Any) -> Any:
        return self.run(self.cache.lock(key, ttl, **kwargs))

    def lock_many(self, keys: list[str], ttl: float) -> Any:
        return self.run(self.cache.lock_many(keys, ttl))

    def unlock(self, lock: Any) -> bool:
        return bool(self.run(lock.unlock()))

    def close(self) -> None:
        self.run(self.cache.close())
        if self.loop is not None:
            self.loop.close()


@pytest.fixture(params=PATHS)
def path(request: pytest.FixtureRequest) -> str:
    return str(request.param)


@pytest.fixture
def opened(path: str) -> Iterator[Callable[..., Paths]]:
    made: list[Paths] = []

    def open_(url: str, **kwargs: Any) -> Paths:
        made.append(Paths(path, url, **kwargs))
        return made[-1]

    yield open_
    for each in made:
        each.close()


def calls(server: RedisServer, *commands: str) -> dict[str, int]:
    """How many times the server ran (or refused) each command (INFO commandstats)."""
    stats = server.client().info("commandstats")
    out = {}
    for command in commands:
        entry = stats.get(f"cmdstat_{command}", {})
        out[command] = int(entry.get("calls", 0)) + int(entry.get("rejected_calls", 0))
    return out


def sent(server: RedisServer, action: Callable[[], Any]) -> tuple[Any, dict[str, int]]:
    before = calls(server, "evalsha", "exec", "multi")
    result = action()
    after = calls(server, "evalsha", "exec", "multi")
    return result, {k: after[k] - before[k] for k in after}


def test_a_free_key_is_taken_without_a_script(
    opened: Callable[..., Paths], redis_url: str, redis_server: RedisServer
) -> None:
    cache = opened(redis_url)
    side = redis_server.client()
    seconds, micros = side.time()
    lock, counts = sent(redis_server, lambda: cache.lock("free", 10))
    assert counts == {"evalsha": 0, "exec": 1, "multi": 1}
    assert side.get(lock_name(b"free")) == lock._token and len(lock._token) == 16
    assert 9_000 < side.pttl(lock_name(b"free")) <= 10_000
    # The fence is the server's clock (TIME, in microseconds) when it was taken.
    assert 0 <= lock.fence - (seconds * 1_000_000 + micros) < 5_000_000
    again, counts = sent(redis_server, lambda: (cache.unlock(lock), cache.lock("free", 10)))
    assert again[1].fence > lock.fence
    assert counts["exec"] == 1
    # A batch: every key's transaction in one write, no script.
    locks, counts = sent(redis_server, lambda: cache.lock_many(["b1", "b2", "b3"], 10))
    assert all(locks) and counts == {"evalsha": 0, "exec": 3, "multi": 3}
    assert [side.get(lock_name(k)) for k in (b"b1", b"b2", b"b3")] == [lk._token for lk in locks]


def test_a_held_key_is_decided_by_the_script_as_before(
    opened: Callable[..., Paths], redis_url: str, redis_server: RedisServer
) -> None:
    cache = opened(redis_url)
    holder = opened(redis_url)
    held = holder.lock("held", 30)
    before = calls(redis_server, "evalsha", "exec", "multi")
    with pytest.raises(LockNotAcquired) as info:
        cache.lock("held", 30)
    after = calls(redis_server, "evalsha", "exec", "multi")
    assert info.value.retry_after is not None and 29 < info.value.retry_after <= 30
    # The transaction (SET NX found the key), then the script.
    assert {k: after[k] - before[k] for k in after} == {"evalsha": 1, "exec": 1, "multi": 1}
    assert redis_server.client().get(lock_name(b"held")) == held._token
    # The backend's own answer: -(the holder's TTL in ms).
    # (An async backend's acquire also takes the lock_wait's since and wait_ms, and the script.)
    lone = () if cache.loop is None else (None, 0, ACQUIRE)
    result = cache.run(cache.cache._backend.acquire(lock_name(b"held"), b"t" * 16, 5000, *lone))
    assert -30_000 <= result < -29_000
    # In a batch, the held key alone goes by script, in a second write.
    locks, counts = sent(redis_server, lambda: cache.lock_many(["f1", "held", "f2"], 10))
    assert [lk is None for lk in locks] == [False, True, False]
    assert counts == {"evalsha": 1, "exec": 3, "multi": 3}


def test_a_key_held_as_permits_is_still_a_conflict_of_kind(
    opened: Callable[..., Paths], redis_url: str, redis_server: RedisServer
) -> None:
    cache = opened(redis_url)
    permit = cache.lock("permits", 30, limit=2)  # a hash: SET NX finds the key
    with pytest.raises(LockNotAcquired, match="as permits") as info:
        cache.lock("permits", 30)
    assert info.value.retry_after is None
    assert cache.unlock(permit) is True
    lock = cache.lock("permits", 30)  # the key free again: a plain lock by transaction
    assert redis_server.client().get(lock_name(b"permits")) == lock._token


def test_a_lost_transaction_reply_is_resent_and_yields_one_lock(
    opened: Callable[..., Paths], redis_url: str, redis_server: RedisServer
) -> None:
    with FaultProxy(redis_server.port) as proxy:
        cache = opened(proxy.url, timeout=0.5, connect_timeout=0.5)
        cache.lock("warm", 10)  # connected, scripts loaded
        proxy.drop_replies(1)
        lock, counts = sent(redis_server, lambda: cache.lock("lost", 10))
        assert proxy.dropped_replies == 1
        # The first transaction took the key; the resent one found it (SET NX nil) and the
        # script found its own token there: the same lock, a later fence.
        assert counts == {"evalsha": 1, "exec": 2, "multi": 2}
        assert redis_server.client().get(lock_name(b"lost")) == lock._token
        assert cache.unlock(lock) is True
        assert redis_server.client().get(lock_name(b"lost")) is None


def test_multi_refused_by_an_acl_falls_back_to_the_script_for_good(
    opened: Callable[..., Paths], server_kind: str, caplog: pytest.LogCaptureFixture
) -> None:
    server = start_redis(kind=server_kind)
    try:
        side = server.client()
        side.execute_command("ACL", "SETUSER", "locker", "on", ">s3cret", "~hotlock:*", "&*", "+@all", "-multi")
        with caplog.at_level(logging.WARNING, logger="hotlock"):
            cache = opened(f"redis://locker:s3cret@127.0.0.1:{server.port}/0")
            # MULTI refused alone: SET and TIME ran on their own (the SET took the key), and
            # the script finds this call's token there.
            first, counts = sent(server, lambda: cache.lock("acl-1", 10))
            assert counts == {"evalsha": 1, "exec": 1, "multi": 1}
            assert side.get(lock_name(b"acl-1")) == first._token
            # From then on every acquire goes by script: no MULTI sent.
            more, counts = sent(server, lambda: [cache.lock(f"acl-{i}", 10) for i in range(2, 5)])
            assert counts == {"evalsha": 3, "exec": 0, "multi": 0}
            batch, counts = sent(server, lambda: cache.lock_many(["m1", "m2"], 10))
            assert all(batch) and counts == {"evalsha": 2, "exec": 0, "multi": 0}
            with pytest.raises(LockNotAcquired):
                cache.lock("acl-1", 10)
            assert all(cache.unlock(lk) for lk in [first, *more, *batch])
        warned = [r for r in caplog.records if r.levelname == "WARNING" and "refused MULTI" in r.getMessage()]
        assert len(warned) == 1 and "NOPERM" in warned[0].getMessage()
    finally:
        server.stop()


def test_scripts_always_sends_no_transaction(
    opened: Callable[..., Paths], redis_url: str, redis_server: RedisServer
) -> None:
    cache = opened(redis_url, scripts="always")
    lock, counts = sent(redis_server, lambda: cache.lock("forced", 10))
    assert counts == {"evalsha": 1, "exec": 0, "multi": 0}
    assert cache.unlock(lock) is True


def test_lock_wait_sends_the_transaction_first_only(redis_url: str, redis_server: RedisServer) -> None:
    # The sync native wait loop (in C): a key held at the first attempt is likely held at
    # the next, which the script decides in one round trip.
    cache = hotlock.connect(redis_url, backend="native", wakeups=False)
    holder = hotlock.connect(redis_url, backend="native")
    try:
        holder.lock("waited", 0.3)
        lock, counts = sent(redis_server, lambda: cache.lock_wait("waited", 10, wait=2))
        assert counts["exec"] == 1 and counts["evalsha"] >= 2
        assert redis_server.client().get(lock_name(b"waited")) == lock._token
    finally:
        cache.close()
        holder.close()


# -- error replies to the transaction, from the fake server (tests/fakeserver.py) -------------

LOADING = b"-LOADING Redis is loading the dataset in memory\r\n"
NOAUTH = b"-NOAUTH Authentication required.\r\n"
# TIME's reply that makes the key "odd" the fence the fake server's script would give it.
HONEST_CLOCK = b"*2\r\n" + b"".join(bulk(b"%d" % n) for n in divmod(fence_of(lock_name(b"odd")), 1_000_000))
EXECABORT = b"-EXECABORT Transaction discarded because of previous errors.\r\n"


@pytest.mark.parametrize("refusal", ["LOADING", "NOAUTH", "NOAUTH-at-MULTI"])
def test_a_refused_transaction_is_sent_again_as_a_scripts_would_be(
    opened: Callable[..., Paths], refusal: str, caplog: pytest.LogCaptureFixture
) -> None:
    # A transient reply (the call paused, then resent on a new connection) and NOAUTH (a
    # new connection, which authenticates anew): MULTI and SET refused alike, nothing ran.
    # NOAUTH at MULTI alone still says the connection is not authenticated, never that the
    # server has no transactions.
    with FakeRedis() as fake:
        cache = opened(fake.url, timeout=0.25, wakeups=False)
        connections = fake.connections
        reply = LOADING if refusal == "LOADING" else NOAUTH
        for command in (b"MULTI",) if refusal == "NOAUTH-at-MULTI" else (b"MULTI", b"SET", b"TIME", b"EXEC"):
            fake.on(command, reply=reply)
        lock = cache.lock("refused", 10)
        assert fake.pending() == 0 and fake.connections == connections + 1
        assert lock.fence == fence_of(lock_name(b"refused"))
        assert fake.count(b"EVALSHA") == 0  # the transaction again, not the script
        cache.lock("after", 10)
        assert fake.count(b"EVALSHA") == 0  # still by transaction
        assert not [r for r in caplog.records if "refused MULTI" in r.getMessage()]


def test_an_error_at_the_set_is_a_cache_error(opened: Callable[..., Paths]) -> None:
    with FakeRedis() as fake:
        cache = opened(fake.url, timeout=0.25, wakeups=False)
        fake.on(b"SET", reply=b"-OOM command not allowed when used memory > 'maxmemory'.\r\n")
        fake.on(b"EXEC", reply=EXECABORT)
        with pytest.raises(CacheError, match="acquire failed: the server replied OOM command not allowed"):
            cache.lock("full", 10)
        assert cache.lock("probe", 10).fence == fence_of(lock_name(b"probe"))


@pytest.mark.parametrize(
    "reply",
    [
        b"*2\r\n+OK\r\n*2\r\n,1.5\r\n:1\r\n",  # a RESP3 double inside TIME's
        # The right reply and an extra one after it (the sync client drops both; the async
        # one delivers the first and drops the connection at the second).
        b"*2\r\n+OK\r\n" + HONEST_CLOCK + b":7\r\n",
        b"*-1\r\n",  # EXEC nil: the script decides
        b"*2\r\n+OK\r\n*2\r\n$1\r\nx\r\n$1\r\n1\r\n",  # a clock of no known shape: the script decides
    ],
    ids=["resp3-inside", "extra-reply", "exec-nil", "odd-clock"],
)
def test_an_odd_exec_reply_never_reaches_the_next_call(opened: Callable[..., Paths], reply: bytes) -> None:
    with FakeRedis() as fake:
        cache = opened(fake.url, timeout=0.25, wakeups=False)
        fake.on(b"EXEC", reply=reply)
        try:
            lock = cache.lock("odd", 10)
        except HotlockError:
            pass
        else:
            assert lock.fence == fence_of(lock_name(b"odd"))  # the script's, from the fake server
        assert fake.pending() == 0
        assert cache.lock("probe", 10).fence == fence_of(lock_name(b"probe"))
