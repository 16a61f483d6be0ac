"""The pure-Python async backend on redis.asyncio: where the extension is not built.

The same semantics as the sync redis-py backend: its retries off and its timeouts on,
NOSCRIPT loads the scripts and retries once, a lost acquire reply is retried once with
the same token, READONLY drops every connection.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections import deque
from collections.abc import Awaitable, Callable, Iterable
from typing import Any, TypeVar

import redis.asyncio as aioredis
from redis.asyncio.connection import AbstractConnection, Connection, SSLConnection, UnixDomainSocketConnection
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff
from redis.exceptions import (
    AuthenticationError,
    BusyLoadingError,
    NoPermissionError,
    NoScriptError,
    RedisError,
    ResponseError,
)
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError

from .._config import KEEPALIVE_OPTIONS, ServerConfig
from .._credentials import reauth_command_async
from .._dialect import COMMAND_PROBE, Detected, by_script, extend_command, release_command
from .._scripts import ACQUIRE, EXTEND, RELEASE, Script, held_value, resent
from .._sentinel import PrimaryWatch
from .._transient import Retrying, tried
from ..errors import CacheError, LinkLost, cache_error
from ..errors import ReplyError as ClusterReplyError
from .redispy import (
    AMBIGUOUS,
    FRAME,
    SCRIPT_LOADED,
    SCRIPT_LOADS,
    SCRIPT_REPLY,
    AuthLost,
    HandshakeLost,
    Shape,
    StrayReply,
    Transaction,
    UnexpectedReply,
    by_transaction,
    connection_kwargs,
    describe,
    is_anything,
    is_count,
    is_flag,
    is_frame,
    is_int,
    is_ok_or_nil,
    is_text,
    lost_handshake,
    probe_refused,
    reauth_due,
    refusal_text,
    refused,
    refused_warning,
    reply_error,
    reply_serves_script,
    tls_hint,
    transient_code,
)
from .retry_async import InFlight, info_fields, retry_until, unconfirmed, unconfirmed_renewals, wait_ms, within
from .wakeup_async import async_slot

__all__ = ["RedisAsyncBackend", "RedisAsyncLink"]

T = TypeVar("T")


async def _handshake(conn: Connection) -> None:
    """redis.asyncio's own handshake (redis_connect_func), its lost reply told apart from a
    lost reply to the call's command, as in the sync backend."""
    try:
        await conn.on_connect()
    except AMBIGUOUS as exc:
        lost_handshake(exc)
    except CacheError:
        # The credential provider failed: not left open unauthenticated in the pool.
        await conn.disconnect(nowait=True)
        raise
    conn.hotlock_authed = time.monotonic()  # type: ignore[attr-defined]


async def reauthenticate(conn: Any, config: ServerConfig) -> None:
    """hotlock.backends.redispy.reauthenticate on a redis.asyncio connection."""
    conn.hotlock_authed = time.monotonic()
    command = await reauth_command_async(config)  # None also when the provider failed (logged)
    if command is not None:
        await conn.send_command(*command)
        await conn.read_response()


def stray(conn: Any) -> bool:
    """Whether a reply, or part of one, sits received but unparsed on ``conn`` after the
    replies a call asked for (hiredis's buffer, or redis.asyncio's own parser's, and the
    stream's); no EOF: a connection closed after its last reply is found by _Pool.get. As
    in the sync backend (hotlock.backends.redispy.stray), what comes later is found there."""
    parser = conn._parser
    stream = getattr(parser, "_stream", None)
    if stream is not None and stream._buffer:
        return True
    reader = getattr(parser, "_reader", None)  # hiredis
    if reader is not None:
        return bool(reader.has_data())
    return len(getattr(parser, "_buffer", b"")) > getattr(parser, "_pos", 0)


# A connection per concurrent command, up to a bound: thousands of tasks would otherwise
# mean thousands of sockets (and Redis's maxclients). 128 keeps a hundred concurrent
# tasks out of the queue while bounding what one process asks of Redis.
MAX_CONNECTIONS = 128


