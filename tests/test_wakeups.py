"""Waiters woken by the release (docs/architecture.md), on the sync Redis backends.

A waiting attempt marks the holder's value with a trailing '+'; the release of a marked
value publishes on <prefix>wake:{K}; the cache's one subscriber wakes a waiter, which
retries at once. The backoff stays the safety net. Bounds here are loose (a loaded CI
machine must pass them); the exact figures are in the bench (python -m bench --only handoff).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import multiprocessing
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

import hotlock
import hotlock.aio
from hotlock import _backoff
from hotlock._cli._target import fence_of
from hotlock._config import parse_url
from hotlock._keys import wake_channel
from hotlock.aio import AsyncCache
from hotlock.backends.cluster import key_slot
from hotlock.backends.wakeup import Wakeups

from .cluster import Cluster
from .conftest import RedisServer, lock_name, open_cache, start_redis
from .faultproxy import FaultProxy
from .overlap import OverlapChecker
from .test_aio import Aio
from .test_aio import loop_kind as loop_kind  # a fixture
from .test_aio import raio as raio  # a fixture
from .test_cluster import keys_on
from .test_faults import restart
from .test_security import tls_server as tls_server  # a fixture
from .test_sentinel import SERVICE, TIMEOUT, Topology, _check_resumed, _lock_until_on_new_primary
from .test_sentinel import topology as topology  # a fixture

CAP_S = _backoff.CAP_MS / 1000.0
USER = "hotlock_wake"
PASSWORD = "pw-wake-9"
# What the key operations need on either path (tests/test_security.py has the lists).
COMMANDS = [
    *("+evalsha", "+script|load", "+multi", "+exec"),
    *("+get", "+set", "+pttl", "+pexpire", "+del", "+time", "+info"),
]
VALKEY_EXTRA = ["+delifeq", "+command|info"]
# The wake-up entries: the channel pattern and the commands.
WAKE_ACL = ["&hotlock:*", "+publish", "+subscribe", "+unsubscribe"]


def calls(server: RedisServer, command: str) -> int:
    """How many times the server ran ``command``, scripts' calls included (INFO commandstats)."""
    entry = server.client().info("commandstats").get(f"cmdstat_{command}")
    return int(entry["calls"]) if entry else 0


def hub_of(cache: hotlock.Cache) -> object:
    return cache._backend._wakeups._hub  # type: ignore[attr-defined]


def subscribed(cache: hotlock.Cache, key: str, timeout: float = 5.0) -> None:
    """Wait until the cache's subscriber has the key's channel confirmed."""
    channel = wake_channel(lock_name(key))
    deadline = time.monotonic() + timeout
    while True:
        hub = hub_of(cache)
        if hub is not None and hub.subscribed(channel) is not None:  # type: ignore[attr-defined]
            return
        assert time.monotonic() < deadline, "the key's channel was never subscribed"
        time.sleep(0.005)


# A woken waiter holds the lock about one round trip after the release (under 1 ms typical
# under make test's load, a few ms on a loaded machine). A polling one, its backoff at the
# 50 ms cap, finds the free key a random part of a sleep later: 15 ms or more in about half
# the rounds (median about 13 ms). So a set of WOKEN_ROUNDS handoffs passes when at most a
# quarter of them take 15 ms or more: polling alone passes that about 4% of the time per
# set, a wake-up slowed eightfold by load fails it under 1%. HOLD_S keeps the key long
# enough that the waiter's backoff has reached its cap before the release.
WOKEN_ROUNDS = 20
HOLD_S = 0.1
WOKEN_S = 0.015


def assert_woken(took: list[float], where: object = None) -> None:
    """Fails unless the handoffs in ``took`` were wake-ups rather than polling (see above)."""
    assert len(took) == WOKEN_ROUNDS, took
    slow = [round(t * 1000, 1) for t in took if t >= WOKEN_S]
    assert len(slow) <= WOKEN_ROUNDS // 4, (where, "handoffs of 15 ms or more (ms):", slow, "of", len(took))


