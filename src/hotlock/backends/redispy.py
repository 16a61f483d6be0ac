"""The pure-Python backend on redis-py: where the extension is not built, and for TLS
when the linked hiredis has none.

redis-py's own retries are off (``Retry(NoBackoff(), 0)``) and its timeouts on: the
library owns its retries, so a blackholed server costs one reply timeout, not ten.
"""

from __future__ import annotations

import contextlib
import contextvars
import inspect
import itertools
import logging
import os
import ssl
import time
from collections.abc import Callable
from typing import Any, NoReturn, TypeVar

import redis
from redis._parsers import BaseParser
from redis.backoff import NoBackoff
from redis.credentials import CredentialProvider
from redis.exceptions import (
    AuthenticationError,
    BusyLoadingError,
    RedisError,
    ResponseError,
)
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError
from redis.retry import Retry

from .._config import KEEPALIVE_OPTIONS, LIB_NAME, ServerConfig, lib_version, redispy_tls_kwargs
from .._credentials import ask, ask_async, reauth_command
from .._exchange import (
    FRAME,
    Exchange,
    Failure,
    Lost,
    NotSent,
    Send,
    Shape,
    Steps,
    drive,
    is_frame,
    retires,
)
from .._scripts import (
    SCRIPTS,
    Script,
)
from .._sentinel import PrimaryWatch
from ..errors import CacheError, LinkLost, ReplyError, cache_error
from .wakeup import slot, wait

__all__ = ["RedisPyBackend", "RedisPyLink"]

T = TypeVar("T")

log = logging.getLogger("hotlock")

# The errors after which a request may or may not have reached the server. Shared with redispy_async.
AMBIGUOUS = (RedisConnectionError, RedisTimeoutError, OSError)


class UnexpectedReply(RedisError):
    """A reply of a shape its command never answers: the connection it came on is dropped.
    Not a lost reply: the same server would answer a retry the same way."""

    def __init__(self, command: tuple[Any, ...], reply: object) -> None:
        name = command[0].decode() if isinstance(command[0], bytes) else str(command[0])
        # An integer is shown; anything else only by its type (it might echo a token).
        shown = repr(reply) if type(reply) in (int, float, bool) or reply is None else f"a {type(reply).__name__}"
        super().__init__(f"unexpected reply to {name}: {shown}")


class StrayReply(RedisConnectionError):
    """More on the connection than the replies asked for (an extra reply, or the real one
    behind a RESP3 attribute): which reply answers what is in doubt, so the connection is
    dropped and the call counts as one whose reply was lost."""

    def __init__(self) -> None:
        super().__init__("a reply beyond the ones asked for: the connection was dropped")


def stray(conn: Any) -> bool:
    """Whether a reply, or part of one, sits read but unparsed in ``conn``'s parser after
    the replies a call asked for: a buffer check, no system call. What a server sends later
    than its last reply is found when the pool hands the connection out again (its
    can_read() polls the socket), before anything is written on it."""
    parser = conn._parser
    reader = getattr(parser, "_reader", None)  # hiredis
    if reader is not None:
        return bool(reader.has_data())
    unread = getattr(getattr(parser, "_buffer", None), "unread_bytes", None)  # redis-py's own parser
    return unread is not None and unread() > 0


class HandshakeLost(RedisConnectionError):
    """A new connection's handshake (AUTH, SELECT) lost its reply: nothing of the call was
    sent, so one more try is safe for any command. Shared with aio/_redispy."""


def tls_refused(exc: BaseException) -> bool:
    """Whether ``exc`` comes from a TLS failure that the same try would meet again: a
    certificate that does not verify, the server's alert (a client certificate it requires),
    a protocol error (no TLS on that port). Never retried as a lost reply. A TLS stream cut
    short (SSLEOFError) is a lost connection like any other. Shared with aio/_redispy."""
    seen: BaseException | None = exc
    for _ in range(8):
        if seen is None:
            return False
        if isinstance(seen, ssl.SSLError) and not isinstance(
            seen, ssl.SSLEOFError | ssl.SSLZeroReturnError | ssl.SSLWantReadError | ssl.SSLWantWriteError
        ):
            return True
        seen = seen.__cause__ or seen.__context__
    return False


