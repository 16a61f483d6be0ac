"""The native cycle's one-call paths (ext/_lease.pxi) against the Python paths they replace.

The native backend takes the common case of Cache.lock (a str/bytes key, an int/float TTL)
in one extension call that builds the Lock with Lease._fill (not __init__), and the common case of
Lock.unlock and Lock.extend in one call each, with every other case handed to the Python
methods (Lock.unlock/Lock.extend, Cache.lock; hotlock._fastpath binds the one-call ones to
NativeCache and NativeLock, the classes connect() chooses on the native backend). These tests hold
each to its Python path on a real server: the same stored key, TTL, fields and slots, the
same results, and for every input the validators refuse, the same exception with the same
message and nothing sent.
"""

from __future__ import annotations

import inspect
import math
import os
import re
import threading
import time
from collections.abc import Callable, Iterator
from datetime import timedelta
from typing import Any

import pytest

import hotlock
from hotlock import _ident
from hotlock._cache import Cache
from hotlock._fastpath import NativeCache, NativeLock
from hotlock._lock import TAKEN, Lease, Lock
from hotlock.errors import LockLost, LockNotAcquired

from .conftest import RedisServer, lock_name, native_for_module

native = native_for_module()

SLOTS = [s for klass in Lease.__mro__ for s in getattr(klass, "__slots__", ())]
# The methods as written in Python: what the one-call ones hand every other case to.
python_lock = Cache.lock
PY_UNLOCK: Callable[[Lock], bool] = Lock.unlock
PY_EXTEND: Callable[..., None] = Lock.extend


def commands_processed(server: RedisServer) -> int:
    """The server's command count, as seen by one INFO (which counts itself)."""
    return int(server.client().info("stats")["total_commands_processed"])


def nothing_sent(server: RedisServer, action: Callable[[], object]) -> None:
    """Run action, asserting that it sent the server no command."""
    first = commands_processed(server)
    idle = commands_processed(server) - first  # what one INFO adds
    before = commands_processed(server)
    action()
    assert commands_processed(server) - before == idle


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
    assert len(held) == 16  # the token alone: a plain lock's fence is not stored
    # A TTL of a few ms may run out in one scheduling pause of a loaded machine: for those,
    # only what the clock cannot change is asserted.
    short = a.ttl < 0.1
    left = a.valid_for()
    assert 0 <= left <= a.ttl and (left > 0 or short)
    assert a.unlock() is True or short
    b = slow.lock(key, ttl)  # type: ignore[arg-type]
    try:
        assert type(a) is type(b) is NativeLock  # the native backend's leases, either path
        for slot in SLOTS:
            assert type(getattr(a, slot)) is type(getattr(b, slot)), slot
        assert a._name == b._name == lock_name(key)
        assert a._ttl_ms == b._ttl_ms and a.ttl == b.ttl
        assert a.key is key and a._backend is fast._backend
        assert a._pid == b._pid and a._meter is None
        assert a.fence < b.fence  # fresh fences from the server's clock
        assert a._token == b""  # released
        assert len(b._token) == 16
        left = b.valid_for()
        assert 0 <= left <= b.ttl and (left > 0 or short)
    finally:
        b.unlock()
    assert redis_server.client().keys("hotlock:lock:*") == []


@pytest.mark.parametrize("limit", [2, 4, 2**31 - 1])
def test_the_one_call_permit_is_the_python_paths_permit(
    caches: tuple[hotlock.Cache, hotlock.Cache], redis_server: RedisServer, limit: int
) -> None:
    fast, slow = caches
    a = fast.lock("permits", 30, limit=limit)
    b = slow.lock("permits", 30, limit=limit)
    try:
        assert type(a) is type(b) is NativeLock  # the native backend's leases, either path
        for slot in SLOTS:
            assert type(getattr(a, slot)) is type(getattr(b, slot)), slot
        for lk in (a, b):
            assert lk._token[16:] == b"#%d" % lk.fence  # token '#' fence
        assert a.fence < b.fence and a._name == b._name
        a.extend(20)
        assert 19 < a.valid_for() <= 20
    finally:
        assert a.unlock() is True and b.unlock() is True
    if limit == 2:
        held = [fast.lock("full", 30, limit=2), slow.lock("full", 30, limit=2)]
        for cache in caches:
            with pytest.raises(hotlock.LockNotAcquired, match=r"limit=2"):
                cache.lock("full", 30, limit=2)
        assert all(lk.unlock() for lk in held)


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


# -- NativeLock.unlock and NativeLock.extend ---------------------------------------------------


