"""Leases that extend themselves: auto_extend=True, max_hold, and
loss the work can see (lock.lost, lock.check(), lock.on_lost(), the with block), sync.

Every test runs on each backend where it means something (memory included unless it
needs a second client or the server), against the session's real redis-server; faults go
through the TCP fault proxy. Timing bounds are loose on purpose (a shared, loaded CI
machine): what they pin down is "at the deadline, not a reply timeout later" and "within
ttl/3 plus a round trip, not a TTL later". The async twin is tests/test_aio_autoextend.py.
"""

from __future__ import annotations

import gc
import multiprocessing as mp
import os
import random
import signal
import subprocess
import sys
import threading
import time
import warnings
from collections.abc import Iterator
from typing import Any

import pytest

import hotlock
from hotlock import Cache, LockLost, LockNotAcquired

from .conftest import RedisServer, lock_name, open_cache
from .faultproxy import FaultProxy
from .overlap import OverlapChecker

REPLY_TIMEOUT = 0.3
# Far longer than the TTLs below (four times or more): a known loss must be raised
# without waiting for a reply.
LONG_REPLY_TIMEOUT = 2.5
# What a loaded CI machine is allowed beyond the exact moment: scheduling, one GIL switch
# interval, a round trip. The measured lateness is far below it (see bench/results.md).
SLACK = 0.25
# The tests marked slow_variants("server_kind") wait on what the client times: the renewer's
# deadlines and batching, reply timeouts, max_hold, cancellation (and the 8 s soak, below).
# They run on Redis in make test and on Valkey in make test-slow; the ones that show the
# server's own extend and release under the renewer (outliving the TTL, lock_wait and
# lock_many, a manual extend, a deletion or takeover elsewhere, a release racing renewals)
# run on both.


class CountingBackend:
    """The cache's backend, counting the renewer's extend_many round trips (test only)."""

    def __init__(self, inner: Any) -> None:
        self._inner = inner
        self.name = inner.name
        self.server = inner.server
        self.round_trips: list[int] = []  # leases per extend_many call

    def extend_many(self, names: list[bytes], tokens: list[bytes], ms: int) -> list[bool]:
        self.round_trips.append(len(names))
        result: list[bool] = self._inner.extend_many(names, tokens, ms)
        return result

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)


def counting(cache: Cache) -> CountingBackend:
    """Count the round trips of ``cache`` from now on (before any lock is taken on it)."""
    wrapped = CountingBackend(cache._backend)
    cache._backend = wrapped  # type: ignore[assignment]
    return wrapped


def wait_until(predicate: Any, timeout: float, step: float = 0.005) -> float:
    """Poll until ``predicate()``; the monotonic time it first held. Fails at ``timeout``."""
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            pytest.fail(f"condition not met within {timeout} s")
        time.sleep(step)
    return time.monotonic()


def delete_key(cache: Cache, server: RedisServer, key: str) -> None:
    """Delete a lock's key as another client would (in-process: straight from the data)."""
    if cache.backend == "memory":
        assert cache._backend._data.pop(lock_name(key), None) is not None  # type: ignore[attr-defined]
    else:
        assert server.client().delete(lock_name(key)) == 1


@pytest.fixture
def proxy(redis_server: RedisServer, redis_url: str) -> Iterator[FaultProxy]:
    with FaultProxy(redis_server.port) as p:
        yield p


@pytest.fixture
def pcache(redis_backend: str, proxy: FaultProxy) -> Iterator[Cache]:
    """A cache whose every byte, the renewer's included, goes through the fault proxy."""
    c = open_cache(redis_backend, proxy.url, timeout=REPLY_TIMEOUT, connect_timeout=REPLY_TIMEOUT)
    yield c
    proxy.clear()
    c.close()


