"""The server's dialect: detected once at connect, and the Lua-free extend and
release where the server compares and sets (Valkey 9: SET IFEQ, DELIFEQ).

The behaviour suite already runs every backend on Redis 7.0 (the script path) and on
Valkey 9 (the Lua-free path by default): the lost replies, takeovers, expiry and fork of
tests/test_faults.py, test_native.py and test_aio.py hold on both. This file checks what
is particular to the choice: what connect() decides from what, what each path sends
(counted by the server), scripts="always", and the OOM difference the backends hide.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator

import pytest

import hotlock
import hotlock.aio
from hotlock._dialect import Dialect, detect
from hotlock._scripts import SCRIPTS
from hotlock.backends.native import native_aio

from .conftest import REQUIRE_NATIVE, RedisServer, lock_name, open_cache, start_redis

AIO_BACKENDS = ["redis-py"] + (["native"] if native_aio()[0] is not None or REQUIRE_NATIVE else [])

VALKEY_9 = {"redis_version": "7.2.4", "server_name": "valkey", "valkey_version": "9.1.2"}
VALKEY_81 = {"redis_version": "7.2.4", "server_name": "valkey", "valkey_version": "8.1.1"}
REDIS_70 = {"redis_version": "7.0.15"}
REDIS_84 = {"redis_version": "8.4.0"}
# Another server that speaks the protocol and reports an old redis_version: never guessed at.
LOOKALIKE = {"redis_version": "7.4.0", "dragonfly_version": "df-v1.37.0"}
BOTH = {"DELIFEQ": True, "DELEX": True}
NEITHER = {"DELIFEQ": False, "DELEX": False}


@pytest.mark.parametrize(
    ("info", "commands", "scripts", "release"),
    [
        (VALKEY_9, {"DELIFEQ": True, "DELEX": False}, "auto", "DELIFEQ"),
        (VALKEY_9, BOTH, "auto", "DELIFEQ"),  # Valkey 9.2 has DELEX too: DELIFEQ stays
        (VALKEY_9, None, "auto", "DELIFEQ"),  # COMMAND refused: the version decides
        (VALKEY_9, BOTH, "always", "script"),
        (VALKEY_81, NEITHER, "auto", "script"),  # SET IFEQ but no compare-and-delete yet
        (VALKEY_81, None, "auto", "script"),
        (REDIS_70, None, "auto", "script"),
        (REDIS_70, NEITHER, "auto", "script"),
        (REDIS_84, {"DELIFEQ": False, "DELEX": True}, "auto", "DELEX"),
        (REDIS_84, None, "auto", "DELEX"),
        (REDIS_84, NEITHER, "auto", "script"),  # a build or proxy without it: believed
        ({"redis_version": "8.2.1"}, None, "auto", "script"),
        (LOOKALIKE, BOTH, "auto", "script"),
        (None, BOTH, "auto", "script"),  # INFO refused: the kind is unknown
    ],
)
def test_detect_decides_from_info_commands_and_the_argument(
    info: dict[str, str] | None, commands: dict[str, bool] | None, scripts: str, release: str
) -> None:
    dialect = detect(info, commands, scripts)
    assert dialect.release == release
    assert dialect.lua_free is (release != "script")
    assert dialect.kind == ("valkey" if info and "valkey_version" in info else "redis" if info else "unknown")


def test_valkey_is_named_by_its_own_version_not_its_redis_version() -> None:
    dialect = detect(VALKEY_9, None, "auto")
    assert (dialect.kind, dialect.version) == ("valkey", "9.1.2")
    assert dialect.describe() == "Valkey 9.1.2, Lua-free extend/release (SET IFEQ, DELIFEQ)"
    assert detect(REDIS_70, None, "auto").describe().startswith("Redis 7.0.15, extend/release by script (")


@pytest.mark.parametrize(("scripts", "error"), [("never", ValueError), ("", ValueError), (True, TypeError)])
def test_the_scripts_argument_is_checked_before_any_io(scripts: object, error: type[Exception]) -> None:
    # Port 1 answers nothing: reaching the network would be a CacheError, not this.
    with pytest.raises(error, match="scripts"):
        hotlock.connect("redis://127.0.0.1:1/0", scripts=scripts)  # type: ignore[arg-type]
    with pytest.raises(error, match="scripts"):
        asyncio.run(hotlock.aio.connect("redis://127.0.0.1:1/0", scripts=scripts))  # type: ignore[arg-type]


def test_server_info_names_the_server_and_the_path(
    cache: hotlock.Cache, backend: str, redis_server: RedisServer
) -> None:
    info = cache.server_info
    if backend == "memory":
        assert dict(info) == {
            "kind": "memory",
            "version": None,
            "lua_free": False,
            "acquire": "script",
            "fences": True,
            "extend": "script",
            "release": "script",
            "limits": "script",
            "reason": "in-process: no server",
        }
        return
    fields = redis_server.client().info("server")
    assert info["kind"] == redis_server.kind
    assert info["version"] == fields.get("valkey_version", fields["redis_version"])
    assert info["lua_free"] is redis_server.lua_free
    assert info["acquire"] == "SET NX in MULTI"
    assert (info["extend"], info["release"]) == (("SET IFEQ", "DELIFEQ") if redis_server.lua_free else ("script",) * 2)
    with pytest.raises(TypeError):
        info["lua_free"] = False  # type: ignore[index]


def commandstats(server: RedisServer) -> dict[str, int]:
    return {k.removeprefix("cmdstat_"): int(v["calls"]) for k, v in server.client().info("commandstats").items()}


def exercise(cache: hotlock.Cache, server: RedisServer) -> int:
    """One extend and one release per lock, alone and batched; returns how many locks."""
    lock = cache.lock("one", ttl=5)
    lock.extend(10)
    assert 9_000 < server.client().pttl(lock_name("one")) <= 10_000
    assert lock.unlock() is True
    assert lock.unlock() is False
    locks = cache.lock_many(["a", "b", "c"], ttl=5)
    assert cache.extend_many(locks, 10) == [True, True, True]
    assert cache.unlock_many(locks) == [True, True, True]
    assert cache.unlock_many(locks) == [False, False, False]
    return 4


@pytest.mark.parametrize("scripts", ["auto", "always"])
def test_what_each_path_sends_counted_by_the_server(
    redis_backend: str, redis_url: str, redis_server: RedisServer, scripts: str
) -> None:
    """Lua-free: only the acquires are scripts, extend is SET IFEQ, release DELIFEQ, and a
    SCRIPT FLUSH costs extend and release nothing (no NOSCRIPT can come back). Scripts:
    every call is an EVALSHA. The same calls, the same results, on both."""
    with hotlock.connect(redis_url, backend=redis_backend, scripts=scripts) as cache:
        lua_free = redis_server.lua_free and scripts == "auto"
        assert cache.server_info["lua_free"] is lua_free
        redis_server.client().config_resetstat()
        redis_server.client().script_flush()
        locks = exercise(cache, redis_server)
        stats = commandstats(redis_server)
    # The acquires of free keys: transactions (EXEC) but under scripts="always", or
    # scripts on a backend that takes a free key by script.
    execs = stats.get("exec", 0)
    assert execs in (0, locks) and not (execs and scripts == "always")
    acquires = locks - execs  # by script
    if lua_free:
        # The first acquire met NOSCRIPT and loaded the scripts once; nothing else did
        # (nothing at all when no acquire was a script).
        assert stats.get("evalsha", 0) == acquires + bool(acquires)
        assert stats.get("pexpire", 0) == 0 and stats.get("del", 0) == 0
        assert stats["delifeq"] == locks  # the second unlock of each knows it is done: nothing sent
        assert stats.get("script|load", 0) == len(SCRIPTS) * bool(acquires)
    else:
        # Extend and release per lock (and the acquire by script), plus the one NOSCRIPT.
        assert stats["evalsha"] == 2 * locks + acquires + 1
        assert stats.get("delifeq", 0) == 0
        assert stats["pexpire"] == locks and stats["del"] == locks


@pytest.mark.parametrize("aio_backend", AIO_BACKENDS)
@pytest.mark.parametrize("scripts", ["auto", "always"])
def test_async_paths_send_the_same(aio_backend: str, redis_url: str, redis_server: RedisServer, scripts: str) -> None:
    async def main() -> None:
        async with await hotlock.aio.connect(redis_url, backend=aio_backend, scripts=scripts) as cache:
            lua_free = redis_server.lua_free and scripts == "auto"
            assert cache.server_info["lua_free"] is lua_free
            redis_server.client().config_resetstat()
            lock = await cache.lock("one", ttl=5)
            await lock.extend(10)
            assert 9_000 < redis_server.client().pttl(lock_name("one")) <= 10_000
            redis_server.client().set(lock_name("one"), b"someone else", px=5_000)
            with pytest.raises(hotlock.LockLost):
                await lock.extend(10)  # taken over: never extended
            assert await lock.unlock() is False  # and never released
            assert redis_server.client().get(lock_name("one")) == b"someone else"
            locks = await cache.lock_many(["a", "b"], ttl=5)
            assert await cache.extend_many(locks, 10) == [True, True]
            assert await cache.unlock_many(locks) == [True, True]
            stats = commandstats(redis_server)
        # 3 acquires of free keys: transactions (EXEC) but under scripts="always", or
        # scripts on a backend that takes a free key by script.
        execs = stats.get("exec", 0)
        assert execs in (0, 3) and not (execs and scripts == "always")
        acquires = 3 - execs  # by script
        if lua_free:
            # The acquires, plus the extend and the release of the taken-over lock asked once
            # more by script (SET IFEQ and DELIFEQ miss a value a waiter marked '+').
            assert stats["evalsha"] == acquires + 2 and stats["delifeq"] == 3 and stats.get("pexpire", 0) == 0
        else:
            assert stats["evalsha"] == acquires + 4 + 3 and stats.get("delifeq", 0) == 0

    asyncio.run(main())


@pytest.fixture
def full_server(server_kind: str) -> Iterator[RedisServer]:
    """A private server at maxmemory under noeviction, with three locks taken before it filled."""
    server = start_redis("--maxmemory-policy", "noeviction", kind=server_kind)
    yield server
    server.stop()


def test_a_full_server_still_extends_on_every_path(redis_backend: str, full_server: RedisServer) -> None:
    """A server difference the backends hide: at maxmemory under noeviction the server
    refuses SET (so SET IFEQ) with OOM but runs the EXTEND script; a Lua-free extend refused
    OOM is sent again as the script, so holders keep their locks as on the script path."""
    cache = open_cache(redis_backend, full_server.url)
    try:
        held = [cache.lock(f"held-{i}", ttl=30) for i in range(4)]
        full_server.client().set(lock_name("held-3"), b"someone else", px=30_000)  # taken over
        full_server.client().config_set("maxmemory", 1)
        with pytest.raises(hotlock.CacheError, match="OOM"):
            cache.lock("new", ttl=30)  # new locks are refused, as ever
        held[0].extend(60)
        assert 59_000 < full_server.client().pttl(lock_name("held-0")) <= 60_000
        assert cache.extend_many(held[1:], 60) == [True, True, False]
        with pytest.raises(hotlock.LockLost):
            held[3].extend(60)  # the script it falls back to still compares the value
        assert cache.unlock_many(held[:3]) == [True, True, True]
    finally:
        full_server.client().config_set("maxmemory", 0)
        cache.close()


def test_the_script_takes_over_by_the_error_code_not_the_words_of_the_message(
    redis_backend: str, server_kind: str
) -> None:
    """Only the codes the script serves (OOM, WRONGTYPE) send a Lua-free extend again as the
    script. Refused for another reason (NOPERM: an ACL that takes SET away), the extend is
    that error on every path, though the key's name, which the message shows, holds the
    words of both codes."""
    server = start_redis(kind=server_kind)
    cache = open_cache(redis_backend, server.url)
    try:
        if not server.lua_free:
            pytest.skip("extend goes by script on this server: it sends no SET")
        lock = cache.lock("replied OOM replied WRONGTYPE", ttl=30)
        server.client().execute_command("ACL", "SETUSER", "default", "-set")
        with pytest.raises(hotlock.CacheError, match="NOPERM") as caught:
            lock.extend(60)
        assert "replied OOM" in str(caught.value)  # the words were there to be misread
        assert server.client().pttl(lock_name("replied OOM replied WRONGTYPE")) <= 30_000  # not extended
        assert lock.unlock() is True
    finally:
        cache.close()
        server.stop()


@pytest.mark.parametrize("aio_backend", AIO_BACKENDS)
def test_a_full_server_still_extends_async(aio_backend: str, full_server: RedisServer) -> None:
    async def main() -> None:
        async with await hotlock.aio.connect(full_server.url, backend=aio_backend) as cache:
            held = [await cache.lock(f"held-{i}", ttl=30) for i in range(4)]
            full_server.client().set(lock_name("held-3"), b"someone else", px=30_000)  # taken over
            full_server.client().config_set("maxmemory", 1)
            await held[0].extend(60)
            assert 59_000 < full_server.client().pttl(lock_name("held-0")) <= 60_000
            assert await cache.extend_many(held[1:], 60) == [True, True, False]
            with pytest.raises(hotlock.LockLost):
                await held[3].extend(60)
            assert await cache.unlock_many(held[:3]) == [True, True, True]

    try:
        asyncio.run(main())
    finally:
        full_server.client().config_set("maxmemory", 0)


def test_a_dialect_is_plain_data() -> None:
    dialect = Dialect("valkey", "9.1.2", "DELIFEQ", "test")
    assert dialect.mapping()["release"] == "DELIFEQ"
    assert Dialect("redis", "8.4.0", "DELEX", "test").mapping()["release"] == "DELEX IFEQ"


def test_a_bare_token_release_goes_by_script_on_every_path(rcache: hotlock.Cache, redis_server: RedisServer) -> None:
    """An acquire interrupted before its reply is released by its bare token (its fence is
    unknown); DELIFEQ compares whole values, so that release takes the RELEASE script, which
    matches the token followed by any fence. A whole value still goes Lua-free."""
    backend = rcache._backend
    lock = rcache.lock("bare", ttl=30)
    token = lock._token[:16]
    assert backend.release(b"hotlock:lock:{other}", token) is False  # nothing there
    assert backend.release(lock_name("bare"), token) is True  # token + fence matched
    assert redis_server.client().exists(lock_name("bare")) == 0
    locks = rcache.lock_many(["b1", "b2"], ttl=30)
    assert backend.release_many([lock_name("b1"), lock_name("b2")], [lk._token[:16] for lk in locks if lk]) == [
        True,
        True,
    ]


@pytest.mark.parametrize("aio_backend", AIO_BACKENDS)
def test_a_bare_token_release_goes_by_script_async(aio_backend: str, redis_url: str, redis_server: RedisServer) -> None:
    async def main() -> None:
        async with await hotlock.aio.connect(redis_url, backend=aio_backend) as cache:
            backend = cache._backend
            lock = await cache.lock("bare", ttl=30)
            assert await backend.release(lock_name("bare"), lock._token[:16]) is True
            locks = await cache.lock_many(["b1", "b2"], ttl=30)
            tokens = [lk._token[:16] for lk in locks if lk]
            assert await backend.release_many([lock_name("b1"), lock_name("b2")], tokens) == [True, True]
            assert redis_server.client().keys("hotlock:*") == []

    asyncio.run(main())