# Error replies that redis-py raises as ConnectionError: the server answered (no reply was
# lost) and refused the connection, as it will refuse the same connect again.
# redis-py 8.2 and later name the server's "max number of clients reached"; before, it is a
# plain ConnectionError, taken as a lost connection.
_MAX_CLIENTS = getattr(redis.exceptions, "MaxClientsReachedError", None)
REFUSALS: tuple[type[BaseException], ...] = (AuthenticationError,) + (() if _MAX_CLIENTS is None else (_MAX_CLIENTS,))


def failure_kind(exc: BaseException) -> type[Failure]:
    """What a redis-py failure is to hotlock._exchange: nothing of the call ran (NotSent:
    a new connection's handshake lost its reply, or the server no longer holds a live
    connection authenticated), its reply lost (Lost), or an answer no retry mends (a
    refusal at connect, a reply out of shape). Shared with redispy_async."""
    if isinstance(exc, HandshakeLost | AuthLost):
        return NotSent
    return Lost if isinstance(exc, AMBIGUOUS) and not refused(exc) else Failure


def refused(exc: BaseException) -> bool:
    """Whether ``exc`` is a refusal, not a lost reply: a wrong password, no room for one more
    client, a TLS failure (tls_refused). Never retried. Shared with aio/_redispy."""
    return isinstance(exc, REFUSALS) or tls_refused(exc)


def tls_hint(config: ServerConfig, exc: BaseException) -> str:
    """What to add to a failure over TLS without a client certificate that ended in a
    stream cut short (SSLEOFError, a reset): a server that requires one judges it after the
    handshake (TLS 1.3), and its alert can lose the race with the close that follows it.
    Shared with aio/_redispy."""
    if not config.tls or config.ssl.certfile is not None:
        return ""
    seen: BaseException | None = exc
    for _ in range(8):
        if isinstance(seen, ssl.SSLEOFError | ConnectionResetError):
            return " (the server closed the TLS connection: if it requires a client certificate, give ssl_certfile)"
        if seen is None:
            break
        seen = seen.__cause__ or seen.__context__
    return ""


# While a call retries after a lost reply: the time.monotonic() by which it must be done.
# A new connection's handshake (AUTH, CLIENT SETINFO...) reads under what is left of it
# rather than a whole reply timeout, as the native client's handshake does.
_RETRY_UNTIL: contextvars.ContextVar[float | None] = contextvars.ContextVar("hotlock_retry_until", default=None)


class AuthLost(RedisConnectionError):
    """NOAUTH or WRONGPASS on a live connection (after its handshake): it is no longer
    authenticated, so the command did not run, and the connection is closed. Not a refusal
    at connect (redis-py's AuthenticationError, from the handshake): the call goes once
    more on a new connection, which asks the credential provider again. Shared with
    aio/_redispy."""

    def __init__(self, exc: AuthenticationError) -> None:
        super().__init__(f"the server replied {refusal_text(exc)}")


def _handshake(conn: Any) -> None:
    """redis-py's own handshake (redis_connect_func), its lost reply told apart from a lost
    reply to the call's command, and bounded by a retrying call's budget (_RETRY_UNTIL)."""
    until = _RETRY_UNTIL.get()
    sock = conn._sock
    if until is not None and sock is not None:
        sock.settimeout(max(until - time.monotonic(), 0.001))
    try:
        conn.on_connect()
    except AMBIGUOUS as exc:
        lost_handshake(exc)
    except CacheError:
        # The credential provider failed (hotlock._credentials): redis-py disconnects only
        # on its own errors, and a socket left open unauthenticated would be pooled.
        conn.disconnect()
        raise
    finally:
        if until is not None and sock is not None:
            with contextlib.suppress(OSError):
                sock.settimeout(conn.socket_timeout)
    conn.hotlock_authed = time.monotonic()


def lost_handshake(exc: BaseException) -> NoReturn:
    """Raise what a new connection's handshake failed with (one of AMBIGUOUS): HandshakeLost
    for a lost reply, or ``exc`` as it is when it is an answer: a LOADING reply (a
    ConnectionError to redis-py), a refusal (AUTH refused, say). Shared with redispy_async."""
    if isinstance(exc, (BusyLoadingError, *REFUSALS)):
        raise exc
    raise HandshakeLost(f"handshake: {describe(exc)}") from exc