# -- arguments --------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("kwargs", "error", "text"),
    [
        ({"auto_extend": 1}, TypeError, "auto_extend must be True or False"),
        ({"auto_extend": "yes"}, TypeError, "auto_extend must be True or False"),
        ({"max_hold": 10}, ValueError, "max_hold needs auto_extend=True"),
        ({"auto_extend": True, "max_hold": 0}, ValueError, "max_hold must be at least 1 ms"),
        ({"auto_extend": True, "max_hold": -1}, ValueError, "max_hold must be at least 1 ms"),
        ({"auto_extend": True, "max_hold": float("nan")}, ValueError, "max_hold must be finite"),
        ({"auto_extend": True, "max_hold": True}, TypeError, "max_hold must be seconds"),
        ({"auto_extend": True, "max_hold": "60"}, TypeError, "max_hold must be seconds"),
        ({"auto_extend": True, "ttl": 0.05}, ValueError, "auto_extend needs a ttl of at least 0.1 s"),
    ],
)
def test_bad_auto_extend_arguments_fail_before_any_io(
    cache: Cache, kwargs: dict[str, Any], error: type[Exception], text: str
) -> None:
    seen = counting(cache)
    kwargs = dict(kwargs)
    ttl = kwargs.pop("ttl", 5)
    for call in (
        lambda: cache.lock("k", ttl, **kwargs),
        lambda: cache.lock_wait("k", ttl, 1, **kwargs),
        lambda: cache.lock_many(["k"], ttl, **kwargs),
        lambda: hotlock.lock_wait(cache, "k", ttl, 1, **kwargs),
    ):
        with pytest.raises(error, match=text):
            call()
    assert seen.round_trips == []
    assert cache._renewer is None  # nothing started either
    cache.lock("k", 5).unlock()  # and the key was never taken


def test_on_lost_needs_auto_extend_and_a_callable(cache: Cache) -> None:
    with cache.lock("plain", 5) as lock, pytest.raises(ValueError, match="auto_extend=True"):
        lock.on_lost(print)
    with cache.lock("auto", 5, auto_extend=True) as lock, pytest.raises(TypeError, match="callback must be callable"):
        lock.on_lost(42)  # type: ignore[arg-type]


# -- kept alive -------------------------------------------------------------------------


def test_an_auto_extended_lease_outlives_its_ttl_until_unlocked(cache: Cache) -> None:
    lock = cache.lock("long-job", ttl=0.6, auto_extend=True)
    time.sleep(1.8)  # three TTLs
    assert not lock.lost, lock._loss
    lock.check()
    assert 0 < lock.valid_for() <= 0.6
    with pytest.raises(LockNotAcquired):
        cache.lock("long-job", ttl=5)  # still ours, in Redis too
    assert lock.unlock() is True
    cache.lock("long-job", ttl=5).unlock()  # and released


def test_lock_wait_and_lock_many_extend_too(cache: Cache) -> None:
    waited = cache.lock_wait("w", ttl=0.6, wait=1, auto_extend=True)
    many = cache.lock_many(["m1", "m2", "m3"], ttl=0.6, auto_extend=True)
    time.sleep(1.5)
    for lock in [waited, *many]:
        assert lock is not None and not lock.lost
        with pytest.raises(LockNotAcquired):
            cache.lock(lock.key, ttl=5)
    assert cache.unlock_many([waited, *many]) == [True] * 4


@pytest.mark.slow_variants("server_kind")
def test_leases_of_one_ttl_are_renewed_in_one_round_trip_per_period(cache: Cache) -> None:
    seen = counting(cache)
    ttl = 0.6
    # Taken at different moments within a period: the renewer merges them into one batch.
    locks = []
    for i in range(5):
        locks += [lk for lk in cache.lock_many([f"b{i}-{j}" for j in range(40)], ttl=ttl, auto_extend=True) if lk]
        time.sleep(ttl / 15)
    settle = time.monotonic()
    time.sleep(ttl)  # let them merge
    before = len(seen.round_trips)
    time.sleep(4 * ttl)  # 12 renewal periods of ttl/3
    rounds = seen.round_trips[before:]
    assert all(not lk.lost for lk in locks)
    # ~12 periods; each is one round trip carrying all 200 once merged. Loose: a loaded
    # machine may split one period. Not one round trip per lease (that would be 2,400).
    assert 8 <= len(rounds) <= 20, (rounds, time.monotonic() - settle)
    assert sum(n == 200 for n in rounds) >= len(rounds) - 3, rounds
    cache.unlock_many(locks)