def handoffs(holder: hotlock.Cache, waiter: hotlock.Cache, key: str, rounds: int, hold: float) -> list[float]:
    """Release -> the waiting thread holding the lock, in seconds, ``rounds`` times. The
    holder keeps the key ``hold`` seconds, so the waiter's backoff has reached its cap."""
    out: list[float] = []
    for _ in range(rounds):
        lock = holder.lock(key, ttl=30)
        got: list[float] = []
        running = threading.Event()

        def wait(got: list[float] = got, running: threading.Event = running) -> None:
            running.set()
            lk = waiter.lock_wait(key, ttl=30, wait=10)
            got.append(time.monotonic())
            lk.unlock()

        t = threading.Thread(target=wait)
        t.start()
        # The hold counts from the waiter thread's start: on a loaded machine a thread may
        # start late, and a waiter that first tries after the release is never woken.
        assert running.wait(10), "the waiter thread did not start"
        time.sleep(hold)
        released = time.monotonic()
        lock.unlock()
        t.join(15)
        assert got, "the waiter did not get the lock"
        out.append(got[0] - released)
    return out


def test_a_waiter_is_woken_by_the_release(redis_backend: str, redis_url: str, redis_server: RedisServer) -> None:
    """Woken, not polled (assert_woken: a wake-up takes about one round trip, polling at
    the 50 ms cap about 17 ms on average). And the release that woke it published, once
    per round."""
    with open_cache(redis_backend, redis_url) as holder, open_cache(redis_backend, redis_url) as waiter:
        handoffs(holder, waiter, "woken", 1, 0.05)  # subscribes the key
        published = calls(redis_server, "publish")
        took = handoffs(holder, waiter, "woken", WOKEN_ROUNDS, HOLD_S)
        assert_woken(took)
        assert max(took) < CAP_S + 0.5, took  # never past the safety net (plus scheduling slack)
        assert calls(redis_server, "publish") - published >= WOKEN_ROUNDS


def test_an_uncontended_release_publishes_nothing(
    redis_backend: str, redis_url: str, redis_server: RedisServer
) -> None:
    with open_cache(redis_backend, redis_url) as cache:
        handoffs(cache, cache, "hot", 1, 0.05)  # a subscriber exists, the key is subscribed
        published, evalsha = calls(redis_server, "publish"), calls(redis_server, "evalsha")
        execs = calls(redis_server, "exec")
        for _ in range(20):
            cache.lock("hot", ttl=5).unlock()
            cache.lock_wait("hot", ttl=5, wait=1).unlock()
            assert redis_server.client().get(lock_name("hot")) is None
        assert calls(redis_server, "publish") == published
        # Each acquire one transaction (EXEC), or one EVALSHA on a backend that takes a free
        # key by script; each release one command (EVALSHA, or DELIFEQ on Valkey).
        acquires = 40 - (calls(redis_server, "exec") - execs)
        assert acquires in (0, 40)
        assert calls(redis_server, "evalsha") - evalsha == acquires + (0 if redis_server.lua_free else 40)


def test_a_token_ending_in_plus_is_not_taken_for_a_waiters_mark(
    redis_backend: str, redis_url: str, redis_server: RedisServer
) -> None:
    """A plain lock's value is its token, whose last byte is random: one byte in 256 is the
    '+' of a waiter's mark. Such a token is not marked: its release publishes nothing, and
    a waiter still marks it (then its release wakes)."""
    side = redis_server.client()
    token = b"t" * 15 + b"+"
    name = lock_name("plus")
    with open_cache(redis_backend, redis_url) as cache:
        backend = cache._backend
        assert backend.acquire(name, token, 5000) > 0
        published = calls(redis_server, "publish")
        assert backend.release(name, token) is True
        assert calls(redis_server, "publish") == published
        assert backend.acquire(name, token, 5000) > 0
        other = b"o" * 16
        # A waiting attempt (ACQUIRE_WAIT) marks the holder's value.
        assert backend.acquire_wait(name, other, 5000, 10)[0] < 0
        assert side.get(name) == token + b"+"
        assert backend.release(name, token) is True
        assert calls(redis_server, "publish") == published + 1


def test_a_marked_lock_extends_releases_and_keeps_its_fence(
    redis_backend: str, redis_url: str, redis_server: RedisServer
) -> None:
    """The '+' a waiter leaves: extend and release still recognise the lock (script and
    Lua-free paths), the release publishes on the key's channel, the CLI reads no fence
    into it (a plain lock's value is its token alone)."""
    side = redis_server.client()
    with open_cache(redis_backend, redis_url) as cache:
        lock = cache.lock("marked", ttl=5)
        name = lock_name("marked")
        side.set(name, side.get(name) + b"+", keepttl=True)
        value = side.get(name)
        assert value == lock._token + b"+" and fence_of(len(value), value[16:]) is None
        lock.extend(20)
        assert 19_000 < side.pttl(name) <= 20_000
        assert cache.extend_many([lock], 20) == [True]
        published = calls(redis_server, "publish")
        assert lock.unlock() is True
        assert side.get(name) is None
        assert calls(redis_server, "publish") == published + 1
        # Batched too.
        locks = cache.lock_many(["m1", "m2"], ttl=5)
        side.set(lock_name("m1"), side.get(lock_name("m1")) + b"+", keepttl=True)
        assert cache.extend_many(locks, 5) == [True, True]
        assert cache.unlock_many(locks) == [True, True]
        assert side.keys("hotlock:lock:*") == []
        # Someone else's marked value is never ours.
        other = cache.lock("theirs", ttl=5)
        side.set(lock_name("theirs"), b"x" * 16 + b"123+", keepttl=True)
        assert other.unlock() is False
        assert side.get(lock_name("theirs")) == b"x" * 16 + b"123+"


