"""The pure-Python async backend on redis.asyncio: where the extension is not built.

The same semantics as the sync redis-py backend: its retries off and its timeouts on,
NOSCRIPT loads the scripts and retries once, a lost acquire reply is retried once with
the same token, READONLY drops every connection.
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

import redis.asyncio as aioredis
from redis.asyncio.connection import AbstractConnection, Connection, SSLConnection, UnixDomainSocketConnection
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff
from redis.exceptions import (
    AuthenticationError,
    BusyLoadingError,
    RedisError,
    ResponseError,
)
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError

from .._config import KEEPALIVE_OPTIONS, ServerConfig
from .._credentials import reauth_command_async
from .._exchange import (
    FRAME,
    Exchange,
    Failure,
    Lost,
    Send,
    Steps,
    drive_async,
    is_frame,
    retires,
)
from .._inflight import InFlight, within
from .._scripts import SCRIPTS, Script
from .._sentinel import PrimaryWatch
from ..errors import CacheError, LinkLost, ReplyError, cache_error
from .redispy import (
    AMBIGUOUS,
    AuthLost,
    StrayReply,
    UnexpectedReply,
    connection_kwargs,
    describe,
    failure_kind,
    lost_handshake,
    reauth_due,
    refusal_text,
    reply_error,
    tls_hint,
)
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
            replies = await link.link_call([(b"SCRIPT", b"LOAD", s.source) for s in SCRIPTS], None)
        except LinkLost as exc:
            await link.link_close()
            raise cache_error(f"connect failed: {exc}", link.server) from exc
        for reply in replies:
            if isinstance(reply, ReplyError):
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
                    return [ReplyError(refusal_text(exc))] * len(commands)
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
                    return replies + [ReplyError(refusal_text(exc))] * (len(commands) - len(replies))
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


class RedisAsyncBackend(Exchange):
    name = "redis-py"

    def __init__(self, config: ServerConfig) -> None:
        super().__init__(config)
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

    @classmethod
    async def open(cls, config: ServerConfig) -> RedisAsyncBackend:
        backend = cls(config)
        backend.clock = asyncio.get_running_loop().time  # the clock of the budgets handed in
        try:
            await backend._load_scripts()
        except BaseException:
            await backend.close()
            raise
        return backend

    # -- plumbing ---------------------------------------------------------------------

    async def _carry(self, step: Send) -> list[Any]:
        """One Send of hotlock._exchange on a pooled connection, within the step's time:
        its replies, error replies as ReplyError, or the Failure that lost them."""
        if self._watch is not None:
            await self._follow_primary()
        try:
            work = self._execute(step)
            return await (work if step.timeout is None else within(work, step.timeout))
        except TimeoutError as exc:  # the step's own time ran out (within)
            raise (Failure if self._closing else Lost)(describe(RedisTimeoutError())) from exc
        except (RedisError, OSError) as exc:
            # close() ends the calls in flight: no second try.
            kind = Failure if self._closing else failure_kind(exc)
            raise kind(f"{describe(exc)}{tls_hint(self._config, exc)}") from exc

    async def _execute(self, step: Send) -> list[Any]:
        """The commands written at once on one connection and every reply read, error
        replies in place as ReplyError; several framed by a trailing TIME as in the sync
        backend, unless the step says their replies frame themselves.

        Straight on the connection, not through Redis.execute_command, which adds per
        command a retry wrapper (ours is off), response callbacks and observability hooks:
        together more client CPU than the command itself, on the path every lock takes
        twice (bench/profile_notes.md). A connection that a failure or a cancellation
        leaves with a reply in flight is closed, never reused out of step, and so is one
        whose reply is not of the command's shape (UnexpectedReply) or has more behind it
        (StrayReply, a lost reply)."""
        commands = step.commands
        framed = step.frame and len(commands) > 1
        conn = await self._pool.get()
        try:
            await conn.send_packed_command(conn.pack_commands([*commands, FRAME] if framed else commands), False)
            replies: list[Any] = []
            for command, shape in zip(commands, step.shapes, strict=True):
                try:
                    # Not disconnected on an error reply: LOADING, which redis-py raises as a
                    # ConnectionError, would lose the replies behind it (a failure leaves the
                    # connection closed all the same).
                    reply = await conn.read_response(disconnect_on_error=False)
                except AuthenticationError as exc:  # NOAUTH: not authenticated any more
                    raise AuthLost(exc) from exc
                except (ResponseError, BusyLoadingError) as exc:  # LOADING is a ConnectionError to redis-py
                    replies.append(reply_error(exc))
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
            # A transient reply: the command did not run, and its resend goes on a fresh
            # connection; READONLY: neither does any other connection of the pool.
            retired = max((retires(r) for r in replies if isinstance(r, ReplyError)), default=0)
            if retired == 2:
                self._pool.retire()
            elif retired:
                self._pool.forget(conn)
            return replies
        except BaseException:
            await conn.disconnect(nowait=True)
            raise
        finally:
            self._pool.put(conn)

    def _run(self, steps: Steps[T]) -> Awaitable[T]:
        return drive_async(steps, self._carry)

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

    async def _load_scripts(self) -> None:
        await self._run(self.load_steps())

    # -- the AsyncBackend interface ---------------------------------------------------

    async def acquire(
        self, key: bytes, token: bytes, ttl_ms: int, since: float | None, wait_ms: int, script: Script
    ) -> int:
        until = self.retry_until(wait_ms, since)
        steps = self.acquire_steps("acquire", [key], [token], ttl_ms, script, until)
        return (await self._inflight.shielded([token], self._run(steps)))[0]

    async def acquire_many(self, keys: list[bytes], tokens: list[bytes], ttl_ms: int) -> list[int]:
        # The caller's lists as they are now: another task may change them while we await.
        keys, tokens = list(keys), list(tokens)
        return await self._inflight.shielded(
            tokens, self._run(self.acquire_steps("acquire_many", keys, tokens, ttl_ms))
        )

    async def extend(self, key: bytes, token: bytes, ttl_ms: int) -> bool:
        return (await self._run(self.extend_steps("extend", [key], [token], ttl_ms)))[0]

    async def extend_many(self, keys: list[bytes], tokens: list[bytes], ttl_ms: int) -> list[bool]:
        return await self._run(self.extend_steps("extend_many", list(keys), list(tokens), ttl_ms))

    async def release(self, key: bytes, token: bytes) -> bool:
        await self._inflight.settled([token])
        return (await self._inflight.shielded([token], self._run(self.release_steps("release", [key], [token]))))[0]

    async def release_many(self, keys: list[bytes], tokens: list[bytes]) -> list[bool]:
        keys, tokens = list(keys), list(tokens)
        await self._inflight.settled(tokens)
        return await self._inflight.shielded(tokens, self._run(self.release_steps("release_many", keys, tokens)))

    async def set_nx(self, key: bytes, value: bytes, ttl_ms: int) -> bool:
        return await self._run(self.set_nx_steps(key, value, ttl_ms))

    async def incr(self, key: bytes, amount: int) -> int:
        return await self._run(self.incr_steps(key, amount))

    async def info(self) -> dict[str, str] | None:
        return await self._run(self.info_steps())

    async def command_info(self) -> list[Any] | None:
        return await self._run(self.command_info_steps())

    async def close(self) -> None:
        if self.wake_slot is not None:
            await self.wake_slot.close()
        self._closing = True
        await self._inflight.close(self._timeout)
        await self._pool.disconnect()