def test_a_manual_extend_is_kept_and_the_renewer_follows_the_new_ttl(cache: Cache) -> None:
    lock = cache.lock("manual", ttl=0.3, auto_extend=True)
    lock.extend(1.2)
    assert lock.ttl == 1.2
    time.sleep(1.5)
    assert not lock.lost and lock.ttl == 1.2
    assert lock.valid_for() > 0.3  # renewed with its new TTL: with the old one it never exceeds 0.3
    lock.unlock()


# -- loss the work can see -----------------------------------------------------------


def test_key_deleted_elsewhere_is_lost_within_a_third_of_the_ttl_plus_a_round_trip(
    cache: Cache, redis_server: RedisServer
) -> None:
    ttl = 0.9
    lock = cache.lock("deleted", ttl=ttl, auto_extend=True)
    told: list[tuple[float, str]] = []
    lock.on_lost(lambda lk: told.append((time.monotonic(), threading.current_thread().name)))
    time.sleep(0.1)
    delete_key(cache, redis_server, "deleted")
    deleted = time.monotonic()
    lost_at = wait_until(lambda: lock.lost, ttl)
    assert lost_at - deleted < ttl / 3 + SLACK, lost_at - deleted
    wait_until(lambda: told, 1)
    assert len(told) == 1 and told[0][1] == "hotlock-renewer"  # once, from the renewer
    with pytest.raises(LockLost, match="no longer held"):
        lock.check()
    with pytest.raises(LockLost):
        lock.extend()
    time.sleep(ttl / 2)
    assert len(told) == 1
    assert lock.unlock() is False


def test_a_takeover_is_lost_and_never_extended_again(cache: Cache, redis_server: RedisServer) -> None:
    lock = cache.lock("taken", ttl=0.3, auto_extend=True)
    delete_key(cache, redis_server, "taken")
    other = cache.lock("taken", ttl=5)  # another holder, rightly
    wait_until(lambda: lock.lost, 1)
    time.sleep(0.3)
    assert other.valid_for() > 4  # the old lease's renewer never touched the new holder's key
    assert lock.unlock() is False
    assert other.unlock() is True


def test_leaving_the_with_block_raises_lock_lost_when_lost_while_it_ran(
    cache: Cache, redis_server: RedisServer
) -> None:
    with pytest.raises(LockLost, match="no longer held"), cache.lock("ctx", ttl=0.3, auto_extend=True):
        delete_key(cache, redis_server, "ctx")
        time.sleep(0.4)  # work that does not look
    # The block's own exception propagates unchanged.
    with pytest.raises(KeyError), cache.lock("ctx2", ttl=0.3, auto_extend=True):
        delete_key(cache, redis_server, "ctx2")
        time.sleep(0.4)
        raise KeyError("mine")
    # A block that ends held raises nothing, and releases.
    with cache.lock("ctx3", ttl=0.6, auto_extend=True) as lock:
        time.sleep(0.8)
    assert not lock.lost
    cache.lock("ctx3", ttl=5).unlock()