def test_a_dropped_wake_up_still_acquires_within_the_backoff_cap(
    redis_backend: str, redis_url: str, redis_server: RedisServer
) -> None:
    """The subscriber's connection goes through a fault proxy that drops the message: the
    waiter's backoff (capped at 50 ms) finds the free key, long before its 10 s deadline."""
    with FaultProxy(redis_server.port) as proxy, open_cache(redis_backend, redis_url) as cache:
        # The subscriber (only) connects through the proxy.
        config = parse_url(proxy.url, connect_timeout=2.0, timeout=2.0)
        cache._backend._wakeups._make = lambda: Wakeups(config)  # type: ignore[attr-defined]
        handoffs(cache, cache, "dropped", 1, 0.05)
        subscribed(cache, "dropped")
        lock = cache.lock("dropped", ttl=30)
        got: list[float] = []

        def wait() -> None:
            got.append(time.monotonic())
            cache.lock_wait("dropped", ttl=30, wait=10).unlock()
            got.append(time.monotonic())

        t = threading.Thread(target=wait)
        t.start()
        time.sleep(0.3)
        marked = time.monotonic() + 10  # the waiter has marked the value: the release publishes
        while not redis_server.client().get(lock_name("dropped")).endswith(b"+"):
            assert time.monotonic() < marked, "the waiter never marked the holder's value"
            time.sleep(0.01)
        proxy.drop_replies(1)  # only the subscriber's connection passes the proxy
        released = time.monotonic()
        lock.unlock()
        t.join(15)
        # The proxy's own thread may not have read the message yet when the waiter, polling,
        # already has the lock: give it a moment, then the message must have been swallowed.
        deadline = time.monotonic() + 5
        while proxy.dropped_replies == 0 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert proxy.dropped_replies == 1
        assert len(got) == 2
        assert got[1] - released < CAP_S + 1.0  # the cap, plus scheduling slack: not the deadline


def _waiters_in_child(url: str, backend: str, checker: OverlapChecker, threads: int, errors: object) -> None:
    cache = hotlock.connect(url, backend=backend)
    failed: list[BaseException] = []

    def one() -> None:
        try:
            lock = cache.lock_wait("crowd", ttl=30, wait=60)
            checker.enter(0)
            time.sleep(0.0005)
            checker.exit(0)
            lock.unlock()
        except BaseException as exc:  # reported to the parent
            failed.append(exc)

    pool = [threading.Thread(target=one) for _ in range(threads)]
    for t in pool:
        t.start()
    for t in pool:
        t.join(90)
    cache.close()
    errors.value += len(failed) + sum(t.is_alive() for t in pool)  # type: ignore[attr-defined]


def test_200_waiters_on_one_key_all_get_their_turn_with_no_overlap(redis_backend: str, redis_url: str) -> None:
    """4 processes x 50 threads wait on one key held at the start: each gets it once (each
    wake wakes one waiter per process, the chain passes it on), and no two hold it at once."""
    ctx = multiprocessing.get_context("fork")
    checker = OverlapChecker(1)
    errors = ctx.Value("i", 0)
    with open_cache(redis_backend, redis_url) as cache:
        first = cache.lock("crowd", ttl=30)
        procs = [
            ctx.Process(target=_waiters_in_child, args=(redis_url, redis_backend, checker, 50, errors))
            for _ in range(4)
        ]
        for p in procs:
            p.start()
        time.sleep(0.5)
        first.unlock()
        for p in procs:
            p.join(120)
            assert p.exitcode == 0
    assert errors.value == 0
    assert checker.sections == 200
    assert checker.overlaps == 0


