"""The behaviour suite: the public sync API, run on every backend (memory, redis-py, native)."""

from __future__ import annotations

import logging
import os
import threading
import time
from datetime import timedelta
from pathlib import Path

import pytest
import redis

import hotlock
from hotlock import Cache, LockLost, LockNotAcquired

from .conftest import RedisServer, free_port, lock_name, start_redis

# The behaviour suite's tests run on one server and on the Redis Cluster (tests/cluster.py).
on_every_topology = pytest.mark.topologies("single", "cluster")


@on_every_topology
def test_lock_conflict_is_lock_not_acquired(cache: Cache) -> None:
    held = cache.lock("job", ttl=5)
    with pytest.raises(LockNotAcquired) as info:
        cache.lock("job", ttl=5)
    assert info.value.key == "job"
    assert "'job'" in str(info.value) and cache.server in str(info.value)
    assert not isinstance(info.value, hotlock.CacheError)
    assert held.unlock() is True
    cache.lock("job", ttl=5).unlock()


@on_every_topology
def test_lock_is_a_lease(cache: Cache) -> None:
    lock = cache.lock("lease", ttl=2)
    assert lock.key == "lease"
    assert lock.ttl == 2.0
    assert 1.9 < lock.valid_for() <= 2.0
    lock.unlock()
    assert lock.valid_for() == 0.0