@pytest.mark.slow_variants("server_kind")
@pytest.mark.parametrize(("ttl", "max_hold"), [(0.6, 1.5), (1.0, 1.5)])
def test_max_hold_stops_extending_and_the_key_expires_with_the_loss(cache: Cache, ttl: float, max_hold: float) -> None:
    """The renewals max_hold allows extend only up to it (the last one asks for what is
    left), so when the loss is told the key is gone too, not a TTL later."""
    started = time.monotonic()
    lock = cache.lock("capped", ttl=ttl, auto_extend=True, max_hold=max_hold)
    told: list[float] = []
    lock.on_lost(lambda lk: told.append(time.monotonic()))
    lost_at = wait_until(lambda: lock.lost, max_hold + 1)
    assert max_hold <= lost_at - started < max_hold + SLACK, (lost_at - started, lock._loss)
    with pytest.raises(LockLost, match=rf"max_hold of {max_hold:g} s"):
        lock.check()
    wait_until(lambda: told, 1)
    # Another contender takes the key right after the loss (before the fix it had a
    # full TTL left from the renewal before max_hold).
    free_at = wait_until(lambda: _free(cache, "capped"), max_hold + ttl)
    assert free_at - started < max_hold + SLACK, free_at - started
    # Never valid past max_hold, and a manual extend asks for no more than is left.
    assert lock.valid_for() == 0.0


@pytest.mark.slow_variants("server_kind")
def test_a_manual_extend_is_capped_by_max_hold(rcache: Cache, redis_server: RedisServer) -> None:
    lock = rcache.lock("capped-by-hand", ttl=5, auto_extend=True, max_hold=1.0)
    lock.extend(30)
    ms = redis_server.client().pttl(lock_name("capped-by-hand"))
    assert 0 < ms <= 1000, ms
    assert lock.valid_for() <= 1.0
    time.sleep(1.0)
    with pytest.raises(LockLost, match="max_hold"):
        lock.extend(30)


@pytest.mark.slow_variants("server_kind")
def test_a_lost_block_raises_lock_lost_at_once_while_redis_is_blackholed(redis_backend: str, proxy: FaultProxy) -> None:
    """With a reply timeout five times the TTL: leaving the block raises LockLost as soon
    as the loss is known (the release goes on in the background), the block's own
    exception still propagates unchanged, and close() waits at most one reply timeout
    for the background releases."""
    cache = open_cache(redis_backend, proxy.url, timeout=LONG_REPLY_TIMEOUT, connect_timeout=LONG_REPLY_TIMEOUT)
    try:
        lost_at = 0.0
        with pytest.raises(LockLost, match="TTL ran out"), cache.lock("bh-exit", ttl=0.5, auto_extend=True) as lock:
            time.sleep(0.1)
            proxy.blackhole(True)
            lost_at = wait_until(lambda: lock.lost, 3)
        late = time.monotonic() - lost_at
        assert late < 0.05, late  # no I/O on the way out: microseconds, typically
        proxy.blackhole(False)
        with pytest.raises(KeyError), cache.lock("bh-exit-2", ttl=0.5, auto_extend=True) as lock:
            proxy.blackhole(True)
            lost_at = wait_until(lambda: lock.lost, 3)
            raise KeyError("mine")
        assert time.monotonic() - lost_at < 0.05
        started = time.monotonic()
        cache.close()
        assert time.monotonic() - started < LONG_REPLY_TIMEOUT + SLACK
    finally:
        proxy.clear()
        cache.close()


def test_the_release_of_a_lost_block_still_happens_in_the_background(rcache: Cache, redis_server: RedisServer) -> None:
    """A block that ends with its lease known lost sends the release behind its back:
    the key is freed if it still held the lease's token (here: put back from the side
    after the takeover was noticed, as a server that had not yet expired it would)."""
    side = redis_server.client()
    with pytest.raises(LockLost), rcache.lock("bg-release", ttl=0.6, auto_extend=True) as lock:
        held = side.get(lock_name("bg-release"))
        side.delete(lock_name("bg-release"))
        wait_until(lambda: lock.lost, 1)
        side.set(lock_name("bg-release"), held, px=30_000)
    wait_until(lambda: side.exists(lock_name("bg-release")) == 0, 2)


def _free(cache: Cache, key: str) -> bool:
    try:
        cache.lock(key, ttl=5).unlock()
    except LockNotAcquired:
        return False
    return True