@pytest.fixture
def acl_url(redis_server: RedisServer) -> Iterator[tuple[str, list[str]]]:
    """A restricted user's URL, and the commands it has (set by the test)."""
    commands = COMMANDS + (VALKEY_EXTRA if redis_server.kind == "valkey" else [])
    yield f"redis://{USER}:{PASSWORD}@127.0.0.1:{redis_server.port}/0", commands
    redis_server.client().execute_command("ACL", "DELUSER", USER)


@pytest.mark.parametrize("granted", ["none", "commands-only", "channel-only"])
def test_acl_without_channel_rights_falls_back_to_polling_said_once(
    redis_backend: str,
    redis_url: str,
    redis_server: RedisServer,
    acl_url: tuple[str, list[str]],
    granted: str,
    caplog: pytest.LogCaptureFixture,
) -> None:
    url, commands = acl_url
    extra = {"none": [], "commands-only": WAKE_ACL[1:], "channel-only": WAKE_ACL[:1]}[granted]
    redis_server.client().execute_command(
        "ACL", "SETUSER", USER, "reset", "on", f">{PASSWORD}", "resetkeys", "~hotlock:*", "resetchannels",
        "-@all", *commands, *extra,
    )  # fmt: skip
    caplog.set_level(logging.INFO, logger="hotlock")
    with open_cache(redis_backend, url) as cache, open_cache(redis_backend, redis_url) as holder:
        took = handoffs(holder, cache, "acl", 3, 0.1)
        assert all(t < CAP_S + 1.0 for t in took), took  # polling: within the cap
        assert hub_of(cache).off is not None  # type: ignore[attr-defined]
    said = [r for r in caplog.records if "wake-ups are off" in r.getMessage()]
    assert len(said) == 1, [r.getMessage() for r in said]
    assert said[0].levelno == logging.WARNING


def test_acl_with_the_wake_up_entries_is_woken(
    redis_backend: str, redis_server: RedisServer, acl_url: tuple[str, list[str]], caplog: pytest.LogCaptureFixture
) -> None:
    url, commands = acl_url
    redis_server.client().execute_command(
        "ACL", "SETUSER", USER, "reset", "on", f">{PASSWORD}", "resetkeys", "~hotlock:*", "resetchannels",
        "-@all", *commands, *WAKE_ACL,
    )  # fmt: skip
    caplog.set_level(logging.INFO, logger="hotlock")
    with open_cache(redis_backend, url) as cache:
        handoffs(cache, cache, "acl-ok", 1, 0.05)
        took = handoffs(cache, cache, "acl-ok", WOKEN_ROUNDS, HOLD_S)
        assert_woken(took)
        assert hub_of(cache).off is None  # type: ignore[attr-defined]
    assert "wake-ups are off" not in caplog.text


@pytest.fixture
def own_server(server_kind: str) -> Iterator[RedisServer]:
    server = start_redis(kind=server_kind)
    yield server
    server.stop()


@pytest.mark.slow_variants("server_kind")
def test_the_subscriber_survives_a_server_restart(redis_backend: str, own_server: RedisServer) -> None:
    with open_cache(redis_backend, own_server.url, timeout=0.5) as cache:
        handoffs(cache, cache, "restarted", 2, 0.05)
        restart(own_server)
        cache.lock("warm-up", ttl=5).unlock()  # the lock connection reconnects (a lost-reply retry)
        subscribed(cache, "restarted")  # the subscriber is back and subscribed again
        took = handoffs(cache, cache, "restarted", WOKEN_ROUNDS, HOLD_S)
        assert_woken(took)
        assert calls(own_server, "publish") >= WOKEN_ROUNDS


def test_wakeups_false_polls_with_no_subscriber(
    redis_backend: str, redis_url: str, redis_server: RedisServer, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="hotlock")
    with pytest.raises(TypeError, match="wakeups must be a bool"):
        hotlock.connect(redis_url, backend=redis_backend, wakeups=1)  # type: ignore[arg-type]
    with open_cache(redis_backend, redis_url, wakeups=False) as cache:
        assert cache._backend._wakeups is None  # type: ignore[attr-defined]
        published = calls(redis_server, "publish")
        took = handoffs(cache, cache, "polled", 3, 0.1)
        assert all(t < CAP_S + 1.0 for t in took), took
        # Nobody marked the value: the releases published nothing.
        assert calls(redis_server, "publish") == published
        assert not [t for t in threading.enumerate() if t.name == "hotlock-wakeups"]
    assert caplog.text.count("wake-ups off (connect(wakeups=False))") == 1