@pytest.fixture
def python_calls() -> Iterator[list[str]]:
    """The one-call unlock/extend handing their other cases to counting wrappers of the
    Python methods: the list names each call that reached them."""
    calls: list[str] = []

    def unlock(lock: Lock) -> bool:
        calls.append("unlock")
        return PY_UNLOCK(lock)

    def extend(lock: Lock, ttl: Any = None) -> None:
        calls.append("extend")
        PY_EXTEND(lock, ttl)

    native.lease_methods(NativeLock, unlock, extend, TAKEN)
    try:
        yield calls
    finally:
        native.lease_methods(NativeLock, PY_UNLOCK, PY_EXTEND, TAKEN)


def test_unlock_and_extend_take_the_python_methods_only_off_the_common_case(
    caches: tuple[hotlock.Cache, hotlock.Cache], redis_url: str, python_calls: list[str]
) -> None:
    """Which calls reach the Python methods: none of the common case, every other one."""
    fast, _ = caches
    calls = python_calls
    redispy = hotlock.connect(redis_url, backend="redis-py")
    try:
        lock = fast.lock("route", 30)
        lock.extend()
        lock.extend(20)
        lock.extend(2.5)
        assert calls == []
        lock.extend(timedelta(seconds=3))  # not an int or float: the Python method
        assert calls == ["extend"] and lock.ttl == 3
        assert lock.unlock() is True and calls == ["extend"]
        assert lock.unlock() is False and calls == ["extend", "unlock"]  # released
        with pytest.raises(LockLost):
            lock.extend()
        assert calls[-1] == "extend"
        calls.clear()
        auto = fast.lock("route-auto", 30, auto_extend=True)  # the renewer's bookkeeping is Python's
        auto.extend()
        assert auto.unlock() is True
        other = redispy.lock("route-redispy", 30)  # another backend: a plain Lock, Python's methods
        assert type(other) is Lock
        other.extend()
        assert other.unlock() is True
        assert calls == ["extend", "unlock"]
    finally:
        redispy.close()


def test_a_metered_lock_keeps_the_one_call_methods_and_reports_as_the_python_ones(
    redis_url: str, python_calls: list[str]
) -> None:
    """connect(metrics=...): unlock and extend stay one extension call each and call the
    lease's hooks as the Python methods do (test_metrics holds the events to every backend's)."""
    from hotlock.metrics import BaseListener

    events: list[tuple[Any, ...]] = []

    class Recorder(BaseListener):
        def extended(self, key: str | bytes, ok: bool) -> None:
            events.append(("extended", key, ok))

        def released(self, key: str | bytes, held_s: float) -> None:
            events.append(("released", key, held_s >= 0))

        def lost(self, key: str | bytes, held_s: float) -> None:
            events.append(("lost", key))

    calls = python_calls
    metered = hotlock.connect(redis_url, backend="native", metrics=Recorder())
    try:
        lock = metered.lock("metered", 30)
        lock.extend()
        lock.extend(5)
        assert lock.unlock() is True
        taken = metered.lock("metered-lost", 30)
        metered._backend.release(taken._name, taken._token)  # type: ignore[attr-defined]
        with pytest.raises(LockLost):
            taken.extend()
        assert calls == []
        assert events == [
            ("extended", "metered", True),
            ("extended", "metered", True),
            ("released", "metered", True),
            ("extended", "metered-lost", False),
            ("lost", "metered-lost"),
        ]
    finally:
        metered.close()


def test_the_one_call_methods_read_as_the_python_ones() -> None:
    for fast, python in (
        (NativeCache.lock, python_lock),
        (NativeLock.unlock, PY_UNLOCK),
        (NativeLock.extend, PY_EXTEND),
    ):
        assert fast is not python
        assert fast.__name__ == python.__name__  # the qualname names its own class: NativeCache.lock
        assert inspect.getdoc(fast) == inspect.getdoc(python)
        bare = [p.replace(annotation=p.empty) for p in inspect.signature(python).parameters.values()]
        assert list(inspect.signature(fast).parameters.values())[1:] == bare[1:]


def test_cache_lock_takes_the_python_method_only_off_the_common_case(
    caches: tuple[hotlock.Cache, hotlock.Cache], redis_url: str
) -> None:
    fast, _ = caches
    calls: list[tuple[Any, ...]] = []

    def lock(cache: hotlock.Cache, *args: Any, **kwargs: Any) -> Lock:
        calls.append(args + tuple(sorted(kwargs.items())))
        return python_lock(cache, *args, **kwargs)

    native.cache_lock(NativeCache, lock)
    redispy = hotlock.connect(redis_url, backend="redis-py")
    try:
        taken = [
            fast.lock("route-1"),
            fast.lock("route-2", 30),
            fast.lock("route-3", ttl=2.5),
            fast.lock(b"route-4", 30, auto_extend=False, max_hold=None),
            fast.lock("route-5", max_hold=None),
            fast.lock("route-9", 30, limit=1),
            fast.lock("route-10", 30, limit=3),
        ]
        assert calls == []
        taken.append(fast.lock("route-6", 30, auto_extend=True))
        taken.append(fast.lock(key="route-7"))  # the key by keyword: the Python method
        # Another backend gets the plain classes: the Python methods, no extension call.
        assert type(redispy) is hotlock.Cache
        taken.append(redispy.lock("route-8"))
        assert type(taken[-1]) is Lock
        with pytest.raises(ValueError):
            fast.lock("route-11", 30, limit=0)  # refused by the Python method's limit_int
        assert calls == [
            ("route-6", 30, ("auto_extend", True)),
            (("key", "route-7"),),
            ("route-11", 30, ("limit", 0)),
        ]
        assert all(lk.unlock() for lk in taken)
    finally:
        native.cache_lock(NativeCache, python_lock)
        redispy.close()