def test_a_failing_callback_is_logged_and_the_others_still_run(
    cache: Cache, redis_server: RedisServer, caplog: pytest.LogCaptureFixture
) -> None:
    a = cache.lock("cb-a", ttl=0.3, auto_extend=True)
    b = cache.lock("cb-b", ttl=0.3, auto_extend=True)
    calls: list[str] = []

    def broken(lock: Any) -> None:
        calls.append("broken")
        raise RuntimeError("callback bug")

    a.on_lost(broken)
    a.on_lost(lambda lk: calls.append("a"))
    b.on_lost(lambda lk: calls.append("b"))
    delete_key(cache, redis_server, "cb-a")
    wait_until(lambda: "a" in calls, 1)
    assert calls == ["broken", "a"]
    assert any("on_lost callback of lock 'cb-a' failed" in r.getMessage() for r in caplog.records)
    delete_key(cache, redis_server, "cb-b")  # the renewer lives on for the others
    wait_until(lambda: "b" in calls, 1)
    late: list[str] = []
    a.on_lost(lambda lk: late.append("late"))  # after the loss was told: called at once
    assert late == ["late"]


def test_a_callback_may_unlock_and_lock_without_deadlock(cache: Cache, redis_server: RedisServer) -> None:
    lock = cache.lock("reentrant", ttl=0.3, auto_extend=True)
    taken: list[hotlock.Lock] = []

    def retake(lk: Any) -> None:
        lk.unlock()
        taken.append(cache.lock("reentrant-2", ttl=0.6, auto_extend=True))

    lock.on_lost(retake)
    delete_key(cache, redis_server, "reentrant")
    wait_until(lambda: taken, 1)
    time.sleep(0.5)
    assert not taken[0].lost
    taken[0].unlock()


# -- the renewer never lies -----------------------------------------------------------


@pytest.mark.parametrize("rounds", [10, pytest.param(25, marks=pytest.mark.slow)])
def test_a_release_racing_renewals_leaves_no_key_behind(rcache: Cache, redis_server: RedisServer, rounds: int) -> None:
    """Hammer: short-TTL auto leases released at random moments, renewals in flight all the
    time. No key may outlive its release, and no loss may be told for a released lease.
    Six threads of ``rounds`` leases each: 60 in make test, 150 in make test-slow."""
    lies: list[object] = []
    released: set[hotlock.Lock] = set()  # kept alive, so no id is reused
    errors: list[BaseException] = []

    def worker(n: int) -> None:
        rng = random.Random(n)
        try:
            for i in range(rounds):
                lock = rcache.lock(f"race-{n}-{i}", ttl=0.3, auto_extend=True)
                lock.on_lost(lambda lk: lies.append(lk) if lk in released else None)
                time.sleep(rng.uniform(0, 0.25))  # a renewal every 100 ms: often in flight
                released.add(lock)
                lock.unlock()  # False only if the lease was lost (told) before: a stalled machine
                assert redis_server.client().exists(lock_name(f"race-{n}-{i}")) == 0
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=worker, args=(n,)) for n in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert errors == []
    time.sleep(0.3)  # a late renewal would have recreated or kept a key by now
    assert redis_server.client().keys("hotlock:*") == []
    assert lies == []


def renewer_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name.startswith("hotlock-renewer")]


def test_close_stops_renewing_and_the_leases_expire_by_their_ttl(
    redis_backend: str, redis_url: str, redis_server: RedisServer
) -> None:
    # Another test's cache still open in this worker (a module's fixture) has renewer
    # threads of its own: only the ones this cache starts must end with its close().
    others = set(renewer_threads())
    cache = open_cache(redis_backend, redis_url)
    lock = cache.lock("closing", ttl=0.3, auto_extend=True)
    time.sleep(0.4)
    assert redis_server.client().exists(lock_name("closing")) == 1
    assert set(renewer_threads()) - others  # started: the check below could fail
    closed = time.monotonic()
    cache.close()
    assert set(renewer_threads()) - others == set()
    wait_until(lambda: redis_server.client().exists(lock_name("closing")) == 0, 0.3 + SLACK)
    assert time.monotonic() - closed <= 0.3 + SLACK
    assert lock.lost  # its TTL ran out with no extend confirmed: the work is not protected