def _child_waits(cache: hotlock.Cache, parent_hub_id: int, out: object) -> None:
    handoffs(cache, cache, "forked", 3, 0.05)
    hub = hub_of(cache)
    out.value = int(id(hub) != parent_hub_id and hub.pid != 0)  # type: ignore[attr-defined]


@pytest.mark.slow_variants("server_kind")
def test_a_forked_child_never_uses_its_parents_subscriber(
    redis_backend: str, redis_url: str, redis_server: RedisServer
) -> None:
    ctx = multiprocessing.get_context("fork")
    with open_cache(redis_backend, redis_url) as cache:
        handoffs(cache, cache, "forked", 2, 0.05)
        parent_hub = hub_of(cache)
        before = redis_server.client().execute_command("CLIENT", "LIST", "TYPE", "pubsub")
        out = ctx.Value("i", -1)
        p = ctx.Process(target=_child_waits, args=(cache, id(parent_hub), out))
        p.start()
        p.join(60)
        assert p.exitcode == 0 and out.value == 1
        # The parent's subscriber still works: woken, not polled.
        assert hub_of(cache) is parent_hub
        took = handoffs(cache, cache, "forked", WOKEN_ROUNDS, HOLD_S)
        assert_woken(took)
        after = redis_server.client().execute_command("CLIENT", "LIST", "TYPE", "pubsub")
        assert len(before.splitlines()) == len(after.splitlines())  # the child's own came and went


# -- the async API (hotlock.backends.wakeup_async): the same promises on asyncio and uvloop -----------


async def async_handoffs(holder: AsyncCache, waiter: AsyncCache, key: str, rounds: int, hold: float) -> list[float]:
    """handoffs() for the async API: a waiting task, the holder's release, the time between."""
    out: list[float] = []
    for _ in range(rounds):
        lock = await holder.lock(key, ttl=30)
        got: list[float] = []

        async def wait(got: list[float] = got) -> None:
            lk = await waiter.lock_wait(key, ttl=30, wait=10)
            got.append(time.monotonic())
            await lk.unlock()

        task = asyncio.ensure_future(wait())
        await asyncio.sleep(hold)
        released = time.monotonic()
        await lock.unlock()
        await asyncio.wait_for(task, 15)
        out.append(got[0] - released)
    return out


def test_async_a_waiter_is_woken_by_the_release(raio: Aio) -> None:
    async def main() -> None:
        published = calls(raio.server, "publish")
        async with await raio.connect() as holder, await raio.connect() as waiter:
            await async_handoffs(holder, waiter, "a-woken", 1, 0.05)
            took = await async_handoffs(holder, waiter, "a-woken", WOKEN_ROUNDS, HOLD_S)
            assert_woken(took)
            assert max(took) < CAP_S + 0.5, took
        assert calls(raio.server, "publish") - published >= WOKEN_ROUNDS

    raio.run(main())


def test_async_an_uncontended_release_publishes_nothing(raio: Aio) -> None:
    async def main() -> None:
        async with await raio.connect() as cache:
            await async_handoffs(cache, cache, "a-hot", 1, 0.05)
            published = calls(raio.server, "publish")
            for _ in range(20):
                await (await cache.lock("a-hot", ttl=5)).unlock()
                await (await cache.lock_wait("a-hot", ttl=5, wait=1)).unlock()
            assert calls(raio.server, "publish") == published

    raio.run(main())


def test_async_200_waiting_tasks_on_one_key_with_no_overlap(raio: Aio) -> None:
    async def main() -> None:
        inside = overlaps = done = 0
        async with await raio.connect() as cache, await raio.connect() as other:
            first = await cache.lock("a-crowd", ttl=30)

            async def one(c: AsyncCache) -> None:
                nonlocal inside, overlaps, done
                lock = await c.lock_wait("a-crowd", ttl=30, wait=60)
                inside += 1
                overlaps += inside > 1
                await asyncio.sleep(0.0005)
                inside -= 1
                await lock.unlock()
                done += 1

            tasks = [asyncio.ensure_future(one(cache if i % 2 else other)) for i in range(200)]
            await asyncio.sleep(0.3)
            await first.unlock()
            await asyncio.wait_for(asyncio.gather(*tasks), 120)
        assert done == 200 and overlaps == 0

    raio.run(main())


