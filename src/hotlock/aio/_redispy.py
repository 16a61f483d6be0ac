"""The pure-Python async backend on redis.asyncio: where the extension is not built.

The same semantics as the sync redis-py backend: its retries off and its timeouts on,
NOSCRIPT loads the scripts and retries once, a lost acquire reply is retried once with
the same token, READONLY drops every connection.
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
from collections.abc import Awaitable, Callable, Iterable
from typing import Any, TypeVar

import redis.asyncio as aioredis
from redis.asyncio.connection import Connection, SSLConnection, UnixDomainSocketConnection
from redis.backoff import NoBackoff
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import (
    NoPermissionError,
    NoScriptError,
    OutOfMemoryError,
    ReadOnlyError,
    RedisError,
    ResponseError,
)
from redis.exceptions import TimeoutError as RedisTimeoutError
from redis.retry import Retry

from .._config import ServerConfig, cache_error
from .._dialect import COMMAND_PROBE, UNDETECTED, Dialect, bare_tokens, extend_command, release_command
from .._ident import TOKEN_BYTES
from .._redispy import _describe
from .._scripts import ACQUIRE, EXTEND, RELEASE, SCRIPTS, Script, held_value
from .._sentinel import PrimaryWatch
from ..errors import CacheError
from ._retry import retry_until, unconfirmed

__all__ = ["RedisAsyncBackend"]

T = TypeVar("T")

# The errors after which a request may or may not have reached the server.
_AMBIGUOUS = (RedisConnectionError, RedisTimeoutError, OSError)

# redis.asyncio opens a connection per concurrent command unless the pool is bounded;
# thousands of tasks would otherwise mean thousands of sockets (and Redis's maxclients).
# Tasks beyond this queue for a free connection with no time limit of their own: the
# queue moves as fast as the commands ahead of it, each bounded by the reply timeout, and
# a long local queue is not a server failure to report as CacheError.
# 128 keeps a hundred concurrent tasks out of the queue (its wake-ups cost more than the
# commands) while bounding what one process asks of Redis.
MAX_CONNECTIONS = 128


class _PrimaryConnection(Connection):
    """A connection to whichever primary the sentinels name at the moment it connects."""

    def __init__(self, *, primary: PrimaryWatch, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self._primary = primary

    async def _connect(self) -> None:
        # Asking is a short blocking exchange (bounded by the connect timeout): off the loop.
        self.host, self.port = await asyncio.get_running_loop().run_in_executor(None, self._primary.address)
        await super()._connect()  # type: ignore[no-untyped-call]


class RedisAsyncBackend:
    name = "redis-py"

    def __init__(self, config: ServerConfig) -> None:
        self.server = config.display
        # What extend and release send: the scripts until connect() detects the server.
        self.dialect: Dialect = UNDETECTED
        self._timeout = config.timeout
        kwargs: dict[str, Any] = {
            "username": config.username,
            "password": config.password,
            "db": config.db,
            "socket_timeout": config.timeout,
            "socket_connect_timeout": config.connect_timeout,
            "retry": Retry(NoBackoff(), 0),
            # RESP2, as in sync: redis-py 8 otherwise opens every connection with HELLO 3.
            "protocol": 2,
        }
        # As in the sync backend: no CLIENT SETINFO round trip on every connect.
        if "driver_info" in inspect.signature(aioredis.Redis.__init__).parameters:
            kwargs["driver_info"] = None
        else:
            kwargs["lib_name"] = kwargs["lib_version"] = None
        self._config = config
        self._redis: aioredis.Redis
        connection_class: type[Connection] | type[UnixDomainSocketConnection]
        # Under Sentinel: where the primary is, and the watch epoch the pool's connections are of.
        self._watch: PrimaryWatch | None = None
        self._epoch = 0
        if config.unix_path is not None:
            connection_class, kwargs["path"] = UnixDomainSocketConnection, config.unix_path
        elif config.sentinels:
            # As in sync: every connection asks the sentinels for the primary when it
            # connects (ServerConfig.primary, not redis.asyncio.sentinel, which can hand
            # out the old primary for a while after a switch), and _call drops every
            # connection once the sentinels name another primary.
            self._watch = PrimaryWatch(config.primary)
            connection_class = _PrimaryConnection
            kwargs.update(primary=self._watch, socket_keepalive=True)
        else:
            connection_class = SSLConnection if config.tls else Connection
            kwargs.update(host=config.host, port=config.port, socket_keepalive=True)
        pool = aioredis.BlockingConnectionPool(
            max_connections=MAX_CONNECTIONS, timeout=None, connection_class=connection_class, **kwargs
        )
        self._redis = aioredis.Redis(connection_pool=pool)
        # Acquires in flight, by token: a release of that token waits for them (see _settled).
        self._inflight: dict[bytes, asyncio.Future[Any]] = {}

    @classmethod
    async def open(cls, config: ServerConfig) -> RedisAsyncBackend:
        backend = cls(config)
        try:
            await backend._load_scripts()
        except BaseException:
            await backend.close()
            raise
        return backend

    # -- plumbing ---------------------------------------------------------------------

    async def _call(
        self,
        what: str,
        key: bytes | None,
        fn: Callable[[], Awaitable[T]],
        retry_lost_reply: bool = False,
        until: float | None = None,
    ) -> T:
        """Run ``fn`` and turn every failure into CacheError. With ``retry_lost_reply``, a
        lost reply is followed by one more try, which ends by ``until`` (loop time) when
        given, else within one more reply timeout."""
        if self._watch is not None:
            await self._follow_primary()
        try:
            return await fn()
        except _AMBIGUOUS as exc:
            if not retry_lost_reply:
                raise await self._error(what, key, exc) from exc
            # The reply was lost and the command may have run: send it once more as it was
            # (same token; the acquire script counts "already my token" as success).
            left = None if until is None else min(self._timeout, until - asyncio.get_running_loop().time())
            if left is not None and left < 0.001:
                raise await self._error(what, key, exc) from exc
            try:
                return await (fn() if left is None else asyncio.wait_for(fn(), left))
            except TimeoutError as again:  # the retry's own time ran out (wait_for)
                raise await self._error(f"{what} (retried after a lost reply)", key, RedisTimeoutError()) from again
            except (RedisError, OSError) as again:
                raise await self._error(f"{what} (retried after a lost reply)", key, again) from again
        except (RedisError, OSError) as exc:
            raise await self._error(what, key, exc) from exc

    async def _follow_primary(self) -> None:
        """Drop every connection once the sentinels name another primary: the old one may
        take writes until it is demoted (asked again every PrimaryWatch.REFRESH_S, off the loop)."""
        watch = self._watch
        assert watch is not None
        if watch.due():
            await asyncio.get_running_loop().run_in_executor(None, watch.refresh)
        if watch.epoch != self._epoch:
            self._epoch = watch.epoch
            await self._redis.connection_pool.disconnect()

    async def _error(self, what: str, key: bytes | None, exc: BaseException) -> Exception:
        if isinstance(exc, ReadOnlyError):
            # A demoted primary: drop every connection so the next call finds the new one.
            await self._redis.connection_pool.disconnect()
        return cache_error(f"{what} failed: {_describe(exc)}", self.server, key)

    async def _load_scripts(self) -> None:
        for script in SCRIPTS:
            await self._call("SCRIPT LOAD", None, lambda s=script: self._redis.script_load(s.source))  # type: ignore[misc]

    async def _evalsha(self, script: Script, key: bytes, *args: bytes | int) -> Any:
        try:
            return await self._redis.execute_command("EVALSHA", script.sha, 1, key, *args)  # type: ignore[no-untyped-call]
        except NoScriptError:
            # Restart, SCRIPT FLUSH or failover emptied the script cache: load all and retry once.
            await self._load_scripts()
            return await self._redis.execute_command("EVALSHA", script.sha, 1, key, *args)  # type: ignore[no-untyped-call]

    async def _pipeline(
        self, script: Script, keys: list[bytes], tokens: list[bytes], *args: int, trailer: tuple[Any, ...] = ()
    ) -> list[Any]:
        """EVALSHA ``script`` once per key in one round trip; ``trailer`` (a WAIT) rides last
        on the same connection and its reply comes last."""

        async def run(indices: Iterable[int]) -> list[Any]:
            pipe = self._redis.pipeline(transaction=False)
            for i in indices:
                pipe.execute_command("EVALSHA", script.sha, 1, keys[i], tokens[i], *args)
            if trailer:
                pipe.execute_command(*trailer)
            return await pipe.execute(raise_on_error=False)

        replies = await run(range(len(keys)))
        missing = [i for i, r in enumerate(replies[: len(keys)]) if isinstance(r, NoScriptError)]
        if missing:
            # Only the calls that did not run are sent again: a release that ran must not
            # be re-run and reported as "not ours". The trailer follows them again.
            await self._load_scripts()
            redone = await run(missing)
            for i, reply in zip(missing, redone, strict=False):
                replies[i] = reply
            replies[len(keys) :] = redone[len(missing) :]
        for reply in replies:
            if isinstance(reply, Exception):
                raise reply
        return replies

    async def _commands(self, commands: list[tuple[bytes, ...]]) -> list[Any]:
        """Plain commands (the Lua-free extend and release) in one round trip, error replies
        raised; one command goes without a pipeline. Raw replies: no response callbacks
        (SET's would turn nil into False, which would read the same, but DELEX has none)."""
        if len(commands) == 1:
            return [await self._redis.execute_command(*commands[0])]  # type: ignore[no-untyped-call]
        pipe = self._redis.pipeline(transaction=False)
        for command in commands:
            pipe.execute_command(*command)
        replies: list[Any] = await pipe.execute(raise_on_error=False)
        for reply in replies:
            if isinstance(reply, Exception):
                raise reply
        return replies

    def _shielded(self, tokens: list[bytes], work: Awaitable[T]) -> Awaitable[T]:
        """Run ``work`` to completion even if its caller is cancelled, recorded under ``tokens``.

        Cancelling a redis.asyncio call mid-command drops its connection while the command
        may still run on the server; a release sent meanwhile on another pooled connection
        could overtake it and leave the acquire standing. Finishing the acquire first, and
        having releases of its tokens wait for it, keeps AsyncBackend's ordering promise.
        Releases run shielded too: redis.asyncio swallows a cancellation that lands in
        some of its steps, and behind the shield the caller's cancel always lands at once.
        """
        task = asyncio.ensure_future(work)
        for token in tokens:
            self._inflight[token] = task

        def done(finished: asyncio.Future[Any]) -> None:
            for token in tokens:
                if self._inflight.get(token) is finished:
                    del self._inflight[token]
            if not finished.cancelled():
                finished.exception()  # retrieved: a caller that was cancelled will never see it

        task.add_done_callback(done)
        return asyncio.shield(task)

    async def _settled(self, tokens: list[bytes]) -> None:
        # A release gives the held value (token + fence) or, for an interrupted acquire,
        # the bare token: the acquire was recorded under the bare token.
        pending = {task for token in tokens if (task := self._inflight.get(token[:TOKEN_BYTES])) is not None}
        if pending:
            await asyncio.wait(pending)

    # -- the AsyncBackend interface ---------------------------------------------------

    async def acquire(self, key: bytes, token: bytes, ttl_ms: int, since: float | None = None, wait_ms: int = 0) -> int:
        if self._config.wait_replicas:
            return (await self._shielded([token], self._acquire_confirmed("acquire", [key], [token], ttl_ms)))[0]
        until = retry_until(since, wait_ms, self._timeout)
        reply = await self._shielded(
            [token], self._call("acquire", key, lambda: self._evalsha(ACQUIRE, key, token, ttl_ms), True, until)
        )
        return int(reply)

    async def acquire_many(self, keys: list[bytes], tokens: list[bytes], ttl_ms: int) -> list[int]:
        if self._config.wait_replicas:
            return await self._shielded(tokens, self._acquire_confirmed("acquire_many", keys, tokens, ttl_ms))
        replies = await self._shielded(
            tokens, self._call("acquire_many", None, lambda: self._pipeline(ACQUIRE, keys, tokens, ttl_ms), True)
        )
        return [int(r) for r in replies]

    async def _acquire_confirmed(self, what: str, keys: list[bytes], tokens: list[bytes], ttl_ms: int) -> list[int]:
        """Under wait_replicas: the acquires and a WAIT behind them on the same connection
        (WAIT confirms the writes made before it on its own connection), in one round trip."""
        config = self._config
        wait = ("WAIT", config.wait_replicas, round(config.wait_timeout * 1000))
        replies = await self._call(
            what,
            keys[0] if len(keys) == 1 else None,
            lambda: self._pipeline(ACQUIRE, keys, tokens, ttl_ms, trailer=wait),
            True,
        )
        results, confirmed = [int(r) for r in replies[:-1]], int(replies[-1])
        if confirmed >= config.wait_replicas:
            return results
        held = [(k, held_value(t, r)) for k, t, r in zip(keys, tokens, results, strict=True) if r > 0]
        if held:
            # If the undo fails too, the keys expire by their TTL; the caller hears about the replicas.
            with contextlib.suppress(CacheError):
                await self._call(
                    "undo", None, lambda: self._pipeline(RELEASE, [k for k, _ in held], [t for _, t in held])
                )
        raise unconfirmed(what, confirmed, config, keys[0] if len(keys) == 1 else None)

    async def extend(self, key: bytes, token: bytes, ttl_ms: int) -> bool:
        if self.dialect.lua_free:
            # SET's response callback reads OK as True and nil as None: the key held this value or not.
            command = extend_command(key, token, ttl_ms)
            try:
                return bool((await self._call("extend", key, lambda: self._commands([command])))[0])
            except CacheError as exc:
                if not isinstance(exc.__cause__, OutOfMemoryError):
                    raise
                # Refused at maxmemory: the script is not (see _dialect), so it extends instead.
        return bool(await self._call("extend", key, lambda: self._evalsha(EXTEND, key, token, ttl_ms)))

    async def extend_many(self, keys: list[bytes], tokens: list[bytes], ttl_ms: int) -> list[bool]:
        if self.dialect.lua_free:
            sets = [extend_command(k, t, ttl_ms) for k, t in zip(keys, tokens, strict=True)]
            try:
                return [bool(r) for r in await self._call("extend_many", None, lambda: self._commands(sets))]
            except CacheError as exc:
                if not isinstance(exc.__cause__, OutOfMemoryError):
                    raise
                # Refused at maxmemory: the script is not (see _dialect), so it extends instead.
        replies = await self._call("extend_many", None, lambda: self._pipeline(EXTEND, keys, tokens, ttl_ms))
        return [bool(r) for r in replies]

    async def release(self, key: bytes, token: bytes) -> bool:
        await self._settled([token])
        # A lost release reply is retried, as in sync: the second try finds the key gone
        # (False) or still ours (releases it), and either way the caller sees no error.
        if self.dialect.lua_free and not bare_tokens([token]):
            command = release_command(self.dialect, key, token)
            work = self._call("release", key, lambda: self._commands([command]), True)
            return bool((await self._shielded([token], work))[0])
        work = self._call("release", key, lambda: self._evalsha(RELEASE, key, token), True)
        return bool(await self._shielded([token], work))

    async def release_many(self, keys: list[bytes], tokens: list[bytes]) -> list[bool]:
        await self._settled(tokens)
        if self.dialect.lua_free and not bare_tokens(tokens):
            dels = [release_command(self.dialect, k, t) for k, t in zip(keys, tokens, strict=True)]
            work = self._call("release_many", None, lambda: self._commands(dels), True)
        else:
            work = self._call("release_many", None, lambda: self._pipeline(RELEASE, keys, tokens), True)
        replies = await self._shielded(tokens, work)
        return [bool(r) for r in replies]

    async def set_nx(self, key: bytes, value: bytes, ttl_ms: int) -> bool:
        return bool(await self._call("set_nx", key, lambda: self._redis.set(key, value, nx=True, px=ttl_ms)))

    async def incr(self, key: bytes, amount: int) -> int:
        return int(await self._call("incr", key, lambda: self._redis.incrby(key, amount)))

    async def info(self) -> dict[str, str] | None:
        try:
            raw = await self._redis.execute_command("INFO")  # type: ignore[no-untyped-call]
        except NoPermissionError:
            return None
        except (RedisError, OSError) as exc:
            raise cache_error(f"INFO failed: {_describe(exc)}", self.server) from exc
        if isinstance(raw, dict):
            return {str(k): str(v) for k, v in raw.items()}
        return {}

    async def command_info(self) -> list[Any] | None:
        """COMMAND INFO DELIFEQ DELEX's reply, or None when the server or its ACL refuses it."""
        # "COMMAND INFO" as one name: redis-py splits it on the wire, and finds no response
        # callback for it (COMMAND's own would parse a full command table).
        args = COMMAND_PROBE[2:]
        try:
            reply = await self._call(
                "COMMAND INFO",
                None,
                lambda: self._redis.execute_command("COMMAND INFO", *args),  # type: ignore[no-untyped-call]
            )
        except CacheError as exc:
            if isinstance(exc.__cause__, ResponseError):
                return None  # NOPERM, or a proxy without COMMAND: the version decides
            raise
        return reply if isinstance(reply, list) else None

    def use_dialect(self, dialect: Dialect) -> None:
        self.dialect = dialect

    async def close(self) -> None:
        await self._redis.aclose()
        await self._redis.connection_pool.disconnect()