def test_a_forked_child_never_renews_an_inherited_lease(rcache: Cache, redis_server: RedisServer) -> None:
    inherited = rcache.lock("inherited", ttl=0.3, auto_extend=True)
    pid = os.fork()
    if pid == 0:  # the child: never return into pytest
        code = 1
        try:
            # The child's own auto lease starts the child's renewer, which must not
            # pick up the inherited one.
            own = rcache.lock("childs-own", ttl=0.6, auto_extend=True)
            time.sleep(1.0)
            code = 0 if (inherited.lost and not own.lost and own.unlock()) else 2
        finally:
            os._exit(code)
    rcache._renewer.close()  # type: ignore[union-attr]  # the parent stops renewing it
    stopped = time.monotonic()
    wait_until(lambda: redis_server.client().exists(lock_name("inherited")) == 0, 0.3 + SLACK)
    assert time.monotonic() - stopped < 0.3 + SLACK  # nobody, the child included, renewed it
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0


@pytest.mark.slow_variants("server_kind")
def test_renewer_errors_are_logged_once_per_lease_and_a_short_outage_is_survived(
    pcache: Cache, proxy: FaultProxy, caplog: pytest.LogCaptureFixture
) -> None:
    locks = pcache.lock_many(["o1", "o2"], ttl=2.0, auto_extend=True)
    time.sleep(0.2)
    caplog.clear()
    proxy.blackhole(True)
    time.sleep(1.2)  # renewal attempts time out (the first at ~0.67 s): retried, not lost
    proxy.blackhole(False)
    time.sleep(1.0)
    assert all(lk is not None and not lk.lost for lk in locks)
    warned = [r.getMessage() for r in caplog.records if "renewing lock" in r.getMessage()]
    assert len(warned) == 1 and "'o1', 'o2'" in warned[0], warned  # once per lease, both in one line
    assert pcache.unlock_many(locks) == [True, True]
    pcache.close()
    with warnings.catch_warnings():
        # redis-py leaves one socket of a connection that timed out mid-NOSCRIPT-recovery
        # to the garbage collector (seen only here): collect it now, quietly, rather than
        # as an unraisable warning inside whichever test runs next.
        warnings.simplefilter("ignore", ResourceWarning)
        gc.collect()


@pytest.mark.slow_variants("server_kind")
def test_blackholed_renewer_loses_the_lease_when_valid_for_reaches_zero(pcache: Cache, proxy: FaultProxy) -> None:
    ttl = 1.0
    lock = pcache.lock("blackholed", ttl=ttl, auto_extend=True)
    told: list[float] = []
    lock.on_lost(lambda lk: told.append(time.monotonic()))
    time.sleep(0.1)
    proxy.blackhole(True)
    # Not lost while valid_for() is positive...
    while lock.valid_for() > 0.02:
        assert not lock.lost
        lock.check()
        time.sleep(0.01)
    # ...and lost at the deadline: on the lease at once, told by the renewer, which woke
    # for it although its round trip was still hanging.
    lost_at = wait_until(lambda: lock.lost, 1)
    deadline = lock._deadline
    assert lost_at - deadline < SLACK, lost_at - deadline
    with pytest.raises(LockLost, match="TTL ran out"):
        lock.check()
    wait_until(lambda: told, 1)
    assert told[0] - deadline < SLACK, told[0] - deadline
    proxy.blackhole(False)


# -- processes --------------------------------------------------------------------------