def test_async_wakeups_false_and_acl_fall_back_to_polling(
    raio: Aio, acl_url: tuple[str, list[str]], caplog: pytest.LogCaptureFixture
) -> None:
    url, commands = acl_url
    raio.server.client().execute_command(
        "ACL", "SETUSER", USER, "reset", "on", f">{PASSWORD}", "resetkeys", "~hotlock:*", "resetchannels",
        "-@all", *commands,
    )  # fmt: skip
    caplog.set_level(logging.INFO, logger="hotlock")

    async def main() -> None:
        published = calls(raio.server, "publish")
        async with await raio.connect(wakeups=False) as cache:
            assert cache._backend.wake_slot is None  # type: ignore[attr-defined]
            took = await async_handoffs(cache, cache, "a-polled", 3, 0.1)
            assert all(t < CAP_S + 1.0 for t in took), took
        assert calls(raio.server, "publish") == published
        async with (
            await hotlock.aio.connect(url, backend=raio.backend) as refused,
            await raio.connect() as holder,
        ):
            took = await async_handoffs(holder, refused, "a-acl", 3, 0.1)
            assert all(t < CAP_S + 1.0 for t in took), took
            assert refused._backend.wake_slot._hub.off is not None  # type: ignore[attr-defined]

    raio.run(main())
    assert caplog.text.count("wake-ups off (connect(wakeups=False))") == 1
    assert len([r for r in caplog.records if "wake-ups are off" in r.getMessage()]) == 1


@pytest.mark.slow_variants("server_kind")
def test_async_the_subscriber_survives_a_server_restart(raio: Aio, own_server: RedisServer) -> None:
    async def main() -> None:
        async with await hotlock.aio.connect(own_server.url, backend=raio.backend, timeout=0.5) as cache:
            await async_handoffs(cache, cache, "a-restarted", 2, 0.05)
            restart(own_server)
            with contextlib.suppress(hotlock.CacheError):
                await (await cache.lock("warm-up", ttl=5)).unlock()
            channel = wake_channel(lock_name("a-restarted"))
            deadline = time.monotonic() + 5
            slot = cache._backend.wake_slot  # type: ignore[attr-defined]
            while slot._hub.subscribed(channel) is None:
                assert time.monotonic() < deadline, "never subscribed again"
                await asyncio.sleep(0.005)
            took = await async_handoffs(cache, cache, "a-restarted", WOKEN_ROUNDS, HOLD_S)
            assert_woken(took)

    raio.run(main())


# -- Sentinel: the subscriber follows the primary ------------------------------------------


def _pubsub_clients(topology: Topology, port: int) -> int:
    return len(topology.node(port).execute_command("CLIENT", "LIST", "TYPE", "pubsub").splitlines())


@pytest.mark.slow_variants("server_kind")
def test_sentinel_waiters_are_woken_before_and_after_a_failover(redis_backend: str, topology: Topology) -> None:
    old = topology.primary_port()
    with hotlock.connect(topology.url, backend=redis_backend, timeout=TIMEOUT, connect_timeout=TIMEOUT) as cache:
        handoffs(cache, cache, "s-woken", 1, 0.05)
        assert_woken(handoffs(cache, cache, "s-woken", WOKEN_ROUNDS, HOLD_S))
        with topology.sentinel() as s:
            s.execute_command("SENTINEL", "FAILOVER", SERVICE)
        _check_resumed(_lock_until_on_new_primary(cache, topology, old, budget=15))
        new = topology.primary_port()
        deadline = time.monotonic() + 10
        while _pubsub_clients(topology, new) == 0:  # the subscriber moved to the new primary
            assert time.monotonic() < deadline, "the subscriber never reconnected to the new primary"
            time.sleep(0.05)
        subscribed(cache, "s-woken")
        assert_woken(handoffs(cache, cache, "s-woken", WOKEN_ROUNDS, HOLD_S))


@pytest.mark.slow_variants("server_kind")
def test_async_sentinel_waiters_are_woken_after_a_failover(loop_kind: str, topology: Topology) -> None:
    backends = [b for b in ("native", "redis-py") if b != "native" or hotlock.aio.backend_info()["backend"] == "native"]
    old = topology.primary_port()
    with topology.sentinel() as s:
        s.execute_command("SENTINEL", "FAILOVER", SERVICE)
    deadline = time.monotonic() + 15
    while topology.primary_port() == old:
        assert time.monotonic() < deadline, "no failover"
        time.sleep(0.05)
    time.sleep(1.0)  # the sentinels' switch settles

    async def main() -> None:
        for backend in backends:
            async with await hotlock.aio.connect(topology.url, backend=backend, timeout=TIMEOUT) as cache:
                await async_handoffs(cache, cache, "as-woken", 1, 0.05)
                took = await async_handoffs(cache, cache, "as-woken", WOKEN_ROUNDS, HOLD_S)
                assert_woken(took, backend)

    Aio("redis-py", loop_kind, topology.url, topology.primary).run(main())