class AskedProvider(CredentialProvider):
    """connect(credential_provider=...) as redis-py asks it at each new connection: the
    answer normalized and the provider's failure a CacheError naming it
    (hotlock._credentials), for redis.asyncio too. The user's provider is wrapped rather
    than handed over: a plain object with get_credentials() alone would fail in
    redis.asyncio, which awaits get_credentials_async()."""

    def __init__(self, config: ServerConfig) -> None:
        assert config.credential_provider is not None
        self._provider = config.credential_provider
        self._server = config.display

    def get_credentials(self) -> Any:
        return _redispy_auth(*ask(self._provider, self._server))

    async def get_credentials_async(self) -> Any:
        return _redispy_auth(*await ask_async(self._provider, self._server))


def _redispy_auth(username: str | None, password: str | None) -> tuple[str, ...]:
    # A username alone goes as that user with an empty password, as auth_args sends it.
    if username:
        return (username, password or "")
    return () if password is None else (password,)


def reauth_due(conn: Any, interval: float) -> bool:
    """Whether ``conn`` last authenticated ``interval`` s ago or more (interval 0: never due)."""
    return interval > 0 and time.monotonic() - getattr(conn, "hotlock_authed", 0.0) >= interval


def reauthenticate(conn: Any, config: ServerConfig) -> None:
    """AUTH again on a live connection, with what the provider says now (reauth_interval):
    no reconnect. A refusal (WRONGPASS) is redis-py's AuthenticationError, which closes the
    connection; the call then goes once more on a new one, which asks again (_call)."""
    conn.hotlock_authed = time.monotonic()
    command = reauth_command(config)  # None also when the provider failed (logged)
    if command is not None:
        conn.send_command(*command)
        conn.read_response()


class _Addressed(redis.Connection):
    """The TCP connect to ``_address`` while ``host`` holds the TLS server name
    (ssl_server_name): redis-py checks the certificate against, and sends as SNI, the host
    it connects to. Sits between SSLConnection and Connection (TLSConnection's bases), so
    SSLConnection's TCP connect comes here and its TLS wrap sees the name."""

    _address: str | None = None

    def _connect(self) -> Any:
        if self._address is None:
            return super()._connect()  # type: ignore[no-untyped-call]
        name, self.host = self.host, self._address
        try:
            return super()._connect()  # type: ignore[no-untyped-call]
        finally:
            self.host = name


class _PrimaryConnection(_Addressed):
    """A connection to whichever primary the sentinels name at the moment it connects."""

    def __init__(self, *, primary: PrimaryWatch, **kwargs: Any) -> None:
        super().__init__(**kwargs)  # type: ignore[no-untyped-call]
        self._primary = primary

    def _connect(self) -> Any:
        host, self.port = self._primary.address()
        if getattr(self, "_server_name", None) is not None:
            self._address = host  # TLS checks the name (_Addressed)
        else:
            self.host = host
        return super()._connect()