_PAUSED = r"""
import sys, time, hotlock
cache = hotlock.connect(sys.argv[1], backend=sys.argv[2], timeout=2)
lock = cache.lock("paused-auto", ttl=float(sys.argv[3]), auto_extend=True)
time.sleep(2 * float(sys.argv[3]))          # renewed meanwhile
print("held" if not lock.lost else "lost-early", flush=True)
sys.stdin.readline()                         # SIGSTOPped around here, then resumed
try:
    lock.check()
except hotlock.LockLost:
    print("LockLost", lock.lost, flush=True)
else:
    print("held", lock.lost, flush=True)
"""


@pytest.mark.slow_variants("server_kind")
def test_a_paused_holder_finds_its_auto_extended_lease_lost_on_resume(
    redis_backend: str, rcache: Cache, redis_url: str
) -> None:
    ttl = 0.5
    cmd = [sys.executable, "-c", _PAUSED, redis_url, redis_backend, str(ttl)]
    with subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True) as proc:
        try:
            assert proc.stdout is not None and proc.stdin is not None
            assert proc.stdout.readline().strip() == "held"
            os.kill(proc.pid, signal.SIGSTOP)  # the renewer stops with it
            other = rcache.lock_wait("paused-auto", ttl=30, wait=ttl + 1)  # expired: taken
            os.kill(proc.pid, signal.SIGCONT)
            proc.stdin.write("go\n")
            proc.stdin.flush()
            assert proc.stdout.readline().strip() == "LockLost True"
            assert proc.wait(10) == 0
            assert other.valid_for() > 25 and other.unlock() is True  # never extended or released by the old holder
        finally:
            if proc.poll() is None:
                proc.kill()


# -- soak -------------------------------------------------------------------------------

SOAK_TTL = 1.0
SOAK_WORK = 3.0  # three TTLs of work per section: only the renewer keeps it exclusive


def _soak_worker(url: str, backend: str, checker: OverlapChecker, keys: int, seconds: float, seed: int) -> None:
    cache = hotlock.connect(url, backend=backend, timeout=0.5)
    rng = random.Random(seed)
    end = time.monotonic() + seconds
    lost = 0
    while time.monotonic() < end:
        key = rng.randrange(keys)
        try:
            lock = cache.lock_wait(f"soak-{key}", ttl=SOAK_TTL, wait=0.5, auto_extend=True)
        except LockNotAcquired:
            continue
        checker.enter(key)
        try:
            work_end = time.monotonic() + SOAK_WORK
            while time.monotonic() < work_end:
                lock.check()  # a lost lease leaves its section at once
                time.sleep(0.01)
        except LockLost:
            lost += 1
        finally:
            checker.exit(key)
            lock.unlock()
    cache.close()
    os._exit(0 if lost == 0 else 3)