# -- TLS: the subscriber checks the certificate and the name, as the lock connections do --


def test_rediss_waiters_are_woken(tls_server: tuple[int, Path], monkeypatch: pytest.MonkeyPatch) -> None:
    port, ca = tls_server
    monkeypatch.setenv("SSL_CERT_FILE", str(ca))
    url = f"rediss://localhost:{port}/0"
    with hotlock.connect(url, timeout=2) as cache:
        handoffs(cache, cache, "tls-woken", 1, 0.05)
        subscribed(cache, "tls-woken")
        assert_woken(handoffs(cache, cache, "tls-woken", WOKEN_ROUNDS, HOLD_S))

    async def main() -> None:
        for backend in ("native", "redis-py"):
            async with await hotlock.aio.connect(url, backend=backend, timeout=2) as acache:
                await async_handoffs(acache, acache, "atls-woken", 1, 0.05)
                took = await async_handoffs(acache, acache, "atls-woken", WOKEN_ROUNDS, HOLD_S)
                assert_woken(took, backend)

    asyncio.run(main())


# -- Redis Cluster: sharded pub/sub, one subscriber connection per primary -----------------


def _cluster_calls(cluster: Cluster, command: str) -> dict[int, int]:
    out = {}
    for port in cluster.primary_ports():
        entry = cluster.client(port).info("commandstats").get(f"cmdstat_{command}")
        out[port] = int(entry["calls"]) if entry else 0
    return out


def test_cluster_waiters_are_woken_by_sharded_pub_sub(redis_backend: str, redis_cluster: Cluster) -> None:
    """On every shard: woken (a handoff well under the cap), each release announced by
    SPUBLISH on the lock's own shard, never a cluster-wide PUBLISH."""
    url = redis_cluster.url
    redis_cluster.flush()
    with hotlock.connect(url, backend=redis_backend) as cache:
        for port in redis_cluster.primary_ports():
            key = keys_on(redis_cluster, port, 1, prefix="wake-")[0]
            handoffs(cache, cache, key, 1, 0.05)
            spublish, publish = _cluster_calls(redis_cluster, "spublish"), _cluster_calls(redis_cluster, "publish")
            took = handoffs(cache, cache, key, WOKEN_ROUNDS, HOLD_S)
            assert_woken(took, port)
            after = _cluster_calls(redis_cluster, "spublish")
            assert after[port] - spublish[port] >= WOKEN_ROUNDS
            assert all(after[p] == spublish[p] for p in after if p != port)
            assert _cluster_calls(redis_cluster, "publish") == publish
        hub = cache._backend._wakeups._hub  # type: ignore[attr-defined]
        assert len(hub._nodes) == len(redis_cluster.primary_ports())  # one subscriber per primary


def test_cluster_a_moved_slot_still_acquires_within_the_cap(redis_backend: str, redis_cluster: Cluster) -> None:
    """The waited-on key's slot moves to another primary while it is subscribed: the old
    node unsubscribes the channel, the waiters poll (the safety net), and the next waits
    join the new owner and are woken again."""
    redis_cluster.flush()
    ports = redis_cluster.primary_ports()
    key = keys_on(redis_cluster, ports[0], 1, prefix="moving-")[0]
    slot = key_slot(lock_name(key))
    with hotlock.connect(redis_cluster.url, backend=redis_backend) as cache:
        try:
            handoffs(cache, cache, key, 2, 0.05)
            redis_cluster.move_slot(slot, ports[1])
            took = handoffs(cache, cache, key, 3, 0.1)
            assert all(t < CAP_S + 1.0 for t in took), took
            took = handoffs(cache, cache, key, WOKEN_ROUNDS, HOLD_S)
            assert_woken(took)
        finally:
            redis_cluster.move_slot(slot, ports[0])


