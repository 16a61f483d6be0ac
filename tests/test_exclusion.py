"""Mutual exclusion under load, crashed holders, and the connect log."""

from __future__ import annotations

import logging
import multiprocessing as mp
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time

import pytest

import hotlock

from .conftest import RedisServer, open_cache
from .overlap import OverlapChecker

KEYS = 3


def hammer(url: str, backend: str, prefix: str, checker: OverlapChecker, seconds: float, threads: int) -> None:
    """Threads of this process take random keys with lock_wait and hold them briefly."""
    cache = hotlock.connect(url, backend=backend, prefix=prefix) if backend != "memory" else None
    assert cache is not None
    deadline = time.monotonic() + seconds

    def worker(n: int) -> None:
        i = n
        while time.monotonic() < deadline:
            i += 1
            key = i % KEYS
            try:
                with cache.lock_wait(f"k{key}", ttl=5, wait=2):
                    checker.enter(key)
                    time.sleep(0.0005)
                    checker.exit(key)
            except hotlock.LockNotAcquired:
                pass

    pool = [threading.Thread(target=worker, args=(n,)) for n in range(threads)]
    for t in pool:
        t.start()
    for t in pool:
        t.join()
    cache.close()


def run_hammer(url: str, backend: str, broken: bool) -> OverlapChecker:
    checker = OverlapChecker(KEYS)
    ctx = mp.get_context("fork")
    # A broken lock: each process writes under its own prefix, so nobody excludes anybody.
    procs = [
        ctx.Process(target=hammer, args=(url, backend, f"p{n}:" if broken else "hotlock:", checker, 1.5, 3))
        for n in range(4)
    ]
    for p in procs:
        p.start()
    for p in procs:
        p.join(30)
        assert p.exitcode == 0
    return checker


def test_no_two_holders_across_processes_and_threads(redis_backend: str, redis_url: str) -> None:
    checker = run_hammer(redis_url, redis_backend, broken=False)
    assert checker.sections > 100, "the hammer did too little to prove anything"
    assert checker.overlaps == 0


def test_the_checker_catches_a_broken_lock(redis_backend: str, redis_url: str) -> None:
    checker = run_hammer(redis_url, redis_backend, broken=True)
    assert checker.sections > 100
    assert checker.overlaps > 0, "the overlap checker must see two holders when the lock is broken"


def test_memory_backend_excludes_threads() -> None:
    cache = hotlock.connect(None)
    checker = OverlapChecker(KEYS)
    deadline = time.monotonic() + 1.0

    def worker(n: int) -> None:
        i = n
        while time.monotonic() < deadline:
            i += 1
            with cache.lock_wait(f"k{i % KEYS}", ttl=5, wait=2):
                checker.enter(i % KEYS)
                time.sleep(0.0002)
                checker.exit(i % KEYS)

    pool = [threading.Thread(target=worker, args=(n,)) for n in range(8)]
    for t in pool:
        t.start()
    for t in pool:
        t.join()
    assert checker.sections > 100
    assert checker.overlaps == 0


HOLDER = textwrap.dedent(
    """
    import sys, time, hotlock
    cache = hotlock.connect(sys.argv[1], backend=sys.argv[2])
    sent = time.monotonic()
    cache.lock("crashy", ttl=float(sys.argv[3]))
    print(sent, flush=True)
    time.sleep(60)
    """
)


def test_sigkilled_holder_frees_the_lock_within_its_ttl(redis_backend: str, redis_url: str) -> None:
    ttl = 0.5
    proc = subprocess.Popen([sys.executable, "-c", HOLDER, redis_url, redis_backend, str(ttl)], stdout=subprocess.PIPE)
    assert proc.stdout is not None
    sent = float(proc.stdout.readline())  # CLOCK_MONOTONIC is system-wide: comparable here
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    proc.stdout.close()
    cache = open_cache(redis_backend, redis_url)
    while True:
        tried = time.monotonic()
        try:
            lock = cache.lock("crashy", ttl=5)
            break
        except hotlock.LockNotAcquired:
            # The key was there when the server ran this attempt, after `tried`: only a key
            # that outlives its TTL fails this, never a reply the loaded machine delivers late.
            assert tried - sent < ttl + 0.05, "the lock outlived its TTL + 50 ms"
            time.sleep(0.002)
    freed = time.monotonic() - sent
    assert ttl - 0.01 < freed, freed  # not before its TTL (the loop above bounds it from above)
    lock.unlock()
    cache.close()


def test_connect_logs_server_version_and_backend(
    redis_backend: str, redis_url: str, redis_server: RedisServer, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.INFO, "hotlock"):
        hotlock.connect(redis_url, backend=redis_backend).close()
    infos = [r.getMessage() for r in caplog.records if r.levelno == logging.INFO]
    assert len(infos) == 1
    # The server's own name and version (Valkey reports a frozen redis_version: not that one).
    assert f"({redis_server.named}, " in infos[0]
    path = "Lua-free extend/release (SET IFEQ, DELIFEQ)" if redis_server.lua_free else "extend/release by script"
    assert path in infos[0]
    assert f"{redis_backend} backend" in infos[0]
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING]


@pytest.mark.parametrize("policy", ["allkeys-lru", "volatile-lru", "volatile-ttl"])
def test_connect_warns_of_an_evicting_policy(
    redis_backend: str, redis_server: RedisServer, redis_url: str, caplog: pytest.LogCaptureFixture, policy: str
) -> None:
    client = redis_server.client()
    client.config_set("maxmemory-policy", policy)
    try:
        with caplog.at_level(logging.INFO, "hotlock"):
            hotlock.connect(redis_url, backend=redis_backend).close()
    finally:
        client.config_set("maxmemory-policy", "noeviction")
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and policy in warnings[0] and "noeviction" in warnings[0]


def test_info_refused_by_acl_is_said_once(
    redis_backend: str, redis_server: RedisServer, redis_url: str, caplog: pytest.LogCaptureFixture
) -> None:
    client = redis_server.client()
    client.execute_command("ACL", "SETUSER", "noinfo", "on", ">pw", "~hotlock:*", "+@all", "-info")
    try:
        url = redis_url.replace("redis://", "redis://noinfo:pw@")
        with caplog.at_level(logging.INFO, "hotlock"):
            cache = hotlock.connect(url, backend=redis_backend)
        cache.lock("acl", ttl=5).unlock()
        cache.close()
    finally:
        client.execute_command("ACL", "DELUSER", "noinfo")
    refused = [r.getMessage() for r in caplog.records if "INFO is refused" in r.getMessage()]
    assert len(refused) == 1


def test_no_url_warns_once_and_cache_url_is_used(
    redis_url: str, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.delenv("CACHE_URL", raising=False)
    with caplog.at_level(logging.INFO, "hotlock"):
        local = hotlock.connect()
    assert local.enabled is False and local.backend == "memory"
    assert [r.getMessage() for r in caplog.records] == [
        "no cache configured: locks exclude nothing outside this process"
    ]
    monkeypatch.setenv("CACHE_URL", redis_url)
    remote = hotlock.connect()
    assert remote.enabled is True and remote.server == redis_url
    remote.close()


def test_backend_info_names_the_live_backend() -> None:
    info = hotlock.backend_info()
    assert info["backend"] in ("native", "redis-py")
    if info["backend"] == "redis-py":
        assert info["reason"], "when native is not live, backend_info says why"
    if os.environ.get("HOTLOCK_REQUIRE_EXTENSIONS") == "1":
        assert info["backend"] == "native", info["reason"]