def run_soak(url: str, backend: str, seconds: float, processes: int = 4, keys: int = 2) -> OverlapChecker:
    checker = OverlapChecker(keys)
    ctx = mp.get_context("fork")
    procs = [ctx.Process(target=_soak_worker, args=(url, backend, checker, keys, seconds, n)) for n in range(processes)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(seconds + 30)
        assert p.exitcode == 0, "a worker saw its lease lost (exit 3) or failed"
    return checker


# 8 s of TTLs on each kind: on Redis in make test; the Valkey run, with the long soak, in
# make test-slow (the renewer's extend on Valkey is shown by the tests above).
@pytest.mark.slow_variants("server_kind")
def test_soak_auto_extended_holders_never_overlap(redis_backend: str, redis_url: str) -> None:
    # ~8 s: 2 keys, 4 processes, each section 3 s on a 1 s TTL.
    checker = run_soak(redis_url, redis_backend, seconds=8.0)
    assert checker.sections >= 4
    assert checker.overlaps == 0


@pytest.mark.slow
def test_soak_long_auto_extended_holders_never_overlap(redis_backend: str, redis_url: str) -> None:
    checker = run_soak(redis_url, redis_backend, seconds=55.0, processes=6, keys=3)
    assert checker.sections >= 40
    assert checker.overlaps == 0


# The checker's self-test: one backend on one server kind shows it in make test.
@pytest.mark.slow_variants("redis_backend", "server_kind")
def test_the_soak_checker_catches_holders_without_auto_extend(redis_backend: str, redis_url: str) -> None:
    """The same work on plain 1 s leases outlives them: the checker must see the overlaps."""
    checker = OverlapChecker(1)
    ctx = mp.get_context("fork")

    def plain(n: int) -> None:
        cache = hotlock.connect(redis_url, backend=redis_backend, timeout=0.5)
        end = time.monotonic() + 4.0
        while time.monotonic() < end:
            try:
                lock = cache.lock_wait("plain-soak", ttl=SOAK_TTL, wait=0.5)
            except LockNotAcquired:
                continue
            checker.enter(0)
            time.sleep(SOAK_WORK / 2)
            checker.exit(0)
            lock.unlock()
        os._exit(0)

    procs = [ctx.Process(target=plain, args=(n,)) for n in range(3)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(30)
    assert checker.overlaps > 0


# -- metrics ----------------------------------------------------------------------------


class Recorder:
    """A metrics listener that records (event, key) for every event (connect(metrics=...))."""

    def __init__(self) -> None:
        self.events: list[tuple[str, object]] = []

    def __getattr__(self, name: str) -> Any:
        return lambda key, *rest: self.events.append((name, key))


def test_renewals_and_their_losses_reach_the_metrics_listener(
    backend: str, redis_url: str, redis_server: RedisServer
) -> None:
    recorder = Recorder()
    cache = open_cache(backend, redis_url, metrics=recorder)
    try:
        lock = cache.lock("metered", ttl=0.6, auto_extend=True)
        time.sleep(0.5)  # one renewal
        assert ("extended", "metered") in recorder.events
        delete_key(cache, redis_server, "metered")
        wait_until(lambda: ("lost", "metered") in recorder.events, 1)
        assert lock.lost
        assert lock.unlock() is False  # found lost again: not counted again
        # A loss by max_hold is counted too, and a block that ends with it counts nothing more.
        with pytest.raises(LockLost), cache.lock("held-long", ttl=0.3, auto_extend=True, max_hold=0.4) as capped:
            wait_until(lambda: capped.lost, 2)
        assert ("released", "held-long") not in recorder.events
    finally:
        cache.close()
    assert recorder.events.count(("lost", "metered")) == 1
    assert recorder.events.count(("lost", "held-long")) == 1


@pytest.mark.slow_variants("server_kind")
def test_every_kind_of_loss_reaches_the_prometheus_counters_once(
    rcache: Cache, redis_backend: str, proxy: FaultProxy
) -> None:
    """Takeover, deadline (Redis unreachable) and max_hold: hotlock_lost_total counts each lease once."""
    from prometheus_client import CollectorRegistry

    from hotlock.metrics import PrometheusMetrics

    registry = CollectorRegistry()
    cache = open_cache(redis_backend, proxy.url, timeout=LONG_REPLY_TIMEOUT, metrics=PrometheusMetrics(registry))
    try:
        with pytest.raises(LockLost), cache.lock("taken", ttl=0.6, auto_extend=True) as taken:
            rcache._backend.release(taken._name, taken._token)  # deleted behind its back
            rcache.lock("taken", ttl=5)  # ...and taken over
            wait_until(lambda: taken.lost, 2)
        with pytest.raises(LockLost), cache.lock("capped", ttl=0.3, auto_extend=True, max_hold=0.4) as capped:
            wait_until(lambda: capped.lost, 2)
        with pytest.raises(LockLost), cache.lock("deadline", ttl=0.6, auto_extend=True) as unconfirmed:
            proxy.blackhole(True)
            wait_until(lambda: unconfirmed.lost, 2)
        assert registry.get_sample_value("hotlock_lost_total") == 3
    finally:
        proxy.clear()
        cache.close()
    assert registry.get_sample_value("hotlock_lost_total") == 3