# uvloop's waiters are woken on one server by the tests above; on the cluster that is
# make test-slow's, and so is the Valkey cluster's run: make test wakes the sync waiters on
# it (above) and async ones through test_cluster_dialect's Lua-free release.
@pytest.mark.slow_variants("loop_kind", "server_kind")
def test_async_cluster_waiters_are_woken_by_sharded_pub_sub(
    redis_backend: str, loop_kind: str, redis_cluster: Cluster
) -> None:
    """The async API on a cluster: on every shard a waiting task is woken (a handoff well
    under the cap) by an SPUBLISH on the lock's own shard, never a cluster-wide PUBLISH,
    through one subscriber connection per primary."""
    redis_cluster.flush()

    async def main() -> None:
        async with await hotlock.aio.connect(redis_cluster.url, backend=redis_backend) as cache:
            for port in redis_cluster.primary_ports():
                key = keys_on(redis_cluster, port, 1, prefix="awake-")[0]
                await async_handoffs(cache, cache, key, 1, 0.05)
                spublish = _cluster_calls(redis_cluster, "spublish")
                publish = _cluster_calls(redis_cluster, "publish")
                took = await async_handoffs(cache, cache, key, WOKEN_ROUNDS, HOLD_S)
                assert_woken(took, port)
                after = _cluster_calls(redis_cluster, "spublish")
                assert after[port] - spublish[port] >= WOKEN_ROUNDS
                assert all(after[p] == spublish[p] for p in after if p != port)
                assert _cluster_calls(redis_cluster, "publish") == publish
            hub = cache._backend.wake_slot._hub  # type: ignore[attr-defined]
            assert len(hub._nodes) == len(redis_cluster.primary_ports())  # one subscriber per primary

    Aio(redis_backend, loop_kind, redis_cluster.url, redis_cluster.nodes[0]).run(main())


# uvloop's waiters are woken on one server by the tests above; on the cluster that is
# make test-slow's, and so is the Valkey cluster's run: make test wakes the sync waiters on
# it (above) and async ones through test_cluster_dialect's Lua-free release.
@pytest.mark.slow_variants("loop_kind", "server_kind")
def test_async_cluster_a_moved_slot_still_acquires_within_the_cap(
    redis_backend: str, loop_kind: str, redis_cluster: Cluster
) -> None:
    """As test_cluster_a_moved_slot_still_acquires_within_the_cap, for waiting tasks: the
    old node's unsubscription sends the waiters to polling, the next waits join the new
    owner and are woken again."""
    redis_cluster.flush()
    ports = redis_cluster.primary_ports()
    key = keys_on(redis_cluster, ports[0], 1, prefix="amoving-")[0]
    slot = key_slot(lock_name(key))

    async def main() -> None:
        async with await hotlock.aio.connect(redis_cluster.url, backend=redis_backend) as cache:
            await async_handoffs(cache, cache, key, 2, 0.05)
            await asyncio.get_running_loop().run_in_executor(None, redis_cluster.move_slot, slot, ports[1])
            took = await async_handoffs(cache, cache, key, 3, 0.1)
            assert all(t < CAP_S + 1.0 for t in took), took
            took = await async_handoffs(cache, cache, key, WOKEN_ROUNDS, HOLD_S)
            assert_woken(took)

    try:
        Aio(redis_backend, loop_kind, redis_cluster.url, redis_cluster.nodes[0]).run(main())
    finally:
        redis_cluster.move_slot(slot, ports[0])


# Run in a child with argv: url, backend. Every file it opens from here on is numbered 1024
# or more (the numbers below are taken), as in a busy server with many sockets open.
MANY_FILES = r"""
import os, resource, sys, threading, time
import hotlock

soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
resource.setrlimit(resource.RLIMIT_NOFILE, (max(soft, min(hard, 4096)), hard))
taken = []
while True:
    fd = os.open("/dev/null", os.O_RDONLY)
    if fd >= 1024:
        os.close(fd)
        break
    taken.append(fd)
cache = hotlock.connect(sys.argv[1], backend=sys.argv[2])
held = cache.lock("many-files", ttl=30)
threading.Timer(0.3, held.unlock).start()
start = time.monotonic()
lock = cache.lock_wait("many-files", ttl=5, wait=10)
print(round(time.monotonic() - start, 3))
lock.unlock()
cache.close()
"""


@pytest.mark.parametrize("backend", ["native", "redis-py"])
def test_a_wait_in_a_process_with_over_1024_files_open(backend: str, redis_url: str, tmp_path: Path) -> None:
    # The subscriber and the waiters' wake-up descriptors get numbers select() refuses; the
    # wait must still be woken by the release (poll(), not select()).
    script = tmp_path / "many_files.py"
    script.write_text(MANY_FILES)
    proc = subprocess.run([sys.executable, str(script), redis_url, backend], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr[-3000:]
    waited = float(proc.stdout.split()[-1])
    # Released at 0.3 s; woken then, not at the next poll of a wait that lost its wake-ups
    # (bounded loosely: the backoff's cap is 50 ms, and a loaded machine adds its own).
    assert 0.25 <= waited < 3.0, waited