@pytest.mark.parametrize(
    ("call", "args", "kwargs"),
    [
        ("lock", (), {}),
        ("lock", ("k", 30, True), {}),
        ("lock", ("k",), {"tll": 30}),
        ("lock", ("k", 30), {"ttl": 30}),
        ("lock", ("k",), {"key": "k"}),
        ("lock", ("k",), {"auto_extend": 1}),
        ("lock", ("k",), {"max_hold": 5}),
        ("unlock", (1,), {}),
        ("unlock", (), {"force": True}),
        ("extend", (1, 2), {}),
        ("extend", (), {"ttl": 1, "other": 2}),
        ("extend", (5,), {"ttl": 5}),
        ("extend", (), {"tll": 5}),
    ],
)
def test_wrong_arguments_are_refused_as_the_python_methods_refuse_them(
    caches: tuple[hotlock.Cache, hotlock.Cache],
    redis_server: RedisServer,
    call: str,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
) -> None:
    """The one-call methods see the arguments before any parsing and hand whatever they do
    not take to the Python method: its own TypeError (or ValueError), word for word."""
    fast, _ = caches
    lock = fast.lock("arguments", 30)
    errors = []

    def both() -> None:
        pairs = {
            "lock": ((NativeCache.lock, fast), (python_lock, fast)),
            "unlock": ((NativeLock.unlock, lock), (PY_UNLOCK, lock)),
            "extend": ((NativeLock.extend, lock), (PY_EXTEND, lock)),
        }[call]
        for method, self in pairs:
            with pytest.raises((TypeError, ValueError)) as error:
                method(self, *args, **kwargs)  # type: ignore[operator]
            errors.append(error.value)

    nothing_sent(redis_server, both)
    assert type(errors[0]) is type(errors[1]) and str(errors[0]) == str(errors[1])
    assert lock.unlock() is True


