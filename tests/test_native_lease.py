"""Cache.lock's one-call native path (ext/_lease.pxi) against the Python path it replaces.

The native backend takes the common case (a str/bytes key, an int/float TTL) in one
extension call that builds the Lock without Lease.__init__. These tests hold it to the
Python path on a real Redis: the same stored key, TTL, fields and slots, and for every
input the validators refuse, the same exception with the same message and nothing sent.
"""

from __future__ import annotations

import math
import re
import threading
from collections.abc import Iterator
from datetime import timedelta

import pytest

import hotlock
from hotlock._backend import native_module
from hotlock._lock import Lease
from hotlock.errors import LockNotAcquired

from .conftest import REQUIRE_NATIVE, RedisServer, lock_name

native, _why = native_module()
if native is None:
    if REQUIRE_NATIVE:
        pytest.fail(f"HOTLOCK_REQUIRE_EXTENSIONS=1 but the native backend is not live: {_why}", pytrace=False)
    pytest.skip(f"the native extension is not live: {_why}", allow_module_level=True)

SLOTS = [s for klass in Lease.__mro__ for s in getattr(klass, "__slots__", ())]


class Key(str):
    """A str subclass: not the fast path's exact type, so the validators take it."""


@pytest.fixture
def caches(redis_url: str) -> Iterator[tuple[hotlock.Cache, hotlock.Cache]]:
    """The native cache as connect() makes it, and one forced onto the Python path."""
    fast = hotlock.connect(redis_url, backend="native")
    slow = hotlock.connect(redis_url, backend="native")
    assert fast._take is not None
    slow._take = None
    yield fast, slow
    fast.close()
    slow.close()


@pytest.mark.parametrize(
    ("key", "ttl"),
    [
        ("plain", 30),
        ("ünïcødé-€", 30),
        (b"\x00\xffbytes", 30),
        ("x" * 1024, 1),
        (b"y" * 1024, 604800),  # the 7-day maximum, in whole seconds
        ("f", 2.5),
        ("half-even-down", 0.0025),  # round(2.5) == 2: half to even, as ttl_ms does
        ("half-even-up", 0.0035),
        ("tiny", 0.0015),
        ("max-float", 604800.0),
        ("td", timedelta(seconds=3)),  # not an int or float: through ttl_ms
        (Key("subclass"), 30),  # not exactly str: through key_bytes
        ("big-int", 10**40 // 10**39),
    ],
)
def test_the_one_call_lock_is_the_python_paths_lock(
    caches: tuple[hotlock.Cache, hotlock.Cache], redis_server: RedisServer, key: str | bytes, ttl: object
) -> None:
    fast, slow = caches
    a = fast.lock(key, ttl)  # type: ignore[arg-type]
    held = a._token
    assert len(held) > 16 and held[16:] == str(a.fence).encode()  # token + fence digits
    assert 0 < a.valid_for() <= a.ttl
    assert a.unlock() is True
    b = slow.lock(key, ttl)  # type: ignore[arg-type]
    try:
        assert type(a) is type(b) is hotlock.Lock
        for slot in SLOTS:
            assert type(getattr(a, slot)) is type(getattr(b, slot)), slot
        assert a._name == b._name == lock_name(key)
        assert a._ttl_ms == b._ttl_ms and a.ttl == b.ttl
        assert a.key is key and a._backend is fast._backend
        assert a._pid == b._pid and a._meter is None
        assert a.fence < b.fence  # fresh fences from the server's clock
        assert a._token == b""  # released
        assert len(b._token) > 16 and b._token[16:] == str(b.fence).encode()
        assert 0 < b.valid_for() <= b.ttl
    finally:
        b.unlock()
    assert redis_server.client().keys("hotlock:lock:*") == []


def test_a_one_call_lock_extends_releases_and_reports_held(caches: tuple[hotlock.Cache, hotlock.Cache]) -> None:
    fast, slow = caches
    lock = fast.lock("shared", 30)
    assert 29 < lock.valid_for() <= 30
    lock.extend(60)
    assert lock.ttl == 60
    with pytest.raises(LockNotAcquired) as fast_held:
        fast.lock("shared", 30)
    with pytest.raises(LockNotAcquired) as slow_held:
        slow.lock("shared", 30)
    # The same message (the holder's remaining TTL differs by the time between the two).
    assert str(fast_held.value).split(" for up to ")[0] == str(slow_held.value).split(" for up to ")[0]
    assert re.search(r"held elsewhere for up to (59|60)\.\d{3} s more", str(fast_held.value))
    assert lock.unlock() is True
    assert lock.unlock() is False
    with fast.lock("shared", 30) as again:
        assert again.fence > lock.fence


@pytest.mark.parametrize(
    ("key", "ttl"),
    [
        ("", 30),
        (b"", 30),
        ("x" * 1025, 30),
        ("€" * 342, 30),  # 1,026 UTF-8 bytes
        ("\ud800", 30),  # a lone surrogate cannot be encoded
        (None, 30),
        (5, 30),
        (bytearray(b"k"), 30),
        ("k", 0),
        ("k", -1),
        ("k", 604801),
        ("k", 10**30),
        ("k", True),
        ("k", None),
        ("k", "30"),
        ("k", 0.0004),
        ("k", -0.5),
        ("k", math.nan),
        ("k", math.inf),
        ("k", 604800.001),
        ("k", 1e300),
        ("", None),  # both wrong: the key is reported first, as on the Python path
    ],
)
def test_the_one_call_lock_refuses_as_the_validators_do(
    caches: tuple[hotlock.Cache, hotlock.Cache], redis_server: RedisServer, key: object, ttl: object
) -> None:
    fast, slow = caches
    with pytest.raises((TypeError, ValueError)) as fast_error:
        fast.lock(key, ttl)  # type: ignore[arg-type]
    with pytest.raises((TypeError, ValueError)) as slow_error:
        slow.lock(key, ttl)  # type: ignore[arg-type]
    assert type(fast_error.value) is type(slow_error.value)
    assert str(fast_error.value) == str(slow_error.value)
    assert redis_server.client().dbsize() == 0  # refused before any I/O


def test_threads_taking_turns_each_use_their_own_connection(redis_url: str, redis_server: RedisServer) -> None:
    """The per-thread slot (the last caller's connection) never hands one live thread's
    connection to another: two threads alternating strictly, so every call misses the
    slot, open exactly one connection each and each lock works."""
    cache = hotlock.connect(redis_url, backend="native")
    before = int(redis_server.client().info("stats")["total_connections_received"])
    turn = [threading.Event(), threading.Event()]
    released = []

    def worker(me: int) -> None:
        for i in range(20):
            assert turn[me].wait(30)
            turn[me].clear()
            lock = cache.lock(f"turns:{me}:{i}", 30)
            released.append(lock.unlock())
            turn[1 - me].set()

    threads = [threading.Thread(target=worker, args=(n,)) for n in (0, 1)]
    for t in threads:
        t.start()
    turn[0].set()
    for t in threads:
        t.join(60)
    after = int(redis_server.client().info("stats")["total_connections_received"])
    cache.close()
    assert released == [True] * 40
    assert after - before == 2  # two threads, two connections