class TLSConnection(redis.SSLConnection, _Addressed):
    """TLS that is not mistaken for a dirty connection.

    The pool asks can_read() before handing out a connection and drops one that has data.
    With the hiredis parser that means "the socket is readable", and a TLS 1.3 server's
    session tickets, sent just after the handshake, make it readable with no reply in it:
    a fresh connection then fails "Connection not ready" about one time in seven. Reading
    without blocking lets OpenSSL take the tickets; only a reply (stale data) or EOF count.

    With ssl_server_name, the certificate is checked against that name (sent as SNI) while
    the TCP connect goes to the host (_Addressed).
    """

    def __init__(self, *, ssl_server_name: str | None = None, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self._server_name = ssl_server_name
        if ssl_server_name is not None:
            self._address, self.host = self.host, ssl_server_name

    def can_read(self, timeout: float = 0) -> bool:
        parser = self._parser
        reader = getattr(parser, "_reader", None)
        if reader is not None and not reader.has_data() and hasattr(parser, "read_from_socket"):
            return bool(parser.read_from_socket(timeout=timeout, raise_on_timeout=False))
        return bool(super().can_read(timeout))


class PrimaryTLSConnection(_PrimaryConnection, TLSConnection):
    """rediss+sentinel://: TLS to whichever primary the sentinels name, its certificate
    checked against that announced address."""


def naming_kwargs(config: ServerConfig, client: Callable[..., object]) -> dict[str, Any]:
    """redis-py's own handshake arguments that name a connection as the native client
    names its own (_config.naming_commands: CLIENT SETNAME, CLIENT SETINFO lib-name hotlock
    and lib-ver, whose refusal redis-py ignores too); ``client`` is redis.Redis.__init__ or
    redis.asyncio.Redis.__init__. Shared with aio/_redispy."""
    kwargs: dict[str, Any] = {"client_name": config.client_name}
    if "driver_info" in inspect.signature(client).parameters:  # redis-py 7+
        from redis.driver_info import DriverInfo

        kwargs["driver_info"] = DriverInfo(name=LIB_NAME, lib_version=lib_version())
    else:
        kwargs["lib_name"], kwargs["lib_version"] = LIB_NAME, lib_version()
    return kwargs


def connection_kwargs(
    config: ServerConfig, client: Callable[..., object], handshake: object, retry: object
) -> dict[str, Any]:
    """redis-py connection settings for ``config``, sync and async alike: our timeouts, its
    retries off (``retry``: its own Retry class's, with no retry), RESP2; ``client`` as in
    naming_kwargs, ``handshake`` the redis_connect_func of its connections. Shared with
    redispy_async."""
    kwargs: dict[str, Any] = {
        "username": config.username,
        "password": config.password,
        "db": config.db,
        "socket_timeout": config.timeout,
        "socket_connect_timeout": config.connect_timeout,
        "retry": retry,
        # RESP2: redis-py 8 otherwise opens every connection with HELLO 3, a round trip
        # (and an ACL permission) that would also eat into a lost-reply retry's budget.
        "protocol": 2,
        # The handshake's lost reply told apart from the call's (HandshakeLost): any call may retry it.
        "redis_connect_func": handshake,
        # CLIENT SETNAME and CLIENT SETINFO lib-name hotlock, lib-ver.
        **naming_kwargs(config, client),
    }
    if config.tls:
        # The rediss:// settings (ssl_ca_certs, ...), as the native client takes them.
        kwargs.update(redispy_tls_kwargs(config.ssl))
    if config.credential_provider is not None:
        # Asked by redis-py at each new connection (redis-py refuses it beside a password;
        # redis.asyncio asks get_credentials_async).
        kwargs["credential_provider"] = AskedProvider(config)
    return kwargs


def _connection_kwargs(config: ServerConfig) -> dict[str, Any]:
    """The sync connections' settings: connection_kwargs, with TCP keepalive and no health check."""
    return {
        **connection_kwargs(config, redis.Redis.__init__, _handshake, Retry(NoBackoff(), 0)),
        "socket_keepalive": True,
        "socket_keepalive_options": KEEPALIVE_OPTIONS,
        "health_check_interval": 0,
    }


class RedisPyBackend(Exchange):
    name = "redis-py"

    def __init__(self, config: ServerConfig) -> None:
        super().__init__(config)
        self._config = config
        self._watch: PrimaryWatch | None = None
        if config.sentinels:
            # One resolver for every backend (ServerConfig.primary: SENTINEL
            # get-master-addr-by-name) asked at each connect, rather than redis.sentinel,
            # whose SENTINEL MASTERS check skips a sentinel that has just switched and can
            # hand out the old primary for a while after a failover. The watch drops pooled
            # connections once the sentinels name another primary, since the old one may
            # accept writes until Sentinel demotes it.
            self._watch = PrimaryWatch(config.primary)
            self._epoch = 0
        self._pid = os.getpid()
        self._client: Any = self._new_client()  # redis.Redis; Any: the connection-level API it reaches is untyped
        # The wake-up subscriber (hotlock.backends.wakeup), made on the first contended lock_wait.
        self._wakeups = slot(config)
        # Bumped by _drop_all: a connection taken before that is disconnected when given back.
        self._generations = itertools.count()
        self._generation = next(self._generations)
        self._load_scripts()

    # -- plumbing ---------------------------------------------------------------------

    def _new_client(self) -> Any:
        config = self._config
        kwargs = _connection_kwargs(config)
        if self._watch is not None:
            primary_kind = PrimaryTLSConnection if config.tls else _PrimaryConnection
            pool = redis.ConnectionPool(connection_class=primary_kind, primary=self._watch, **kwargs)
        elif config.unix_path is not None:
            return redis.Redis(unix_socket_path=config.unix_path, **kwargs)
        else:
            # TLS through redis-py's SSLConnection defaults: certificate and hostname checked.
            kind = TLSConnection if config.tls else redis.Connection
            pool = redis.ConnectionPool(connection_class=kind, host=config.host, port=config.port, **kwargs)
        return redis.Redis(connection_pool=pool)

    @property
    def _redis(self) -> Any:
        """This process's client. A forked child makes its own and leaves the parent's pool
        alone: its sockets are the parent's, and redis-py's own reset of it in the child
        waits for ever on a pool lock that another thread of the parent held at the fork."""
        if self._pid != os.getpid():
            self._pid = os.getpid()
            self._client = self._new_client()
        return self._client

    def _send(
        self, commands: list[tuple[Any, ...]], shapes: list[Shape], timeout: float | None = None, frame: bool = True
    ) -> list[Any]:
        """Write ``commands`` at once on one pooled connection and read every reply, each
        checked against its ``shapes`` entry (UnexpectedReply), then that nothing more came
        (StrayReply). Several commands are framed (FRAME) unless ``frame`` is False: their
        replies frame themselves.

        Error replies come back in place as ReplyError (NOSCRIPT included). With
        ``timeout``, all the replies together get at most that many seconds, else each gets
        the connection's reply timeout. A lost, stray or unexpected reply leaves the
        connection closed.
        """
        pool = self._redis.connection_pool
        if self._watch is not None and self._watch.refresh() != self._epoch:
            # A failover: connections to the replaced primary must not take another write.
            self._epoch = self._watch.epoch
            self._drop_all()
        generation = self._generation
        conn = pool.get_connection()
        complete = False
        fresh = False  # a transient reply came: this connection is not used again
        framed = frame and len(commands) > 1
        try:
            if reauth_due(conn, self._config.reauth_interval):
                try:
                    reauthenticate(conn, self._config)
                except AuthenticationError as exc:
                    raise AuthLost(exc) from exc
            conn.send_packed_command(conn.pack_commands([*commands, FRAME] if framed else commands))
            deadline = None if timeout is None else time.monotonic() + timeout
            replies: list[Any] = []
            for command, shape in zip(commands, shapes, strict=True):
                kw = {} if deadline is None else {"timeout": max(deadline - time.monotonic(), 0.001)}
                try:
                    # Not disconnected on an error reply: LOADING, which redis-py raises as a
                    # ConnectionError, would lose the replies behind it (a failure leaves the
                    # connection closed all the same: below).
                    reply = conn.read_response(disconnect_on_error=False, **kw)
                except (ResponseError, BusyLoadingError) as exc:  # LOADING is a ConnectionError to redis-py
                    error = reply_error(exc)
                    replies.append(error)
                    retired = retires(error)
                    # A transient reply: the command did not run, and its resend goes on a
                    # fresh connection. READONLY: the endpoint reaches a replica now, and no
                    # connection of this cache to it takes another command.
                    fresh = fresh or retired > 0
                    if retired == 2:
                        self._drop_all()
                    continue
                except AuthenticationError as exc:
                    raise AuthLost(exc) from exc
                if not shape(reply):
                    raise UnexpectedReply(command, reply)
                replies.append(reply)
            if framed:
                kw = {} if deadline is None else {"timeout": max(deadline - time.monotonic(), 0.001)}
                # An error reply to TIME (NOPERM: an ACL without it) is raised as it is: the
                # connection is dropped all the same.
                if not is_frame(conn.read_response(**kw)):
                    raise StrayReply()
            if stray(conn):
                raise StrayReply()
            complete = True
            return replies
        finally:
            if not complete or fresh or generation != self._generation:
                # Interrupted between replies (KeyboardInterrupt, say), or a reply out of
                # shape or beyond the count: replies may still be on their way, and the next
                # user of this connection would read them. Or dropped (close(), a failover)
                # while this call used it.
                conn.disconnect()
            pool.release(conn)

    def _drop_all(self) -> None:
        """Disconnect every pooled connection: the idle ones now, the ones calls are using
        when each call gives its own back (_send). Disconnecting a connection under a call
        of another thread would close its socket mid-read: redis-py then raises TypeError
        or ValueError from deep inside, not an error of the connection."""
        self._generation = next(self._generations)
        self._redis.connection_pool.disconnect(inuse_connections=False)

    def _carry(self, step: Send) -> list[Any]:
        """One Send of hotlock._exchange on a pooled connection: its replies, error replies
        as ReplyError, or the Failure that lost them. A retry's handshake reads under the
        step's time, too (_handshake)."""
        reset = None if step.timeout is None else _RETRY_UNTIL.set(time.monotonic() + step.timeout)
        try:
            return self._send(step.commands, step.shapes, step.timeout, step.frame)
        except (RedisError, OSError) as exc:
            kind = failure_kind(exc)
            raise kind(f"{describe(exc)}{tls_hint(self._config, exc)}") from exc
        finally:
            if reset is not None:
                _RETRY_UNTIL.reset(reset)

    def _run(self, steps: Steps[T]) -> T:
        return drive(steps, self._carry)

    def _load_scripts(self) -> None:
        self._run(self.load_steps())

    # -- the Backend interface --------------------------------------------------------

    def acquire(self, key: bytes, token: bytes, ttl_ms: int) -> int:
        return self._run(self.acquire_steps("acquire", [key], [token], ttl_ms, until=self.retry_until()))[0]

    def acquire_wait(self, key: bytes, token: bytes, ttl_ms: int, wait_ms: int) -> tuple[int, float, int]:
        until = self.retry_until(wait_ms)

        def attempt(script: Script) -> int:
            return self._run(self.acquire_steps("acquire", [key], [token], ttl_ms, script, until))[0]

        return wait(self._wakeups, key, attempt, wait_ms)

    def acquire_many(self, keys: list[bytes], tokens: list[bytes], ttl_ms: int) -> list[int]:
        # The caller's lists as they are now: another thread may change them during the round trip.
        return self._run(self.acquire_steps("acquire_many", list(keys), list(tokens), ttl_ms))

    def extend(self, key: bytes, token: bytes, ttl_ms: int) -> bool:
        return self._run(self.extend_steps("extend", [key], [token], ttl_ms))[0]

    def extend_many(self, keys: list[bytes], tokens: list[bytes], ttl_ms: int) -> list[bool]:
        return self._run(self.extend_steps("extend_many", list(keys), list(tokens), ttl_ms))

    def release(self, key: bytes, token: bytes) -> bool:
        return self._run(self.release_steps("release", [key], [token]))[0]

    def release_many(self, keys: list[bytes], tokens: list[bytes]) -> list[bool]:
        return self._run(self.release_steps("release_many", list(keys), list(tokens)))

    def set_nx(self, key: bytes, value: bytes, ttl_ms: int) -> bool:
        return self._run(self.set_nx_steps(key, value, ttl_ms))

    def incr(self, key: bytes, amount: int) -> int:
        return self._run(self.incr_steps(key, amount))

    def info(self) -> dict[str, str] | None:
        return self._run(self.info_steps())

    def command_info(self) -> list[Any] | None:
        return self._run(self.command_info_steps())

    def close(self) -> None:
        if self._wakeups is not None:
            self._wakeups.close()
        self._drop_all()


class RedisPyLink:
    """One Redis Cluster node over a redis-py connection pool (hotlock.backends.cluster.Link).

    Why per-node pools routed by hotlock.backends.cluster rather than redis.cluster.RedisCluster:
    the redirection and lost-reply rules are then written once for every backend, and
    RedisCluster's own ones (it resends a command after a connection error, so a lost
    acquire reply comes back to us as a second, unannounced try; its map refresh and
    retries run on their own clock) cannot break the one-retry, one-budget rule. Its
    pipelines also run node by node, where a batch here writes to every node first.
    """

    def __init__(self, config: ServerConfig) -> None:
        self.server = config.display
        self._config = config
        self._reauth = config.reauth_interval
        kind = TLSConnection if config.tls else redis.Connection
        self._pool: Any = redis.ConnectionPool(
            connection_class=kind, host=config.host, port=config.port, **_connection_kwargs(config)
        )
        # As RedisPyBackend's: link_close() leaves the connections in use to their callers.
        self._generations = itertools.count()
        self._generation = next(self._generations)
        # Connect now and load the scripts: a primary's first EVALSHA seldom pays a NOSCRIPT.
        for reply in self.link_recv(
            self.link_send([(b"SCRIPT", b"LOAD", s.source) for s in SCRIPTS]), len(SCRIPTS), None
        ):
            if isinstance(reply, ReplyError):
                raise cache_error(f"connect failed: SCRIPT LOAD: the server replied {reply}", self.server)

    def link_send(self, commands: list[tuple[bytes, ...]]) -> Any:
        generation = self._generation
        try:
            conn: Any = self._pool.get_connection()
        except (RedisError, OSError) as exc:  # could not connect: nothing was sent
            raise cache_error(f"connect failed: {describe(exc)}", self.server) from exc
        try:
            if reauth_due(conn, self._reauth):
                reauthenticate(conn, self._config)
            conn.send_packed_command(conn.pack_commands(commands))
        except AuthenticationError as exc:
            # A refused AUTH again (reauth_interval): nothing of the commands was sent;
            # Route asks for a new connection, which asks the provider again.
            conn.disconnect()
            self._pool.release(conn)
            return _Refused(refusal_text(exc), len(commands)), generation
        except AMBIGUOUS as exc:
            conn.disconnect()
            self._pool.release(conn)
            raise LinkLost(describe(exc)) from exc
        except RedisError as exc:  # AUTH refused, say: nothing ran
            conn.disconnect()
            self._pool.release(conn)
            raise cache_error(f"connect failed: {describe(exc)}", self.server) from exc
        return conn, generation

    def link_recv(self, handle: Any, n: int, timeout: float | None) -> list[Any]:
        conn, generation = handle
        if isinstance(conn, _Refused):
            return conn.replies()
        complete = False
        try:
            deadline = None if timeout is None else time.monotonic() + timeout
            replies: list[Any] = []
            for _ in range(n):
                kw = {} if deadline is None else {"timeout": max(deadline - time.monotonic(), 0.001)}
                try:
                    replies.append(conn.read_response(**kw))
                except (ResponseError, BusyLoadingError) as exc:  # LOADING is a ConnectionError to redis-py
                    replies.append(reply_error(exc))
                except AuthenticationError as exc:
                    # NOAUTH: redis-py raises it mid-read and closes the connection. Every
                    # command behind it was refused too (the connection was not
                    # authenticated for any), so each gets it as its reply, for Route.
                    return replies + _Refused(refusal_text(exc), n - len(replies)).replies()
            if stray(conn):
                raise StrayReply()
            complete = True
            return replies
        except AMBIGUOUS as exc:
            raise LinkLost(describe(exc)) from exc
        finally:
            if not complete or generation != self._generation:
                conn.disconnect()
            self._pool.release(conn)

    def link_close(self) -> None:
        self._generation = next(self._generations)
        self._pool.disconnect(inuse_connections=False)

    def link_drop(self) -> None:
        """Route's answer to NOAUTH/WRONGPASS: the idle connections go (the one refused is
        already closed), so the next ones connect and ask the credential provider again."""
        self._pool.disconnect(inuse_connections=False)


class _Refused:
    """An authentication refusal standing for ``n`` replies (RedisPyLink)."""

    def __init__(self, text: str, n: int) -> None:
        self._text = text
        self._n = n

    def replies(self) -> list[Any]:
        return [ReplyError(self._text)] * self._n


def refusal_text(exc: AuthenticationError) -> str:
    """An authentication refusal as the server's error reply, its code put back (redis-py
    strips it): what Route reads (NOAUTH, WRONGPASS). Shared with aio/_redispy."""
    code = getattr(exc, "status_code", None) or "WRONGPASS"
    return f"{code} {exc}"


ERROR_CODES = {cls: code for code, cls in BaseParser.EXCEPTION_CLASSES.items() if isinstance(cls, type)}


def reply_error(exc: ResponseError | BusyLoadingError) -> ReplyError:
    """A redis-py error reply as the server sent it, its code put back (redis-py keeps some
    codes in the exception's type): what Route reads. Shared with redispy_async."""
    code = ERROR_CODES.get(type(exc))
    return ReplyError(f"{code} {exc}" if code else str(exc))


def describe(exc: BaseException) -> str:
    if isinstance(exc, RedisTimeoutError):
        return "no reply within the timeout"
    if isinstance(exc, REFUSALS):
        # Error replies redis-py raises as ConnectionError, code stripped: say what they refused.
        code = getattr(exc, "status_code", None) or ERROR_CODES.get(type(exc))
        replied = f"the server replied {code} {exc}" if code else f"the server replied {exc}"
        return f"authentication failed: {replied}" if isinstance(exc, AuthenticationError) else replied
    if isinstance(exc, ResponseError):
        # redis-py strips the error code ("OOM", "NOPERM", "READONLY"...) off the text it
        # maps to a class; put it back, so the message reads as the server's reply did.
        code = ERROR_CODES.get(type(exc))
        return f"the server replied {code} {exc}" if code else f"the server replied {exc}"
    return str(exc) or type(exc).__name__