def _reset_by_peer(conn: AbstractConnection) -> bool:
    """Whether the peer reset this pooled connection while it sat idle.

    redis.asyncio checks a pooled connection only for EOF and unread data, and a reset is
    neither (the stream holds the error instead): the next write fails (on uvloop as a
    RuntimeError, not even a ConnectionError) and costs the call its one retry. Reported
    as "not ready", the pool reconnects before sending, as the native client does."""
    reader, writer = conn._reader, conn._writer
    if reader is not None and reader.exception() is not None:
        return True
    return writer is not None and writer.transport.is_closing()


class _Pool:
    """The backend's connections: idle ones reused last in, first out; callers beyond the
    limit queued first in, first out, a released connection handed straight to the next.

    Not redis.asyncio's BlockingConnectionPool: it takes a Condition, a timeout context and
    metric hooks on every get and every release, which at 1000 tasks cost more client CPU
    than the commands themselves (bench/profile_notes.md). Callers queue with no time limit
    of their own: the queue moves as fast as the commands ahead, each bounded by the reply
    timeout, and a long local queue is not a server failure to report as CacheError."""

    def __init__(self, make: Callable[[], Any], limit: int, config: ServerConfig | None = None) -> None:
        self._make = make
        self._limit = limit
        # reauth_interval: AUTH re-sent on a connection handed out that long after its last.
        self._config = config
        self._reauth = 0.0 if config is None else config.reauth_interval
        self._all: list[Any] = []
        self._idle: list[Any] = []
        self._waiters: deque[asyncio.Future[Any]] = deque()
        # Bumped by retire(): a connection made before that is closed when next taken.
        self._generation = 0
        self._made_in: dict[int, int] = {}  # id(conn) -> the generation it connected in

    async def get(self) -> Any:
        """A connection, connected (a new one has sent its handshake) and in step."""
        if self._idle:
            conn = self._idle.pop()
        elif len(self._all) < self._limit:
            conn = self._make()
            self._all.append(conn)
        else:
            waiter: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
            self._waiters.append(waiter)
            try:
                conn = await waiter
            except asyncio.CancelledError:
                if waiter.done() and not waiter.cancelled():
                    self.put(waiter.result())  # handed over as we were cancelled: pass it on
                raise
        try:
            if conn.is_connected and (self._made_in.get(id(conn)) != self._generation or await self._stale(conn)):
                await conn.disconnect(nowait=True)
            if not conn.is_connected:
                await conn.connect()
                self._made_in[id(conn)] = self._generation
            if reauth_due(conn, self._reauth):
                assert self._config is not None
                try:
                    await reauthenticate(conn, self._config)
                except AuthenticationError as exc:
                    await conn.disconnect(nowait=True)
                    raise AuthLost(exc) from exc
        except BaseException:
            self.put(conn)
            raise
        return conn

    def forget(self, conn: Any) -> None:
        """``conn`` takes no other command: closed when next taken (see retire)."""
        self._made_in.pop(id(conn), None)

    def retire(self) -> None:
        """No connection made so far takes another command (READONLY: the endpoint reaches
        a replica now): each is closed when next taken, so a call of another task keeps
        the connection it is reading from until it is done with it."""
        self._generation += 1

    @staticmethod
    async def _stale(conn: Any) -> bool:
        # Closed or reset by the server while idle, or holding data nobody asked for: not
        # reused as it is (redis.asyncio's own pool misses the reset).
        try:
            return _reset_by_peer(conn) or bool(await conn.can_read())
        except (RedisConnectionError, OSError):
            return True

    def put(self, conn: Any) -> None:
        while self._waiters:
            waiter = self._waiters.popleft()
            if not waiter.done():
                waiter.set_result(conn)
                return
        self._idle.append(conn)

    async def disconnect(self) -> None:
        """Close every connection, in use or idle; each reconnects when next used."""
        await asyncio.gather(*(conn.disconnect(nowait=True) for conn in self._all), return_exceptions=True)