@pytest.mark.parametrize(
    "ttl",
    [None, 30, 1, 604800, 2.5, 0.0025, 0.0035, 0.0015, 604800.0, timedelta(seconds=3), 10**40 // 10**39],
)
def test_the_one_call_extend_is_the_python_paths_extend(
    caches: tuple[hotlock.Cache, hotlock.Cache], redis_server: RedisServer, ttl: Any
) -> None:
    fast, _ = caches
    client = redis_server.client()
    one, other = fast.lock("extend-a", 10), fast.lock("extend-b", 10)
    spans = []
    for lock, extend in ((one, NativeLock.extend), (other, PY_EXTEND)):
        before = time.monotonic()
        assert extend(lock, ttl) is None
        spans.append((before, time.monotonic()))
    # A lease of a few ms may have run out by the time it is looked at on a loaded machine:
    # whether it is still held is checked on the leases of a second or more only.
    alive = one._ttl_ms >= 1000
    try:
        assert type(one._ttl_ms) is type(other._ttl_ms) is int and one._ttl_ms == other._ttl_ms
        assert one.ttl == other.ttl
        for lock, (before, after) in zip((one, other), spans, strict=True):
            # The deadline runs from when the extend was sent, on the time.monotonic clock.
            assert type(lock._deadline) is float
            assert before + lock._ttl_ms / 1000 <= lock._deadline <= after + lock._ttl_ms / 1000
            assert lock._loss is None and lock.fence > 0
            if alive:
                assert not lock.lost
                assert 0 < client.pttl(lock._name) <= lock._ttl_ms
        if ttl is None:
            assert one._ttl_ms == 10_000
    finally:
        released = [one.unlock(), other.unlock()]
        if alive:
            assert released == [True, True]


@pytest.mark.parametrize(
    "ttl",
    [0, -1, 604801, 10**30, True, False, "30", b"30", 0.0004, -0.5, math.nan, math.inf, 604800.001, 1e300],
)
def test_the_one_call_extend_refuses_as_the_python_path_does(
    caches: tuple[hotlock.Cache, hotlock.Cache], redis_server: RedisServer, ttl: object
) -> None:
    fast, _ = caches
    lock = fast.lock("refused", 30)
    errors = []

    def both() -> None:
        for extend in (NativeLock.extend, PY_EXTEND):
            with pytest.raises((TypeError, ValueError)) as error:
                extend(lock, ttl)
            errors.append(error.value)

    nothing_sent(redis_server, both)
    assert type(errors[0]) is type(errors[1]) and str(errors[0]) == str(errors[1])
    assert lock._ttl_ms == 30_000 and lock._loss is None
    assert lock.unlock() is True


def test_the_one_call_unlock_is_the_python_paths_unlock(
    caches: tuple[hotlock.Cache, hotlock.Cache], redis_server: RedisServer
) -> None:
    fast, _ = caches
    client = redis_server.client()
    for unlock in (NativeLock.unlock, PY_UNLOCK):
        lock = fast.lock("unlock", 30)
        assert unlock(lock) is True
        assert lock._token == b"" and client.exists(lock._name) == 0
        nothing_sent(redis_server, lambda lock=lock, unlock=unlock: unlock(lock) is False or pytest.fail("True"))
        # Taken over meanwhile: the release leaves the new holder's key alone.
        lock = fast.lock("unlock", 30)
        client.set(lock._name, b"someone else", px=30_000)
        assert unlock(lock) is False
        assert lock._token == b"" and client.get(lock._name) == b"someone else"
        client.delete(lock._name)


def test_the_one_call_extend_of_a_lost_or_released_lock_is_the_python_paths(
    caches: tuple[hotlock.Cache, hotlock.Cache], redis_server: RedisServer
) -> None:
    fast, _ = caches
    client = redis_server.client()
    seen: dict[str, list[str]] = {}
    for path, extend, unlock in (("fast", NativeLock.extend, NativeLock.unlock), ("python", PY_EXTEND, PY_UNLOCK)):
        said = seen.setdefault(path, [])
        lock = fast.lock("lost", 30)
        client.delete(lock._name)  # expired, or taken and released by another holder
        sent = time.monotonic()
        with pytest.raises(LockLost) as gone:
            extend(lock, None)
        said.append(str(gone.value))
        assert lock._loss == TAKEN and lock.lost and lock.valid_for() == 0.0
        assert sent <= lock._deadline <= time.monotonic() and lock._ttl_ms == 30_000
        with pytest.raises(LockLost) as again:  # known lost: refused before anything is sent
            nothing_sent(redis_server, lambda lock=lock, extend=extend: extend(lock, 5))
        said.append(str(again.value))
        assert unlock(lock) is False and lock._token == b""
        with pytest.raises(LockLost) as released:
            nothing_sent(redis_server, lambda lock=lock, extend=extend: extend(lock, None))
        said.append(str(released.value))
    assert seen["fast"] == seen["python"]
    assert "is no longer held" in seen["fast"][0] and "was already released" in seen["fast"][2]


def test_a_plain_lease_past_its_deadline_is_extended_on_both_paths(
    caches: tuple[hotlock.Cache, hotlock.Cache],
) -> None:
    """Past its deadline a plain lease is lost only until an extend succeeds (the key may
    still be ours): neither path refuses it."""
    fast, _ = caches
    for extend in (NativeLock.extend, PY_EXTEND):
        lock = fast.lock("late", 30)
        lock._deadline = time.monotonic() - 1  # as if the TTL had run out unconfirmed
        assert lock.lost
        extend(lock, 30)
        assert not lock.lost and lock.valid_for() > 29
        assert lock.unlock() is True


@pytest.mark.filterwarnings("ignore:This process .* is multi-threaded:DeprecationWarning")
def test_in_a_forked_child_the_one_call_paths_know_its_pid(
    caches: tuple[hotlock.Cache, hotlock.Cache], redis_server: RedisServer
) -> None:
    """The extension reads the pid at the fork itself: the parent's lock is not the
    child's (refused the Python way: nothing sent), and the child's own locks carry its pid."""
    fast, _ = caches
    parent = fast.lock("fork-parent", 30)
    before = int(redis_server.client().info("stats")["total_commands_processed"])
    pid = os.fork()
    if pid == 0:
        code = 1
        try:
            assert parent.unlock() is False
            with pytest.raises(LockLost, match=f"was taken by process {parent._pid}; a forked child cannot extend"):
                parent.extend()
            assert parent._token != b""  # still the parent's to release
            code = 0
        finally:
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    # Nothing reached the server from the child (one INFO is this check's own).
    assert int(redis_server.client().info("stats")["total_commands_processed"]) - before == 1
    pid = os.fork()
    if pid == 0:
        code = 1
        try:
            mine = fast.lock("fork-child", 30)
            assert mine._pid == os.getpid() == _ident.pid != parent._pid
            mine.extend()
            assert mine.unlock() is True
            code = 0
        finally:
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    assert parent.unlock() is True
