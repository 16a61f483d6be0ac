"""The acquire of a free key as a transaction (MULTI, SET NX PX, TIME, EXEC: hotlock._acquire)
on the redis-py backends, sync and async, on each server kind.

What the server ran is read from its INFO commandstats: a free key costs one EXEC and no
EVALSHA; a held key, a lost reply, a MULTI refused by an ACL and a key held as permits each
go on to the ACQUIRE script, and give what the script alone gave before.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
import time
from collections.abc import Awaitable, Iterator
from typing import Any, TypeVar

import pytest
import redis

import hotlock
import hotlock.aio
from hotlock import CacheError, LockNotAcquired

from .conftest import RedisServer, lock_name, start_redis
from .faultproxy import FaultProxy

T = TypeVar("T")

MODES = ["sync", "async"]


class Api:
    """One cache of the redis-py backend, sync or async, called alike: each method runs
    the call to its end (the async one on a loop of its own) and returns what it gave."""

    def __init__(self, mode: str, url: str, **kwargs: Any) -> None:
        self.mode = mode
        # The async cache's loop (no asyncio.Runner before 3.11).
        self._loop = None if mode == "sync" else asyncio.new_event_loop()
        self.cache: Any
        if self._loop is None:
            self.cache = hotlock.connect(url, backend="redis-py", **kwargs)
        else:
            self.cache = self._loop.run_until_complete(hotlock.aio.connect(url, backend="redis-py", **kwargs))

    def _run(self, result: Any) -> Any:
        if self._loop is None:
            return result

        async def done(aw: Awaitable[T]) -> T:
            return await aw

        return self._loop.run_until_complete(done(result))

    def lock(self, key: str, ttl: float = 10, **kwargs: Any) -> Any:
        return self._run(self.cache.lock(key, ttl, **kwargs))

    def lock_wait(self, key: str, ttl: float = 10, wait: float = 5) -> Any:
        return self._run(self.cache.lock_wait(key, ttl, wait))

    def lock_many(self, keys: list[str], ttl: float = 10) -> list[Any]:
        locks: list[Any] = self._run(self.cache.lock_many(keys, ttl))
        return locks

    def unlock(self, lock: Any) -> bool:
        return bool(self._run(lock.unlock()))

    def extend(self, lock: Any, ttl: float) -> None:
        self._run(lock.extend(ttl))

    def close(self) -> None:
        self._run(self.cache.close())
        if self._loop is not None:
            self._loop.run_until_complete(self._loop.shutdown_asyncgens())
            self._loop.close()


@pytest.fixture(params=MODES)
def mode(request: pytest.FixtureRequest) -> str:
    return str(request.param)


@pytest.fixture
def api(mode: str, redis_url: str, monkeypatch: pytest.MonkeyPatch) -> Iterator[Api]:
    monkeypatch.delenv("CACHE_URL", raising=False)
    cache = Api(mode, redis_url)
    yield cache
    cache.close()


class Counts:
    """What the server ran since the last look (INFO commandstats: calls, and the calls an
    ACL or a state refused)."""

    def __init__(self, server: RedisServer) -> None:
        self._side = server.client()
        self._before = self._now()

    def _now(self) -> dict[str, tuple[int, int]]:
        stats = self._side.info("commandstats")
        return {k[len("cmdstat_") :]: (int(v["calls"]), int(v.get("rejected_calls", 0))) for k, v in stats.items()}

    def ran(self) -> dict[str, int]:
        """The calls each command took since the last look (the INFO that looks excluded)."""
        now = self._now()
        ran = {k: now[k][0] - self._before.get(k, (0, 0))[0] for k in now}
        ran["info"] -= 1
        self._before = self._now()
        return {k: n for k, n in ran.items() if n}

    def rejected(self, command: str) -> int:
        return self._now().get(command, (0, 0))[1]


def stored(server: RedisServer, key: str) -> bytes | None:
    value = server.client().get(lock_name(key))
    assert value is None or isinstance(value, bytes)
    return value


# -- (a) a free key: one transaction, no script ---------------------------------------------


def test_a_free_key_is_taken_by_one_transaction_and_no_script(api: Api, redis_server: RedisServer) -> None:
    api.unlock(api.lock("warm"))  # connected, the dialect known
    counts = Counts(redis_server)
    lock = api.lock("free", ttl=5)
    ran = counts.ran()
    assert ran.get("evalsha", 0) == 0
    assert (ran["multi"], ran["exec"], ran["set"], ran["time"]) == (1, 1, 1, 1)
    assert lock.fence > 0
    assert stored(redis_server, "free") == lock._token  # the token alone
    assert 4000 < redis_server.client().pttl(lock_name("free")) <= 5000
    assert api.unlock(lock) is True
    assert stored(redis_server, "free") is None


def test_the_fence_of_a_transaction_is_the_server_clock_in_microseconds(api: Api, redis_server: RedisServer) -> None:
    def server_us() -> int:
        seconds, micros = redis_server.client().time()
        return int(seconds) * 1_000_000 + int(micros)

    fences = []
    for i in range(20):
        before = server_us()
        lock = api.lock(f"clock-{i % 2}", ttl=5)
        assert before <= lock.fence <= server_us()
        fences.append(lock.fence)
        api.unlock(lock)
    assert fences == sorted(set(fences))


def test_lock_many_takes_every_free_key_in_one_write(api: Api, redis_server: RedisServer) -> None:
    api.unlock(api.lock("warm"))
    counts = Counts(redis_server)
    locks = api.lock_many(["m1", "m2", "m3"], ttl=5)
    ran = counts.ran()
    assert ran.get("evalsha", 0) == 0
    assert ran["exec"] == 3
    assert all(lk is not None and lk.fence > 0 for lk in locks)
    assert [stored(redis_server, k) for k in ("m1", "m2", "m3")] == [lk._token for lk in locks]
    for lk in locks:
        assert api.unlock(lk) is True


def test_a_free_lock_wait_is_one_transaction(api: Api, redis_server: RedisServer) -> None:
    api.unlock(api.lock("warm"))
    counts = Counts(redis_server)
    lock = api.lock_wait("waited", ttl=5, wait=1)
    ran = counts.ran()
    assert ran.get("evalsha", 0) == 0 and ran["exec"] == 1
    assert api.unlock(lock) is True


def test_scripts_always_sends_no_transaction(mode: str, redis_url: str, redis_server: RedisServer) -> None:
    api = Api(mode, redis_url, scripts="always")
    try:
        api.unlock(api.lock("warm"))
        counts = Counts(redis_server)
        lock = api.lock("scripted", ttl=5)
        ran = counts.ran()
        assert ran["evalsha"] == 1 and "exec" not in ran
        assert api.unlock(lock) is True
    finally:
        api.close()


# -- (b) a held key: the script decides, as before ----------------------------------------


def test_a_held_key_goes_on_to_the_script_and_says_how_long_it_is_held(api: Api, redis_server: RedisServer) -> None:
    holder = api.lock("held", ttl=10)
    counts = Counts(redis_server)
    with pytest.raises(LockNotAcquired) as info:
        api.lock("held", ttl=5)
    ran = counts.ran()
    # The transaction found the key (SET NX: nil), and the script answered -(its PTTL).
    assert (ran["exec"], ran["evalsha"]) == (1, 1)
    assert info.value.retry_after is not None and 9.0 < info.value.retry_after <= 10.0
    assert "held elsewhere for up to" in str(info.value)
    assert stored(redis_server, "held") == holder._token  # untouched
    assert 9000 < redis_server.client().pttl(lock_name("held")) <= 10000
    assert api.unlock(holder) is True


def test_a_key_without_a_ttl_is_held_elsewhere_with_no_retry_after(api: Api, redis_server: RedisServer) -> None:
    redis_server.client().set(lock_name("forever"), b"not ours")
    with pytest.raises(LockNotAcquired) as info:
        api.lock("forever")
    assert info.value.retry_after is None
    assert stored(redis_server, "forever") == b"not ours"


def test_lock_many_sends_only_the_held_keys_to_the_script(api: Api, redis_server: RedisServer) -> None:
    holder = api.lock("b", ttl=10)
    counts = Counts(redis_server)
    locks = api.lock_many(["a", "b", "c"], ttl=5)
    ran = counts.ran()
    assert (ran["exec"], ran["evalsha"]) == (3, 1)
    assert locks[1] is None
    assert locks[0] is not None and locks[2] is not None
    assert stored(redis_server, "a") == locks[0]._token and stored(redis_server, "c") == locks[2]._token
    assert stored(redis_server, "b") == holder._token
    for lk in (locks[0], locks[2], holder):
        assert api.unlock(lk) is True


def test_lock_wait_on_a_held_key_gets_it_when_released(api: Api, redis_server: RedisServer) -> None:
    holder = api.lock("later", ttl=0.3)  # expires while the wait polls
    lock = api.lock_wait("later", ttl=5, wait=3)
    assert lock.fence > holder.fence
    assert stored(redis_server, "later") == lock._token
    assert api.unlock(lock) is True


@pytest.mark.parametrize("wakeups", [False, True])
def test_a_wait_polls_by_script_after_its_first_attempt(
    mode: str, redis_url: str, redis_server: RedisServer, wakeups: bool
) -> None:
    # A key held at the first attempt is likely held at the next: the polls send the
    # script, which decides in one round trip (the transaction would find the key held,
    # then send the script: two). With wake-ups: ACQUIRE_POLL, then the waiting forms.
    api, holder = Api(mode, redis_url, wakeups=wakeups), Api(mode, redis_url)
    try:
        api.unlock(api.lock("warm"))
        holder.lock("polled", ttl=0.3)
        counts = Counts(redis_server)
        lock = api.lock_wait("polled", ttl=5, wait=3)
        ran = counts.ran()
        assert ran["exec"] == 1 and ran["evalsha"] >= 2
        assert stored(redis_server, "polled") == lock._token
    finally:
        api.close()
        holder.close()


def test_a_lock_taken_by_transaction_extends_and_releases_as_any(api: Api, redis_server: RedisServer) -> None:
    lock = api.lock("kept", ttl=2)
    api.extend(lock, 20)
    assert 19000 < redis_server.client().pttl(lock_name("kept")) <= 20000
    assert api.unlock(lock) is True
    assert stored(redis_server, "kept") is None


# -- (c) a lost reply: the transaction is resent, one lock -------------------------------


@pytest.fixture
def proxy(redis_server: RedisServer, redis_url: str) -> Iterator[FaultProxy]:
    with FaultProxy(redis_server.port) as p:
        yield p


@pytest.fixture
def papi(mode: str, proxy: FaultProxy) -> Iterator[Api]:
    cache = Api(mode, proxy.url, timeout=0.5, connect_timeout=0.5)
    yield cache
    proxy.clear()
    cache.close()


def test_a_lost_transaction_reply_is_resent_and_yields_one_lock(
    papi: Api, proxy: FaultProxy, redis_server: RedisServer
) -> None:
    papi.unlock(papi.lock("warm"))
    counts = Counts(redis_server)
    proxy.drop_replies(1)
    lock = papi.lock("lost", ttl=10)
    assert proxy.dropped_replies == 1
    ran = counts.ran()
    # The first transaction took the key; the resent one found it (SET NX: nil) and the
    # script found its own token there: the TTL refreshed, a later fence.
    assert (ran["exec"], ran["evalsha"]) == (2, 1)
    assert stored(redis_server, "lost") == lock._token
    assert 9000 < redis_server.client().pttl(lock_name("lost")) <= 10000
    assert redis_server.client().dbsize() == 1  # no key but the lock's
    assert papi.unlock(lock) is True
    assert stored(redis_server, "lost") is None


def test_a_lost_reply_of_lock_many_is_resent_and_yields_one_lock_per_key(
    papi: Api, proxy: FaultProxy, redis_server: RedisServer
) -> None:
    holder = papi.lock("y", ttl=10)
    proxy.drop_replies(1)
    locks = papi.lock_many(["x", "y", "z"], ttl=10)
    assert proxy.dropped_replies == 1
    assert locks[1] is None
    assert locks[0] is not None and locks[2] is not None
    assert [stored(redis_server, k) for k in ("x", "y", "z")] == [locks[0]._token, holder._token, locks[2]._token]
    for lk in (locks[0], locks[2], holder):
        assert papi.unlock(lk) is True


def test_a_lost_reply_under_contention_is_still_a_conflict(
    papi: Api, proxy: FaultProxy, redis_server: RedisServer
) -> None:
    holder = papi.lock("contended", ttl=10)
    proxy.drop_replies(1)
    with pytest.raises(LockNotAcquired):
        papi.lock("contended", ttl=10)
    assert stored(redis_server, "contended") == holder._token


@pytest.mark.parametrize("fault", ["drop_reply", "drop_request", "reset_after_request"])
def test_after_one_lost_message_holding_a_lock_iff_the_key_holds_its_token(
    papi: Api, proxy: FaultProxy, redis_server: RedisServer, fault: str
) -> None:
    for i in range(4):
        key = f"iff-{fault}-{i}"
        if fault == "drop_reply":
            proxy.drop_replies(1)
        elif fault == "drop_request":
            proxy.drop_requests(1)
        else:
            proxy.reset_after_request(1)
        try:
            lock = papi.lock(key, ttl=10)
        except CacheError:
            assert stored(redis_server, key) is None
        else:
            assert stored(redis_server, key) == lock._token
            assert papi.unlock(lock) is True
        proxy.clear()


# -- a transient reply to the transaction: paused and resent ---------------------------------


@pytest.fixture
def own_server(server_kind: str) -> Iterator[RedisServer]:
    """A private server: these tests make it busy."""
    server = start_redis("--busy-reply-threshold", "20", kind=server_kind)
    yield server
    server.stop()


def _kill_script(port: int) -> None:
    side = redis.Redis(port=port, socket_timeout=5)
    with contextlib.suppress(redis.ResponseError):  # NOTBUSY: over already
        side.script_kill()
    side.close()


@contextlib.contextmanager
def busy(server: RedisServer, seconds: float) -> Iterator[None]:
    """From the moment ``server`` answers BUSY (an endless script past its
    busy-reply-threshold), for ``seconds``: then SCRIPT KILL."""
    runner = redis.Redis(port=server.port, socket_timeout=10)

    def run() -> None:
        with contextlib.suppress(redis.ResponseError):  # "Script killed by user with SCRIPT KILL"
            runner.eval("while true do end", 0)

    thread = threading.Thread(target=run)
    side = redis.Redis(port=server.port, socket_timeout=5)
    thread.start()
    try:
        deadline = time.monotonic() + 5
        while True:
            try:
                side.ping()
            except redis.ResponseError as exc:
                assert "busy" in str(exc).lower(), exc
                break
            assert time.monotonic() < deadline, "the server never got busy"
            time.sleep(0.005)
        killer = threading.Timer(seconds, _kill_script, (server.port,))
        killer.start()
        yield
        killer.join()
    finally:
        while thread.is_alive():
            _kill_script(server.port)
            thread.join(0.05)
        runner.close()
        side.close()


def test_a_busy_server_is_waited_out_and_the_transaction_resent(mode: str, own_server: RedisServer) -> None:
    api = Api(mode, own_server.url, timeout=2.0)
    try:
        api.unlock(api.lock("warm"))
        with busy(own_server, 0.3):
            started = time.monotonic()
            lock = api.lock("busy", ttl=10)
            took = time.monotonic() - started
        assert 0.2 < took < 2.0, took
        assert stored(own_server, "busy") == lock._token
        # The transaction's SET was refused BUSY (the command did not run), then resent.
        assert int(own_server.client().info("commandstats")["cmdstat_set"]["rejected_calls"]) >= 1
        assert own_server.client().dbsize() == 1
        assert api.unlock(lock) is True
    finally:
        api.close()


# -- (d) MULTI refused by an ACL: the script serves, from then on --------------------------


@pytest.fixture
def no_multi(redis_server: RedisServer, redis_url: str) -> Iterator[str]:
    """The URL of a user whose ACL has every command but MULTI."""
    side = redis_server.client()
    side.execute_command("ACL", "SETUSER", "no-multi", "reset", "on", ">pw", "~*", "&*", "+@all", "-multi")
    try:
        yield redis_url.replace("redis://", "redis://no-multi:pw@")
    finally:
        side.execute_command("ACL", "DELUSER", "no-multi")


def test_a_multi_refused_by_an_acl_falls_back_to_the_script_and_keeps_working(
    mode: str, no_multi: str, redis_server: RedisServer, caplog: pytest.LogCaptureFixture
) -> None:
    api = Api(mode, no_multi)
    try:
        rejected = Counts(redis_server).rejected("multi")
        with caplog.at_level(logging.WARNING, logger="hotlock"):
            lock = api.lock("acl", ttl=10)  # SET ran alone and took the key: the script finds it ours
            assert stored(redis_server, "acl") == lock._token
            assert lock.fence > 0
            counts = Counts(redis_server)
            others = [api.lock(f"acl-{i}", ttl=10) for i in range(3)] + api.lock_many(["acl-m1", "acl-m2"])
            with pytest.raises(LockNotAcquired) as info:
                api.lock("acl", ttl=5)
        ran = counts.ran()
        # Refused once: every later acquire went straight to the script.
        assert Counts(redis_server).rejected("multi") == rejected + 1
        assert "exec" not in ran and ran["evalsha"] == 6
        assert info.value.retry_after is not None and info.value.retry_after > 9
        said = [r for r in caplog.records if "MULTI" in r.getMessage()]
        assert len(said) == 1 and said[0].levelno == logging.WARNING
        assert "NOPERM" in said[0].getMessage() or "permission" in said[0].getMessage()
        assert all(lk is not None and redis_server.client().get(lk._name) == lk._token for lk in others)
        for lk in [lock, *others]:
            assert api.unlock(lk) is True
        assert redis_server.client().dbsize() == 0
    finally:
        api.close()


def test_a_multi_refused_on_a_held_key_is_still_a_conflict(mode: str, no_multi: str, redis_server: RedisServer) -> None:
    api = Api(mode, no_multi)
    try:
        redis_server.client().set(lock_name("taken"), b"someone else", px=10_000)
        with pytest.raises(LockNotAcquired) as info:
            api.lock("taken", ttl=5)
        assert info.value.retry_after is not None and info.value.retry_after > 9
        assert stored(redis_server, "taken") == b"someone else"
    finally:
        api.close()


# -- (e) a key held as permits: the kind conflict -------------------------------------------


def test_a_key_held_as_permits_is_a_kind_conflict(api: Api, redis_server: RedisServer) -> None:
    permit = api.lock("kinds", ttl=10, limit=2)
    counts = Counts(redis_server)
    with pytest.raises(LockNotAcquired, match="held with a concurrency limit") as info:
        api.lock("kinds", ttl=10)
    ran = counts.ran()
    assert (ran["exec"], ran["evalsha"]) == (1, 1)  # the transaction found the key, the script said why
    assert info.value.retry_after is None
    assert redis_server.client().type(lock_name("kinds")) == b"hash"
    assert api.lock_many(["kinds"]) == [None]
    assert api.unlock(permit) is True


def test_a_permit_goes_by_script_and_a_plain_lock_refuses_it(api: Api, redis_server: RedisServer) -> None:
    api.unlock(api.lock("warm"))
    counts = Counts(redis_server)
    permit = api.lock("permits", ttl=10, limit=3)
    ran = counts.ran()
    assert ran["evalsha"] == 1 and "exec" not in ran  # a permit's ask always goes by script
    plain = api.lock("plain", ttl=10)
    with pytest.raises(LockNotAcquired, match="held as a plain lock"):
        api.lock("plain", ttl=10, limit=2)
    assert api.unlock(permit) is True and api.unlock(plain) is True


def test_a_hash_of_expired_permits_is_taken_by_a_plain_lock_with_a_later_fence(
    api: Api, redis_server: RedisServer
) -> None:
    permit = api.lock("gone", ttl=0.05, limit=2)
    redis_server.client().pexpire(lock_name("gone"), 10_000)  # the hash outlives its permit
    time.sleep(0.1)
    lock = api.lock("gone", ttl=5)
    assert lock.fence > permit.fence
    assert stored(redis_server, "gone") == lock._token
    assert api.unlock(lock) is True


# -- wait_replicas: WAIT rides behind the EXEC ----------------------------------------------


def test_under_wait_replicas_wait_rides_behind_the_exec_and_an_unconfirmed_acquire_is_undone(
    mode: str, redis_url: str, redis_server: RedisServer
) -> None:
    # The session's server has no replica: WAIT 1 confirms nothing.
    api = Api(mode, redis_url, wait_replicas=1, wait_timeout=0.05)
    try:
        counts = Counts(redis_server)
        with pytest.raises(CacheError, match="0 of 1 replicas confirmed"):
            api.lock("confirm", ttl=5)
        ran = counts.ran()
        # One write: the transaction and WAIT behind it (then the undo, a release).
        assert (ran["exec"], ran["wait"]) == (1, 1)
        with pytest.raises(CacheError, match="replicas"):
            api.lock_many(["r1", "r2"], ttl=5)
        assert not redis_server.client().exists(lock_name("confirm"), lock_name("r1"), lock_name("r2"))
    finally:
        api.close()