class _PrimaryConnection(Connection):
    """A connection to whichever primary the sentinels name at the moment it connects."""

    def __init__(self, *, primary: PrimaryWatch, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self._primary = primary

    async def _connect(self) -> None:
        # Asking is a short blocking exchange (bounded by the connect timeout): off the loop.
        self.host, self.port = await asyncio.get_running_loop().run_in_executor(None, self._primary.address)
        await super()._connect()  # type: ignore[no-untyped-call]


class _SSLConnection(SSLConnection):
    """redis.asyncio's SSLConnection, with ssl_server_name: the name the certificate is
    checked against and sent as SNI, in place of the host connected to; and certificate
    files read again when they change."""

    def __init__(self, *, ssl_server_name: str | None = None, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self._server_name = ssl_server_name

    def _connection_arguments(self) -> Any:
        # redis.asyncio keeps the SSL context a connection object first made for the
        # object's life, and a pooled object connects again and again: forget it, so each
        # connect asks anew (redis-py shares one context per version of the certificate
        # files, so a rotated file is read by the next connection and an unchanged one not
        # at all; an older redis-py makes a context per connect).
        self.ssl_context.context = None
        kwargs = dict(super()._connection_arguments())
        if self._server_name is not None:
            kwargs["server_hostname"] = self._server_name
        return kwargs


class _PrimarySSLConnection(_PrimaryConnection, _SSLConnection):
    """rediss+sentinel://: TLS to whichever primary the sentinels name, its certificate
    checked against that announced address."""


def _connection_kwargs(config: ServerConfig) -> dict[str, Any]:
    """redis.asyncio connection settings, as the sync backend's (connection_kwargs)."""
    return connection_kwargs(config, aioredis.Redis.__init__, _handshake, Retry(NoBackoff(), 0))


class RedisAsyncLink:
    """One Redis Cluster node over a redis.asyncio pool (hotlock.backends.cluster_async.AsyncLink);
    per-node pools routed by hotlock.backends.cluster, not redis.asyncio.cluster, for the reasons
    given at hotlock.backends.redispy.RedisPyLink."""

    def __init__(self, config: ServerConfig) -> None:
        self.server = config.display
        self._config = config
        kind = _SSLConnection if config.tls else Connection
        self._pool: Any = aioredis.BlockingConnectionPool(
            max_connections=MAX_CONNECTIONS,
            timeout=None,
            connection_class=kind,
            host=config.host,
            port=config.port,
            socket_keepalive=True,
            socket_keepalive_options=KEEPALIVE_OPTIONS,
            **_connection_kwargs(config),
        )

    @classmethod
    async def open(cls, config: ServerConfig) -> RedisAsyncLink:
        link = cls(config)
        try:
            replies = await link.link_call(SCRIPT_LOADS, None)
        except LinkLost as exc:
            await link.link_close()
            raise cache_error(f"connect failed: {exc}", link.server) from exc
        for reply in replies:
            if isinstance(reply, ClusterReplyError):
                await link.link_close()
                raise cache_error(f"connect failed: SCRIPT LOAD: the server replied {reply}", link.server)
        return link

    async def link_call(self, commands: list[tuple[bytes, ...]], timeout: float | None) -> list[Any]:
        try:
            conn = await self._pool.get_connection()
        except AMBIGUOUS as exc:
            raise cache_error(f"connect failed: {describe(exc)}", self.server) from exc
        complete = False
        try:
            if reauth_due(conn, self._config.reauth_interval):
                try:
                    await reauthenticate(conn, self._config)
                except AuthenticationError as exc:
                    # Refused (WRONGPASS): nothing was sent; Route asks for a new connection.
                    return [ClusterReplyError(refusal_text(exc))] * len(commands)
            await conn.send_packed_command(conn.pack_commands(commands))
            loop = asyncio.get_running_loop()
            deadline = None if timeout is None else loop.time() + timeout
            replies: list[Any] = []
            for _ in commands:
                kw = {} if deadline is None else {"timeout": max(deadline - loop.time(), 0.001)}
                try:
                    replies.append(await conn.read_response(**kw))
                except (ResponseError, BusyLoadingError) as exc:  # LOADING is a ConnectionError to redis-py
                    replies.append(reply_error(exc))
                except AuthenticationError as exc:
                    # NOAUTH, raised mid-read (the connection closed): every command behind
                    # it was refused too, so each gets it as its reply, for Route.
                    return replies + [ClusterReplyError(refusal_text(exc))] * (len(commands) - len(replies))
            if stray(conn):
                raise StrayReply()
            complete = True
        except AMBIGUOUS as exc:
            raise LinkLost(describe(exc)) from exc
        except RedisError as exc:  # AUTH refused on connect, say: nothing ran
            raise cache_error(f"connect failed: {describe(exc)}", self.server) from exc
        finally:
            if not complete:
                await conn.disconnect()
            await self._pool.release(conn)
        return replies

    async def link_close(self) -> None:
        await self._pool.disconnect()

    async def link_drop(self) -> None:
        """Route's answer to NOAUTH/WRONGPASS: every connection goes, so the next ones
        connect and ask the credential provider again."""
        await self._pool.disconnect()


class RedisAsyncBackend(Detected):
    name = "redis-py"

    def __init__(self, config: ServerConfig) -> None:
        self.server = config.display
        self._timeout = config.timeout
        kwargs = _connection_kwargs(config)
        self._config = config
        # The wake-up subscriber (hotlock.backends.wakeup_async), made on the first long lock_wait.
        self.wake_slot = async_slot(config)
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
            connection_class = _PrimarySSLConnection if config.tls else _PrimaryConnection
            kwargs.update(primary=self._watch, socket_keepalive=True, socket_keepalive_options=KEEPALIVE_OPTIONS)
        else:
            connection_class = _SSLConnection if config.tls else Connection
            kwargs.update(
                host=config.host, port=config.port, socket_keepalive=True, socket_keepalive_options=KEEPALIVE_OPTIONS
            )
        self._pool = _Pool(lambda: connection_class(**kwargs), MAX_CONNECTIONS, config)
        # Acquires in flight, by token: a release of that token waits for them.
        self._inflight = InFlight(config.display)
        # Set by close(): a call then gets no second try, so the calls close() cancels end.
        self._closing = False
        # False once this server refused MULTI: every acquire goes by script (Transaction).
        self._transactions = True

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
        """Run ``fn`` and turn every failure into CacheError, under the lost-reply rule
        (docs/architecture.md), as in the sync backend: one more try, which ends by ``until`` (loop
        time) when given, else within one more reply timeout, after a lost handshake reply
        (nothing of the call was sent: any call), or after a lost reply to the call itself
        with ``retry_lost_reply`` (same token: the acquire script counts "already my token"
        as success; never INCRBY or SET NX, which would count twice or answer "not set")."""
        if self._watch is not None:
            await self._follow_primary()
        loop = asyncio.get_running_loop()
        lost = False  # the one retry after a lost reply has been used
        transient = Retrying()
        limit: float | None = None  # a retry's time: what is left of the budget
        while True:
            try:
                return await (fn() if limit is None else within(fn(), limit))
            except TimeoutError as again:  # a retry's own time ran out (within)
                raise await self._error(tried(what, lost, transient), key, RedisTimeoutError()) from again
            except (RedisError, OSError) as exc:
                failure = exc
            if transient_code(failure) is not None and not self._closing:
                # The command did not run: resent on a fresh connection (_retire) after a
                # pause, while the call's own timeout lasts (hotlock._transient).
                until = loop.time() + 2 * self._timeout if until is None else until
                pause = transient.pause(until - self._timeout - loop.time())
                if pause is None:
                    raise await self._error(tried(what, lost, transient), key, failure) from failure
                await asyncio.sleep(pause)
                limit = max(min(self._timeout, until - loop.time()), 0.001)
                continue
            if (
                lost
                or not isinstance(failure, AMBIGUOUS)
                # NOAUTH or WRONGPASS on a live connection (AuthLost, the connection closed):
                # nothing ran, and the new connection asks the credential provider again.
                or not (retry_lost_reply or isinstance(failure, HandshakeLost | AuthLost))
                or refused(failure)
                or self._closing
            ):
                raise await self._error(tried(what, lost, transient), key, failure) from failure
            left = self._timeout if until is None else min(self._timeout, until - loop.time())
            if left < 0.001:
                raise await self._error(tried(what, lost, transient), key, failure) from failure
            lost = True
            limit = left

    def _retire(self, conn: Any, reply: BaseException) -> None:
        """After a transient reply on ``conn``: it takes no other command (closed when next
        taken); after READONLY, neither does any other connection of the pool."""
        if transient_code(reply) == "READONLY":
            self._pool.retire()
        else:
            self._pool.forget(conn)

    async def _follow_primary(self) -> None:
        """Drop every connection once the sentinels name another primary: the old one may
        take writes until it is demoted (asked again every PrimaryWatch.REFRESH_S, off the loop)."""
        watch = self._watch
        assert watch is not None
        if watch.due():
            await asyncio.get_running_loop().run_in_executor(None, watch.refresh)
        if watch.epoch != self._epoch:
            self._epoch = watch.epoch
            await self._pool.disconnect()

    async def _error(self, what: str, key: bytes | None, exc: BaseException) -> Exception:
        return cache_error(f"{what} failed: {describe(exc)}{tls_hint(self._config, exc)}", self.server, key)

    async def _load_scripts(self) -> None:
        # Loading twice changes nothing: a lost reply is resent.
        await self._call("SCRIPT LOAD", None, lambda: self._commands(SCRIPT_LOADS, SCRIPT_LOADED), True)

    async def _evalsha(self, script: Script, key: bytes, *args: bytes | int) -> Any:
        shape = SCRIPT_REPLY[script]
        try:
            return await self._execute(shape, b"EVALSHA", script.sha, 1, key, *args)
        except NoScriptError:
            # Restart, SCRIPT FLUSH or failover emptied the script cache: load all and retry once.
            await self._load_scripts()
            return await self._execute(shape, b"EVALSHA", script.sha, 1, key, *args)

    async def _execute(self, shape: Shape, *args: bytes | int) -> Any:
        """One command on a pooled connection: its raw reply, or its error reply raised.

        Straight on the connection, not through Redis.execute_command, which adds per
        command a retry wrapper (ours is off), response callbacks and observability hooks:
        together more client CPU than the command itself, on the path every lock takes
        twice (bench/profile_notes.md). A connection that a failure or a cancellation
        leaves with a reply in flight is closed, never reused out of step, and so is one
        whose reply is not of the command's ``shape`` (UnexpectedReply) or has more behind
        it (StrayReply, a lost reply)."""
        conn = await self._pool.get()
        try:
            await conn.send_packed_command(conn.pack_command(*args), False)
            reply = await conn.read_response()
            if not shape(reply):
                raise UnexpectedReply(args, reply)
            if stray(conn):
                raise StrayReply()
            return reply
        except (ResponseError, BusyLoadingError) as exc:  # LOADING is a ConnectionError to redis-py
            # A whole reply was read: the connection is in step, and kept, unless the reply
            # is transient (the command did not run): its resend goes on a fresh connection.
            if transient_code(exc) is not None:
                self._retire(conn, exc)
            raise
        except BaseException as exc:
            await conn.disconnect(nowait=True)
            if isinstance(exc, AuthenticationError):  # NOAUTH: not authenticated any more
                raise AuthLost(exc) from exc
            raise
        finally:
            self._pool.put(conn)

    async def _execute_many(
        self, commands: list[tuple[Any, ...]], shapes: list[Shape], frame: bool = True
    ) -> list[Any]:
        """Commands written at once on one connection and every reply read, error replies
        in place (as exceptions), as _execute does for one; framed by a trailing TIME as in
        the sync backend (hotlock.backends.redispy.FRAME), unless ``frame`` is False."""
        framed = frame and len(commands) > 1
        conn = await self._pool.get()
        try:
            await conn.send_packed_command(conn.pack_commands([*commands, FRAME] if framed else commands), False)
            replies: list[Any] = []
            for command, shape in zip(commands, shapes, strict=True):
                try:
                    reply = await conn.read_response()
                except AuthenticationError as exc:  # NOAUTH, as in _execute
                    raise AuthLost(exc) from exc
                except (ResponseError, BusyLoadingError) as exc:  # LOADING is a ConnectionError to redis-py
                    replies.append(exc)
                    continue
                if not shape(reply):
                    raise UnexpectedReply(command, reply)
                replies.append(reply)
            # An error reply to TIME (NOPERM: an ACL without it) is raised as it is: the
            # connection is dropped all the same.
            if framed and not is_frame(await conn.read_response()):
                raise StrayReply()
            if stray(conn):
                raise StrayReply()
            transient = next((r for r in replies if transient_code(r) is not None), None)
            if transient is not None:
                self._retire(conn, transient)  # as in _execute
            return replies
        except BaseException:
            await conn.disconnect(nowait=True)
            raise
        finally:
            self._pool.put(conn)

    async def _pipeline(
        self, script: Script, keys: list[bytes], tokens: list[bytes], *args: int, trailer: tuple[Any, ...] = ()
    ) -> list[Any]:
        """EVALSHA ``script`` once per key in one round trip; ``trailer`` (a WAIT) rides last
        on the same connection and its reply comes last."""

        async def run(indices: Iterable[int]) -> list[Any]:
            commands: list[tuple[Any, ...]] = [(b"EVALSHA", script.sha, 1, keys[i], tokens[i], *args) for i in indices]
            shapes = [SCRIPT_REPLY[script]] * len(commands)
            return await self._execute_many(
                commands + ([trailer] if trailer else []), shapes + [is_count] * bool(trailer)
            )

        replies = await run(range(len(keys)))
        missing = [i for i, r in enumerate(replies[: len(keys)]) if isinstance(r, NoScriptError)]
        if missing:
            # Only the calls that did not run go again (resent), the trailer behind them.
            await self._load_scripts()
            resent(replies, missing, await run(missing), len(keys))
        for reply in replies:
            if isinstance(reply, Exception):
                raise reply
        return replies

    async def _commands(self, commands: list[tuple[bytes, ...]], shapes: list[Shape]) -> list[Any]:
        """Plain commands (the Lua-free extend and release, the script loads) in one round
        trip, each reply of its ``shapes`` entry, error replies raised; one command alone
        goes by _execute. Raw replies (SET IFEQ: OK or nil)."""
        if len(commands) == 1:
            return [await self._execute(shapes[0], *commands[0])]
        replies = await self._execute_many(list(commands), shapes)
        for reply in replies:
            if isinstance(reply, Exception):
                raise reply
        return replies

    # -- the AsyncBackend interface ---------------------------------------------------

    async def acquire(
        self, key: bytes, token: bytes, ttl_ms: int, since: float | None, wait_ms: int, script: Script
    ) -> int:
        if self._config.wait_replicas:
            confirmed = self._acquire_confirmed("acquire", [key], [token], ttl_ms, script)
            return (await self._inflight.shielded([token], confirmed))[0]
        until = retry_until(since, wait_ms, self._timeout)
        results, _ = await self._inflight.shielded(
            [token], self._call("acquire", key, lambda: self._take(script, [key], [token], ttl_ms), True, until)
        )
        return results[0]

    async def acquire_many(self, keys: list[bytes], tokens: list[bytes], ttl_ms: int) -> list[int]:
        if self._config.wait_replicas:
            return await self._inflight.shielded(tokens, self._acquire_confirmed("acquire_many", keys, tokens, ttl_ms))
        results, _ = await self._inflight.shielded(
            tokens, self._call("acquire_many", None, lambda: self._take(ACQUIRE, keys, tokens, ttl_ms), True)
        )
        return results

    async def _take(
        self, script: Script, keys: list[bytes], tokens: list[bytes], ttl_ms: int, trailer: tuple[Any, ...] = ()
    ) -> tuple[list[int], list[int]]:
        """One try of the acquires, as in the sync backend (RedisPyBackend._take): each
        key's result, and the reply of ``trailer`` (a WAIT) when given."""
        # The caller's lists as they are now: another task may change them while we await.
        keys, tokens = list(keys), list(tokens)
        if not (self._transactions and by_transaction(self.dialect, script, tokens)):
            return await self._by_script(script, keys, tokens, ttl_ms, trailer)
        taking = Transaction(keys, tokens, ttl_ms, [trailer] if trailer else [], self.fenced)
        try:
            rest = taking.read(await self._execute_many(taking.commands, taking.shapes, taking.framed))
        finally:
            if taking.refused is not None and self._transactions:
                self._transactions = False
                refused_warning(self.server, taking.refused)
        if rest:
            keys, tokens = [keys[i] for i in rest], [tokens[i] for i in rest]
            taking.scripted(rest, *await self._by_script(ACQUIRE, keys, tokens, ttl_ms, trailer))
        return taking.outcome()

    async def _by_script(
        self, script: Script, keys: list[bytes], tokens: list[bytes], ttl_ms: int, trailer: tuple[Any, ...]
    ) -> tuple[list[int], list[int]]:
        """The acquires as ``script``, in one round trip: each key's result, and the trailer's reply."""
        if len(keys) == 1 and not trailer:
            return [await self._evalsha(script, keys[0], tokens[0], ttl_ms)], []
        replies = await self._pipeline(script, keys, tokens, ttl_ms, trailer=trailer)
        return replies[: len(keys)], replies[len(keys) :]

    async def _acquire_confirmed(
        self, what: str, keys: list[bytes], tokens: list[bytes], ttl_ms: int, script: Script = ACQUIRE
    ) -> list[int]:
        """Under wait_replicas: the acquires and a WAIT behind them on the same connection
        (WAIT confirms the writes made before it on its own connection), in one round trip
        (and one more, with its own WAIT, for the keys a transaction leaves to the script)."""
        config = self._config
        wait = ("WAIT", config.wait_replicas, wait_ms(config))
        results, waited = await self._call(
            what, keys[0] if len(keys) == 1 else None, lambda: self._take(script, keys, tokens, ttl_ms, wait), True
        )
        confirmed = waited[0]
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

    async def _extend_confirmed(self, what: str, keys: list[bytes], tokens: list[bytes], ttl_ms: int) -> list[bool]:
        """Under wait_replicas: the extends and a WAIT behind them in one round trip, as for
        the acquires; by script, as in hotlock.backends.native_async (one write, one WAIT).
        Not resent: a lost reply is a CacheError."""
        config = self._config
        wait = ("WAIT", config.wait_replicas, wait_ms(config))
        replies = await self._call(
            what,
            keys[0] if len(keys) == 1 else None,
            lambda: self._pipeline(EXTEND, keys, tokens, ttl_ms, trailer=wait),
        )
        results, confirmed = [bool(r) for r in replies[:-1]], replies[-1]
        if confirmed >= config.wait_replicas or not any(results):
            return results
        held = [(k, t) for k, t, ok in zip(keys, tokens, results, strict=True) if ok]
        # If the release fails too, the keys expire by their TTL; the leases are lost either way.
        with contextlib.suppress(CacheError):
            await self._call(
                "release", None, lambda: self._pipeline(RELEASE, [k for k, _ in held], [t for _, t in held])
            )
        raise unconfirmed_renewals(what, results, confirmed, config)

    async def extend(self, key: bytes, token: bytes, ttl_ms: int) -> bool:
        if self._config.wait_replicas:
            return (await self._extend_confirmed("extend", [key], [token], ttl_ms))[0]
        if self.dialect.lua_free and not by_script([token]):
            # SET IFEQ replies OK or nil: the key held this value or not.
            command = extend_command(key, token, ttl_ms)
            try:
                if (await self._call("extend", key, lambda: self._commands([command], [is_ok_or_nil])))[0]:
                    return True
                # SET IFEQ compares the whole value: a lock a waiter marked ('+') is
                # extended by the script, which accepts the mark (contended, or lost).
            except CacheError as exc:
                if not reply_serves_script(exc):
                    raise
                # Refused at maxmemory, or the key now holds permits: the script serves (see _dialect).
        return bool(await self._call("extend", key, lambda: self._evalsha(EXTEND, key, token, ttl_ms)))

    async def extend_many(self, keys: list[bytes], tokens: list[bytes], ttl_ms: int) -> list[bool]:
        if self._config.wait_replicas:
            return await self._extend_confirmed("extend_many", list(keys), list(tokens), ttl_ms)
        if self.dialect.lua_free and not by_script(tokens):
            sets = [extend_command(k, t, ttl_ms) for k, t in zip(keys, tokens, strict=True)]
            try:
                shapes: list[Shape] = [is_ok_or_nil] * len(sets)
                done = [bool(r) for r in await self._call("extend_many", None, lambda: self._commands(sets, shapes))]
            except CacheError as exc:
                if not reply_serves_script(exc):
                    raise
                # Refused at maxmemory, or the key now holds permits: the script serves (see _dialect).
            else:
                # What SET IFEQ missed once more by script, which accepts a waiter's mark ('+').
                missed = [i for i, ok in enumerate(done) if not ok]
                if missed:
                    mk, mt = [keys[i] for i in missed], [tokens[i] for i in missed]
                    again = await self._call("extend_many", None, lambda: self._pipeline(EXTEND, mk, mt, ttl_ms))
                    for i, r in zip(missed, again, strict=True):
                        done[i] = bool(r)
                return done
        replies = await self._call("extend_many", None, lambda: self._pipeline(EXTEND, keys, tokens, ttl_ms))
        return [bool(r) for r in replies]

    async def release(self, key: bytes, token: bytes) -> bool:
        await self._inflight.settled([token])
        # A lost release reply is retried, as in sync: the second try finds the key gone
        # (False) or still ours (releases it), and either way the caller sees no error.
        if self.dialect.lua_free and not by_script([token]):
            command = release_command(self.dialect, key, token)

            async def plain_then_script() -> bool:
                try:
                    if (await self._call("release", key, lambda: self._commands([command], [is_flag]), True))[0]:
                        return True
                except CacheError as exc:
                    if not reply_serves_script(exc):  # WRONGTYPE: the key now holds permits
                        raise
                # DELIFEQ/DELEX compare the whole value: a lock a waiter marked ('+') is
                # released by the script, which accepts the mark and wakes the waiter.
                return bool(await self._call("release", key, lambda: self._evalsha(RELEASE, key, token), True))

            return await self._inflight.shielded([token], plain_then_script())
        work = self._call("release", key, lambda: self._evalsha(RELEASE, key, token), True)
        return bool(await self._inflight.shielded([token], work))

    async def release_many(self, keys: list[bytes], tokens: list[bytes]) -> list[bool]:
        await self._inflight.settled(tokens)
        if self.dialect.lua_free and not by_script(tokens):
            dels = [release_command(self.dialect, k, t) for k, t in zip(keys, tokens, strict=True)]

            async def plain_then_script() -> list[Any]:
                try:
                    shapes: list[Shape] = [is_flag] * len(dels)
                    done = list(await self._call("release_many", None, lambda: self._commands(dels, shapes), True))
                except CacheError as exc:
                    if not reply_serves_script(exc):  # WRONGTYPE: a key now holds permits
                        raise
                    done = [0] * len(keys)
                missed = [i for i, r in enumerate(done) if not r]  # once more by script, as in release
                if missed:
                    mk, mt = [keys[i] for i in missed], [tokens[i] for i in missed]
                    again = await self._call("release_many", None, lambda: self._pipeline(RELEASE, mk, mt), True)
                    for i, r in zip(missed, again, strict=True):
                        done[i] = r
                return done

            work = plain_then_script()
        else:
            work = self._call("release_many", None, lambda: self._pipeline(RELEASE, keys, tokens), True)
        replies = await self._inflight.shielded(tokens, work)
        return [bool(r) for r in replies]

    async def set_nx(self, key: bytes, value: bytes, ttl_ms: int) -> bool:
        command = (b"SET", key, value, b"NX", b"PX", ttl_ms)
        reply = await self._call("set_nx", key, lambda: self._execute(is_ok_or_nil, *command))
        return reply is not None

    async def incr(self, key: bytes, amount: int) -> int:
        reply: int = await self._call("incr", key, lambda: self._execute(is_int, b"INCRBY", key, amount))
        return reply

    async def info(self) -> dict[str, str] | None:
        try:
            raw = await self._execute(is_text, b"INFO")
        except NoPermissionError:
            return None
        except (RedisError, OSError) as exc:
            raise cache_error(f"INFO failed: {describe(exc)}", self.server) from exc
        return info_fields(raw)

    async def command_info(self) -> list[Any] | None:
        """COMMAND INFO DELIFEQ DELEX's reply, or None when the server or its ACL refuses it."""
        try:
            reply = await self._call("COMMAND INFO", None, lambda: self._execute(is_anything, *COMMAND_PROBE))
        except CacheError as exc:
            return probe_refused(exc)
        return reply if isinstance(reply, list) else None

    async def close(self) -> None:
        if self.wake_slot is not None:
            await self.wake_slot.close()
        self._closing = True
        await self._inflight.close(self._timeout)
        await self._pool.disconnect()