def test_valid_for_never_exceeds_the_ttl_when_the_clock_stands_still(
    cache: Cache, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A clock read at the instant the acquire was sent (uvloop's is cached per loop
    turn): (sent + ttl) - sent can round above ttl, and valid_for() must not."""
    lock = cache.lock("still", ttl=30)
    sent = next(t for t in (1000 + i / 1000 for i in range(100_000)) if (t + 30.0) - t > 30.0)
    monkeypatch.setattr(lock, "_deadline", sent + 30.0)
    monkeypatch.setattr(type(lock), "_now", staticmethod(lambda: sent))
    assert lock.valid_for() == 30.0
    monkeypatch.undo()
    assert lock.unlock() is True


@on_every_topology
def test_unlock_is_idempotent(cache: Cache) -> None:
    lock = cache.lock("idem", ttl=5)
    assert lock.unlock() is True
    assert lock.unlock() is False
    assert lock.unlock() is False


@on_every_topology
def test_lock_expires_by_itself(cache: Cache) -> None:
    lock = cache.lock("crash", ttl=0.1)
    time.sleep(0.15)
    assert lock.valid_for() == 0.0
    other = cache.lock("crash", ttl=5)
    assert lock.unlock() is False, "an expired lock must not release its successor"
    with pytest.raises(LockLost):
        lock.extend(5)
    assert other.unlock() is True, "the successor still held the key"


@on_every_topology
def test_extend_replaces_the_ttl(cache: Cache) -> None:
    lock = cache.lock("ext", ttl=0.2)
    lock.extend(3)
    assert lock.ttl == 3.0
    assert 2.9 < lock.valid_for() <= 3.0
    time.sleep(0.3)  # past the first TTL: still held
    with pytest.raises(LockNotAcquired):
        cache.lock("ext")
    lock.extend(0.5)  # shorter than what is left: replaced, not added
    assert lock.valid_for() <= 0.5
    time.sleep(0.6)
    cache.lock("ext").unlock()


@on_every_topology
def test_extend_default_keeps_the_lock_ttl(cache: Cache) -> None:
    lock = cache.lock("ext-default", ttl=1.0)
    time.sleep(0.6)
    lock.extend()
    # The lock's own 1 s again, not the 0.4 s it had left: 0.4 s of slack for the reply and
    # the assert on a loaded machine (0.1 s was not enough: 0.19 s left, on the cluster,
    # with the machine's load at 12 on 2 cores).
    assert 0.6 < lock.valid_for() <= 1.0
    lock.unlock()


@on_every_topology
def test_extend_after_unlock_is_lock_lost(cache: Cache) -> None:
    lock = cache.lock("gone", ttl=5)
    lock.unlock()
    with pytest.raises(LockLost) as info:
        lock.extend(5)
    assert info.value.key == "gone"


@on_every_topology
def test_takeover_is_never_released_or_extended_by_the_old_holder(cache: Cache) -> None:
    old = cache.lock("take", ttl=0.05)
    time.sleep(0.08)
    new = cache.lock("take", ttl=5)
    with pytest.raises(LockLost):
        old.extend(10)
    assert old.unlock() is False
    with pytest.raises(LockNotAcquired):
        cache.lock("take")
    assert new.valid_for() > 4.5
    assert new.unlock() is True


@on_every_topology
def test_context_manager_releases_and_propagates(cache: Cache) -> None:
    class Boom(Exception):
        pass

    with pytest.raises(Boom), cache.lock("ctx", ttl=5) as lock:
        assert isinstance(lock, hotlock.Lock)
        raise Boom
    cache.lock("ctx").unlock()  # released by the with block


@on_every_topology
def test_context_manager_does_not_raise_when_lock_was_lost(cache: Cache) -> None:
    with cache.lock("ctx-lost", ttl=0.05):
        time.sleep(0.08)
        cache.lock("ctx-lost", ttl=5)  # someone else takes it over
    with pytest.raises(LockNotAcquired):
        cache.lock("ctx-lost")  # the with block did not release the new holder


@on_every_topology
def test_with_lock_returns_and_releases(cache: Cache) -> None:
    assert cache.with_lock("w", 5, lambda a, b=0: a + b, 2, b=3) == 5
    assert hotlock.with_lock(cache, "w", 5, lambda: "again") == "again"


@pytest.mark.parametrize("exc", [ValueError("x"), KeyboardInterrupt(), SystemExit(3)])
@on_every_topology
def test_with_lock_releases_however_fn_ends(cache: Cache, exc: BaseException) -> None:
    def work() -> None:
        raise exc

    with pytest.raises(type(exc)) as info:
        cache.with_lock("w-exc", 5, work)
    assert info.value is exc
    cache.lock("w-exc").unlock()


@on_every_topology
def test_with_lock_does_not_run_fn_when_held(cache: Cache) -> None:
    calls = []
    with cache.lock("w-held", ttl=5), pytest.raises(LockNotAcquired):
        cache.with_lock("w-held", 5, calls.append, 1)
    assert calls == []


@on_every_topology
def test_lock_wait_takes_a_free_lock_at_once(cache: Cache) -> None:
    t0 = time.monotonic()
    lock = cache.lock_wait("free", ttl=5, wait=2)
    assert time.monotonic() - t0 < 0.5
    assert lock.unlock() is True


@on_every_topology
def test_lock_wait_gives_up_at_the_deadline(cache: Cache) -> None:
    holder = cache.lock("busy", ttl=10)
    t0 = time.monotonic()
    with pytest.raises(LockNotAcquired) as info:
        cache.lock_wait("busy", ttl=5, wait=0.3)
    elapsed = time.monotonic() - t0
    assert 0.3 <= elapsed < 0.3 + 0.25, elapsed
    assert "after waiting" in str(info.value)
    holder.unlock()


@on_every_topology
def test_lock_wait_gets_a_released_lock(cache: Cache) -> None:
    holder = cache.lock("handoff", ttl=10)
    t0 = time.monotonic()  # before the timer starts: the release comes 0.1 s after it at the earliest
    threading.Timer(0.1, holder.unlock).start()
    lock = hotlock.lock_wait(cache, "handoff", 5, 3)
    waited = time.monotonic() - t0
    # Taken after the release (typically within a backoff cap, 50 ms, of it), long before
    # the 3 s deadline: half a second of slack for a loaded machine still tells them apart.
    assert 0.09 < waited < 0.1 + 0.5, waited
    assert lock.unlock() is True


@on_every_topology
def test_lock_wait_wakes_when_the_holder_expires(cache: Cache) -> None:
    t0 = time.monotonic()  # before the holder's TTL starts, so the wait is 0.2 s at least
    cache.lock("expiring", ttl=0.2)  # a crashed holder: never released
    lock = cache.lock_wait("expiring", ttl=5, wait=3)
    waited = time.monotonic() - t0
    # The sleep is capped by the holder's remaining TTL, so the waiter is there when it lapses.
    assert 0.15 < waited < 0.2 + 0.1, waited
    lock.unlock()


@on_every_topology
def test_lock_wait_ttl_runs_from_the_winning_attempt(cache: Cache) -> None:
    holder = cache.lock("late", ttl=0.3)
    lock = cache.lock_wait("late", ttl=1, wait=2)
    assert 0.9 < lock.valid_for() <= 1.0
    lock.unlock()
    holder.unlock()


@on_every_topology
def test_lock_many_in_order_with_none_where_held(cache: Cache) -> None:
    held = cache.lock("m2", ttl=5)
    locks = cache.lock_many(["m1", "m2", b"m3"], ttl=5)
    assert [lk.key if lk else None for lk in locks] == ["m1", None, b"m3"]
    assert cache.extend_many(locks, ttl=10) == [True, False, True]
    assert all(lk.valid_for() > 9.5 for lk in locks if lk)
    assert cache.unlock_many(locks) == [True, False, True]
    assert cache.unlock_many(locks) == [False, False, False]
    assert cache.lock_many([]) == []
    held.unlock()


@on_every_topology
def test_extend_many_reports_lost_locks(cache: Cache) -> None:
    locks = cache.lock_many(["e1", "e2"], ttl=0.3)  # 0.3 s: the extend comes in time on a loaded machine
    locks[1].extend(5)  # type: ignore[union-attr]
    time.sleep(0.35)
    assert cache.extend_many(locks, ttl=5) == [False, True]
    assert locks[0].valid_for() == 0.0  # type: ignore[union-attr]
    assert cache.unlock_many(locks) == [False, True]


@on_every_topology
def test_lock_many_batch_of_a_hundred(cache: Cache) -> None:
    keys = [f"batch:{i}" for i in range(100)]
    locks = cache.lock_many(keys, ttl=5)
    assert all(lk is not None for lk in locks)
    again = cache.lock_many(keys, ttl=5)
    assert again == [None] * 100
    assert cache.unlock_many(locks) == [True] * 100


@on_every_topology
def test_many_refuses_locks_of_another_cache(cache: Cache) -> None:
    other = hotlock.connect(None)
    foreign = other.lock("x")
    with pytest.raises(ValueError, match=r"locks\[0\]"):
        cache.unlock_many([foreign])


@on_every_topology
def test_set_nx_is_once(cache: Cache) -> None:
    assert cache.set_nx("charged:o1", "1", ttl=5) is True
    assert cache.set_nx("charged:o1", "1", ttl=5) is False
    assert cache.set_nx("charged:o2", b"x", ttl=0.05) is True
    time.sleep(0.08)
    assert cache.set_nx("charged:o2", 7, ttl=5) is True


@on_every_topology
def test_set_nx_and_locks_do_not_collide(cache: Cache) -> None:
    assert cache.set_nx("same", "1", ttl=5) is True
    cache.lock("same", ttl=5).unlock()


@on_every_topology
def test_incr_is_atomic(cache: Cache) -> None:
    assert cache.incr("c") == 1
    assert cache.incr("c") == 2
    assert cache.incr("c", 5) == 7
    assert cache.incr("c", -10) == -3

    def bump() -> None:
        for _ in range(200):
            cache.incr("threads")

    threads = [threading.Thread(target=bump) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert cache.incr("threads", 0) == 800


@on_every_topology
def test_tokens_are_per_acquisition_not_per_thread(cache: Cache) -> None:
    lock = cache.lock("thread-handoff", ttl=5)
    result: list[bool] = []
    t = threading.Thread(target=lambda: result.append(lock.unlock()))
    t.start()
    t.join()
    assert result == [True], "another thread holding the object may release it"


@on_every_topology
def test_token_never_shown(cache: Cache) -> None:
    lock = cache.lock("secret", ttl=0.05)
    token = lock._token
    time.sleep(0.08)
    with pytest.raises(LockLost) as info:
        lock.extend()
    for text in (repr(lock), str(lock), str(info.value), repr(info.value), repr(cache)):
        assert token.hex() not in text and repr(token) not in text


@on_every_topology
def test_timedelta_and_bytes_keys(cache: Cache) -> None:
    lock = cache.lock(b"\xffraw", ttl=timedelta(milliseconds=1500))
    assert 1.4 < lock.valid_for() <= 1.5
    lock.extend(timedelta(seconds=3))
    assert lock.unlock() is True


@on_every_topology
def test_forked_child_cannot_touch_the_parent_lock(cache: Cache) -> None:
    lock = cache.lock("fork", ttl=5)
    pid = os.fork()
    if pid == 0:  # the child: exit code tells the parent what it saw
        code = 0
        try:
            lock.extend(5)
            code = 1
        except LockLost:
            pass
        except BaseException:
            code = 2
        if lock.unlock() is not False or lock.valid_for() != 0.0:
            code = 3
        os._exit(code)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    assert lock.valid_for() > 4
    assert lock.unlock() is True, "the child must not have released the parent's lock"


@on_every_topology
def test_forked_child_can_take_its_own_locks(rcache: Cache) -> None:
    rcache.lock("before-fork", ttl=5).unlock()
    pid = os.fork()
    if pid == 0:
        try:
            mine = rcache.lock("child-lock", ttl=5)
            code = 0 if mine.unlock() else 1
        except BaseException:
            code = 2
        os._exit(code)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    rcache.lock("after-fork", ttl=5).unlock()  # the parent's connection still works


@on_every_topology
def test_enabled_and_backend(cache: Cache, backend: str) -> None:
    assert cache.backend == backend
    assert cache.enabled is (backend != "memory")


def test_keys_live_under_the_prefix(redis_backend: str, redis_server: RedisServer, redis_url: str) -> None:
    client = redis_server.client()
    with hotlock.connect(redis_url, backend=redis_backend, prefix="app1:") as cache:
        lock = cache.lock("k", ttl=5)
        cache.set_nx("k", "v", ttl=5)
        cache.incr("k")
        assert sorted(client.keys("*")) == [b"app1:count:{k}", b"app1:lock:{k}", b"app1:once:{k}"]
        assert 4000 < client.pttl(b"app1:lock:{k}") <= 5000
        assert client.get(b"app1:lock:{k}") == lock._token
        lock.unlock()
        assert client.exists(b"app1:lock:{k}") == 0


def test_close_disconnects_every_connection(redis_backend: str, redis_server: RedisServer, redis_url: str) -> None:
    client = redis_server.client()
    before = {c["id"] for c in client.client_list()}
    cache = hotlock.connect(redis_url, backend=redis_backend)
    cache.lock("k", ttl=5).unlock()
    assert {c["id"] for c in client.client_list()} - before, "the cache is connected"
    cache.close()
    # The server sees a close a moment after it is made.
    deadline = time.monotonic() + 2
    while (left := {c["id"] for c in client.client_list()} - before) and time.monotonic() < deadline:
        time.sleep(0.01)
    assert not left, "a connection outlived close()"


def test_redis_down_is_cache_error_not_contention(redis_backend: str, server_kind: str) -> None:
    server = start_redis(kind=server_kind)
    cache = hotlock.connect(server.url, backend=redis_backend, timeout=0.5, connect_timeout=0.5)
    lock = cache.lock("down", ttl=5)
    server.stop()
    with pytest.raises(hotlock.CacheError) as info:
        cache.lock("other")
    assert not isinstance(info.value, LockNotAcquired)
    assert server.url.split("//")[1].split("/")[0] in str(info.value)
    with pytest.raises(hotlock.CacheError):
        lock.extend()
    with pytest.raises(hotlock.CacheError):
        cache.lock_wait("other", wait=0.2)
    cache.close()


def test_release_failure_in_with_block_is_a_warning(
    redis_backend: str, server_kind: str, caplog: pytest.LogCaptureFixture
) -> None:
    class Boom(Exception):
        pass

    server = start_redis(kind=server_kind)
    cache = hotlock.connect(server.url, backend=redis_backend, timeout=0.5, connect_timeout=0.5)
    with caplog.at_level(logging.WARNING, "hotlock"), pytest.raises(Boom) as info, cache.lock("bye", ttl=5):
        server.stop()
        raise Boom("the body's own error")
    assert str(info.value) == "the body's own error"
    assert any("release of lock 'bye' failed" in r.getMessage() for r in caplog.records)
    cache.close()


def test_unreachable_server_is_cache_error_at_connect(redis_backend: str) -> None:
    url = f"redis://127.0.0.1:{free_port()}/0"
    t0 = time.monotonic()
    with pytest.raises(hotlock.CacheError) as info:
        hotlock.connect(url, backend=redis_backend, connect_timeout=0.5)
    assert time.monotonic() - t0 < 2
    assert url.split("//")[1].split("/")[0] in str(info.value)


def test_unix_socket_url(redis_backend: str, server_kind: str, tmp_path: Path) -> None:
    sock = tmp_path / "redis.sock"
    server = start_redis("--unixsocket", str(sock), "--unixsocketperm", "700", kind=server_kind)
    try:
        with hotlock.connect(f"unix://{sock}?db=2", backend=redis_backend) as cache:
            assert cache.server == f"unix://{sock}?db=2"
            lock = cache.lock("over-unix", ttl=5)
            server.client().execute_command("SELECT", 2)
            assert server.client().exists(lock_name("over-unix")) == 1
            assert lock.unlock() is True
    finally:
        server.stop()


def test_acl_user_password_and_db_from_the_url(redis_backend: str, redis_server: RedisServer, redis_url: str) -> None:
    client = redis_server.client()
    client.execute_command("ACL", "SETUSER", "locker", "on", ">p@ss:word", "~*", "+@all")
    try:
        url = redis_url.replace("redis://", "redis://locker:p%40ss%3Aword@").replace("/0", "/3")
        with hotlock.connect(url, backend=redis_backend) as cache:
            assert "p@ss" not in repr(cache) and "locker" not in cache.server
            lock = cache.lock("in-db-3", ttl=5)
            db3 = redis.Redis(host=redis_server.host, port=redis_server.port, db=3)
            assert db3.exists(lock_name("in-db-3")) == 1
            db3.close()
            assert client.exists(lock_name("in-db-3")) == 0
            lock.unlock()
        with pytest.raises(hotlock.CacheError) as info:
            hotlock.connect(url.replace("p%40ss", "wrong"), backend=redis_backend)
        assert "wrong" not in str(info.value)
    finally:
        client.execute_command("ACL", "DELUSER", "locker")


def test_key_layout_wraps_the_user_key_in_a_hash_tag(rcache: Cache, redis_server: RedisServer) -> None:
    """The documented layout (docs/key-layout.md): <prefix>lock:{key}, one-to-one, so one lock's keys share a slot."""
    from hotlock._keys import stored, user_key

    with rcache.lock("tenant-7}:job", ttl=5):
        assert redis_server.client().exists(b"hotlock:lock:{tenant-7}:job}") == 1
    for key in (b"a", b"{a}", b"x}y", b"{", b"}"):
        assert user_key(b"p:lock:", stored(b"p:lock:", key)) == key
    assert user_key(b"p:lock:", b"p:lock:plain") is None
    assert user_key(b"p:lock:", b"q:lock:{a}") is None
