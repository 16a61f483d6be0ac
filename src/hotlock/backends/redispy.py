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
from collections.abc import Callable, Sequence
from typing import Any, NoReturn, TypeVar

import redis
from redis._parsers import BaseParser
from redis.backoff import NoBackoff
from redis.credentials import CredentialProvider
from redis.exceptions import (
    AuthenticationError,
    BusyLoadingError,
    NoPermissionError,
    NoScriptError,
    OutOfMemoryError,
    RedisError,
    ResponseError,
)
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError
from redis.retry import Retry

from .. import _acquire
from .._config import KEEPALIVE_OPTIONS, LIB_NAME, ServerConfig, lib_version, redispy_tls_kwargs
from .._credentials import ask, ask_async, reauth_command
from .._dialect import (
    COMMAND_PROBE,
    Detected,
    Dialect,
    by_script,
    extend_command,
    info_fields,
    release_command,
    script_serves,
)
from .._ident import TOKEN_BYTES
from .._scripts import (
    ACQUIRE,
    ACQUIRE_CHAIN,
    ACQUIRE_POLL,
    ACQUIRE_WAIT,
    CONFIRMED,
    EXTEND,
    RELEASE,
    RELEASE_SHARDED,
    SCRIPTS,
    Script,
    held_value,
    resent,
)
from .._sentinel import PrimaryWatch
from .._transient import Retrying, code, resend_until, tried
from ..errors import CacheError, LinkLost, ReplyError, cache_error, unconfirmed_extends, unreplicated
from .wakeup import slot, wait

__all__ = ["RedisPyBackend", "RedisPyLink"]

T = TypeVar("T")

log = logging.getLogger("hotlock")

# The errors after which a request may or may not have reached the server. Shared with redispy_async.
AMBIGUOUS = (RedisConnectionError, RedisTimeoutError, OSError)

# -- reply shapes -------------------------------------------------------------------------
# What each command may answer (error replies aside), checked as each reply is read, on the
# connection it came on: anything else is a server, proxy or endpoint that does not speak
# as Redis does, and the connection is dropped, never read again (UnexpectedReply).
Shape = Callable[[object], bool]


def is_int(reply: object) -> bool:
    return type(reply) is int  # not a RESP3 boolean (a bool), nor a double


def is_flag(reply: object) -> bool:
    """0 or 1: the extend and release scripts, DELIFEQ, DELEX."""
    return type(reply) is int and 0 <= reply <= 1


def is_count(reply: object) -> bool:
    """WAIT's count of replicas."""
    return type(reply) is int and reply >= 0


def is_ok_or_nil(reply: object) -> bool:
    """SET ... NX and SET ... IFEQ: done, or not."""
    return reply is None or reply == b"OK"


def is_text(reply: object) -> bool:
    return type(reply) is bytes


def is_anything(reply: object) -> bool:
    """A reply whose reader takes any shape (COMMAND INFO: _dialect.commands_from)."""
    return True


# What each script returns: an acquire a fence or -(TTL left) (an integer), the others 0 or 1.
SCRIPT_REPLY: dict[Script, Shape] = {
    ACQUIRE: is_int,
    ACQUIRE_WAIT: is_int,
    ACQUIRE_CHAIN: is_int,
    ACQUIRE_POLL: is_int,
    EXTEND: is_flag,
    RELEASE: is_flag,
    RELEASE_SHARDED: is_flag,
}
# Every script loaded in one round trip; each load answers its script's SHA1.
SCRIPT_LOADS: list[tuple[bytes, ...]] = [(b"SCRIPT", b"LOAD", s.source) for s in SCRIPTS]


def _sha_of(script: Script) -> Shape:
    return lambda reply: reply == script.sha


SCRIPT_LOADED: list[Shape] = [_sha_of(s) for s in SCRIPTS]


# A pipeline's replies end with TIME's (two bulk strings, unlike any reply a lock command
# gives): a server that sent one reply too many in the middle of a pipeline shifts the
# rest by one, and the reply found in TIME's place shows it, where a check of what is left
# to read can miss a reply the server has yet to send. TIME, since the scripts need its
# ACL permission anyway. A single command needs no frame: an extra reply behind its own is
# found in the parser's buffer, or by the pool's poll before the connection is used again.
# Nor do transactions (Transaction.framed): each EXEC's reply, a pair holding TIME's, is of
# a shape no other reply of theirs has, so a shift before it shows in its place.
FRAME = (b"TIME",)


def is_frame(reply: object) -> bool:
    return type(reply) is list and len(reply) == 2 and type(reply[0]) is bytes and type(reply[1]) is bytes


# -- the transaction acquire (hotlock._acquire) --------------------------------------------
# Its four replies, as each is checked on arrival. With MULTI refused (an ACL, a proxy), SET
# and TIME run on their own and EXEC is refused: SET then answers OK or nil, TIME the clock.


def is_ok(reply: object) -> bool:
    return reply == b"OK"


def is_queued_set(reply: object) -> bool:
    return reply == b"QUEUED" or is_ok_or_nil(reply)


def is_queued_time(reply: object) -> bool:
    return reply == b"QUEUED" or is_frame(reply)


def is_exec(reply: object) -> bool:
    """EXEC's: SET's reply (OK, or nil: the key exists) and TIME's."""
    return type(reply) is list and len(reply) == 2 and is_ok_or_nil(reply[0]) and is_frame(reply[1])


TRANSACTION_REPLY: list[Shape] = [is_ok, is_queued_set, is_queued_time, is_exec]
# connect(fences=False): SET NX PX alone.
SET_REPLY: list[Shape] = [is_ok_or_nil]


def by_transaction(dialect: Dialect, script: Script, tokens: Sequence[bytes]) -> bool:
    """Whether an acquire with ``script`` of these tokens goes as the transaction: only the
    ACQUIRE script itself (the waiting forms are the contended path), and only plain
    locks (a permit's ask, token '#' limit, always goes by script). Shared with redispy_async."""
    return script is ACQUIRE and dialect.transaction and all(len(t) == TOKEN_BYTES for t in tokens)


class Transaction:
    """The acquires of some keys by hotlock._acquire's transaction, without I/O: what to
    send and what the replies say, for the sync and async backends alike, each of which
    sends and receives.

    The backend writes ``commands`` at once (every key's transaction, then ``wait``: the
    WAIT of wait_replicas, which confirms the SETs before it on its connection) and hands
    the replies (error replies in place) to ``read``, which names the keys the ACQUIRE
    script is to decide. Those go next as ACQUIRE (with their own WAIT), and ``scripted``
    takes their results. ``outcome`` is then what one acquire by script gives: each key's
    result, and the WAIT reply ([] without wait_replicas). Under connect(fences=False)
    each key's transaction is SET NX PX alone (one reply)."""

    __slots__ = ("_n", "_per", "_waits", "commands", "framed", "refused", "results", "shapes")

    def __init__(
        self, keys: Sequence[bytes], tokens: Sequence[bytes], ttl_ms: int, wait: list[tuple[Any, ...]], fenced: bool
    ) -> None:
        self._n = len(keys)
        self._per = 4 if fenced else 1  # replies per key
        self.commands: list[tuple[Any, ...]] = [
            command for k, t in zip(keys, tokens, strict=True) for command in _acquire.commands(k, t, ttl_ms, fenced)
        ]
        self.commands += wait
        self.shapes = (TRANSACTION_REPLY if fenced else SET_REPLY) * self._n + [is_count] * len(wait)
        # Whether the write needs FRAME behind it: not when EXEC's reply frames it.
        self.framed = not fenced
        self.results: list[int] = []
        # MULTI's error reply when it was refused alone: this server takes no transaction
        # from us, and the backend sends every later acquire by script.
        self.refused: RedisError | None = None
        self._waits: list[int] = []

    def read(self, replies: list[Any]) -> list[int]:
        """The transactions' replies: the indices of the keys that go by script next. The
        first error reply is raised, to be treated as a script's (transient, NOAUTH...)."""
        per = self._per
        fours = [replies[per * i : per * i + per] for i in range(self._n)]
        # Noted before any error is raised: the backend's next acquire goes by script.
        self.refused = next((four[0] for four in fours if _acquire.refused_multi(four, RedisError)), None)
        rest: list[int] = []
        for i, four in enumerate(fours):
            result = _acquire.read(four, RedisError)
            if isinstance(result, BaseException):
                raise result
            self.results.append(result)
            if result == _acquire.SCRIPT:
                rest.append(i)
        waits = replies[per * self._n :]
        for reply in waits:
            if isinstance(reply, Exception):
                raise reply
        if len(rest) < self._n:
            # A key was taken: this WAIT confirms it. One that took nothing confirms
            # nothing of ours (the script's own WAIT covers the keys it decides, and a
            # SET run outside a refused MULTI too: the script writes after it).
            self._waits += waits
        return rest

    def scripted(self, rest: list[int], results: list[int], waits: list[int]) -> None:
        """The ACQUIRE script's results for the keys ``read`` named, and its WAIT reply."""
        for i, result in zip(rest, results, strict=True):
            self.results[i] = result
        self._waits += waits

    def outcome(self) -> tuple[list[int], list[int]]:
        """Each key's result, and the fewest replicas a WAIT confirmed ([] without WAIT)."""
        return self.results, [min(self._waits)] if self._waits else []


def refused_warning(server: str, refusal: BaseException) -> None:
    """Said once per backend, when MULTI is first refused. Shared with redispy_async."""
    _acquire.warn_refused(server, describe(refusal))


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


class RedisPyBackend(Detected):
    name = "redis-py"

    def __init__(self, config: ServerConfig) -> None:
        self.server = config.display
        self._config = config
        self._timeout = config.timeout
        self._wait_replicas = config.wait_replicas
        self._wait_ms = round(config.wait_timeout * 1000)
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
        # False once this server refused MULTI: every acquire goes by script (Transaction).
        self._transactions = True
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

        Error replies come back in place as exceptions (NoScriptError included). With
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
                    reply = conn.read_response(**kw)
                except (ResponseError, BusyLoadingError) as exc:  # LOADING is a ConnectionError to redis-py
                    replies.append(exc)
                    word = transient_code(exc)
                    if word is not None:
                        # The command did not run; its resend goes on a fresh connection.
                        fresh = True
                        if word == "READONLY":
                            # The endpoint reaches a replica now: no connection of this
                            # cache to it takes another command, the other threads' included.
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

    def _scripts(self, script: Script, calls: Sequence[tuple[bytes, ...]], timeout: float | None = None) -> list[Any]:
        """EVALSHA ``script`` once per (key, *args) in ``calls``, in one round trip."""
        commands: list[tuple[Any, ...]] = [("EVALSHA", script.sha, 1, *call) for call in calls]
        commands += self._wait_command(script)
        shapes = [SCRIPT_REPLY[script]] * len(calls) + [is_count] * (len(commands) - len(calls))
        replies = self._send(commands, shapes, timeout)
        missing = [i for i, r in enumerate(replies) if isinstance(r, NoScriptError)]
        if missing:
            # Restart, SCRIPT FLUSH or failover emptied the script cache: load all, then
            # send again only what did not run (a release that ran must not run twice).
            self._load_scripts()
            again = self._send(
                [commands[i] for i in missing] + commands[len(calls) :],
                [shapes[i] for i in missing] + shapes[len(calls) :],
                timeout,
            )
            resent(replies, missing, again, len(calls))
        for reply in replies:
            if isinstance(reply, Exception):
                raise reply
        return replies

    def _commands(self, commands: list[tuple[bytes, ...]], shape: Shape, timeout: float | None = None) -> list[Any]:
        """Plain commands of one reply ``shape`` in one round trip; error replies raised."""
        replies = self._send(commands, [shape] * len(commands), timeout)
        for reply in replies:
            if isinstance(reply, Exception):
                raise reply
        return replies

    def _call(
        self,
        what: str,
        key: bytes | None,
        fn: Callable[[float | None], T],
        resend: bool = False,
        retry_until: float | None = None,
    ) -> T:
        """Run ``fn`` (given a reply-timeout override) and turn every failure into CacheError.

        The lost-reply rule (docs/architecture.md), as in the native client: one more try, sharing
        whatever time is left until ``retry_until`` (a time.monotonic(); by default the
        budget of a call that does not wait), after a lost handshake reply (nothing of the
        call was sent: any call), or after a lost reply to the call itself when ``resend``
        (same token: the scripts count "already my token" as success, and a release that
        ran finds nothing to do; never INCRBY or SET NX: a resent INCRBY counts twice, a
        resent SET NX answers "not set" for the value this call set). A transient reply
        (hotlock._transient: the command did not run) is resent, whatever the command,
        until the pauses would pass the call's own timeout (``retry_until`` less one reply
        timeout).
        """
        limit: float | None = None  # the reply timeout of a retry: what is left of the budget
        lost = False  # the one retry after a lost reply has been used
        transient = Retrying()
        until = retry_until
        reset: contextvars.Token[float | None] | None = None
        try:
            while True:
                try:
                    return fn(limit)
                except (RedisError, OSError) as exc:
                    failure = exc
                if transient_code(failure) is not None:
                    # The command did not run: resent on a fresh connection (_send dropped it;
                    # READONLY dropped them all) after a pause, while the call's own timeout lasts.
                    until = self._retry_until() if until is None else until
                    pause = transient.pause(until - self._timeout - time.monotonic())
                    if pause is None:
                        raise self._error(tried(what, lost, transient), key, failure) from failure
                    time.sleep(pause)
                    limit = min(self._timeout, until - time.monotonic())
                elif isinstance(failure, AMBIGUOUS):
                    until = self._retry_until() if until is None else until
                    left = min(self._timeout, until - time.monotonic())
                    # NOAUTH or WRONGPASS on a live connection (AuthLost, the connection closed):
                    # nothing ran, and the new connection asks the credential provider again.
                    safe = resend or isinstance(failure, HandshakeLost | AuthLost)
                    if lost or left < 0.001 or not safe or refused(failure):
                        raise self._error(tried(what, lost, transient), key, failure) from failure
                    lost = True
                    limit = left
                    # The new connection's handshake reads under what is left, too (_handshake).
                    reset = _RETRY_UNTIL.set(time.monotonic() + left)
                else:
                    raise self._error(tried(what, lost, transient), key, failure) from failure
        finally:
            if reset is not None:
                _RETRY_UNTIL.reset(reset)

    def _retry_until(self, wait_ms: int = 0) -> float:
        """Until when a call begun now may be resent (hotlock._transient.resend_until)."""
        return resend_until(time.monotonic(), wait_ms / 1000.0, self._timeout)

    def _wait_command(self, script: Script) -> list[tuple[Any, ...]]:
        # WAIT confirms the writes made earlier *on its own connection*, so it rides in the
        # same write as the acquires or extends it confirms: no extra round trip, no other
        # connection.
        if self._wait_replicas and script in CONFIRMED:
            return [("WAIT", self._wait_replicas, self._wait_ms)]
        return []

    def _renewed(
        self, what: str, keys: list[bytes], tokens: list[bytes], results: list[bool], wait_reply: list[Any]
    ) -> list[bool]:
        """Under wait_replicas: the extends' results, or Unreplicated when too few replicas
        confirmed the ones that ran, released first (as _confirmed undoes acquires)."""
        if not wait_reply or wait_reply[0] >= self._wait_replicas or not any(results):
            return results
        held = [(k, t) for k, t, ok in zip(keys, tokens, results, strict=True) if ok]
        # If the release fails too, the keys expire by their TTL; the leases are lost either way.
        with contextlib.suppress(CacheError):
            self.release_many([k for k, _ in held], [t for _, t in held])
        raise unconfirmed_extends(what, results, wait_reply[0], self._wait_replicas, self._wait_ms)

    def _confirmed(
        self, what: str, keys: list[bytes], tokens: list[bytes], results: list[int], wait_reply: list[Any]
    ) -> list[int]:
        """Under wait_replicas: undo what was acquired unless enough replicas confirmed it."""
        if not wait_reply or wait_reply[0] >= self._wait_replicas:
            return results
        held = [(k, held_value(t, r)) for k, t, r in zip(keys, tokens, results, strict=True) if r > 0]
        if held:
            # If the undo fails too, the keys expire by their TTL; the caller hears about the replicas.
            with contextlib.suppress(CacheError):
                self.release_many([k for k, _ in held], [t for _, t in held])
        raise cache_error(
            unreplicated(what, wait_reply[0], self._wait_replicas, self._wait_ms),
            self.server,
            keys[0] if len(keys) == 1 else None,
        )

    def _error(self, what: str, key: bytes | None, exc: BaseException) -> Exception:
        return cache_error(f"{what} failed: {describe(exc)}{tls_hint(self._config, exc)}", self.server, key)

    def _load_scripts(self) -> None:
        # Loading twice changes nothing: a lost reply is resent.
        self._call("SCRIPT LOAD", None, lambda t: _raised(self._send(SCRIPT_LOADS, SCRIPT_LOADED, t)), True)

    # -- the Backend interface --------------------------------------------------------

    def acquire(self, key: bytes, token: bytes, ttl_ms: int) -> int:
        return self._acquire(key, token, ttl_ms, self._retry_until())

    def _acquire(self, key: bytes, token: bytes, ttl_ms: int, retry_until: float, script: Script = ACQUIRE) -> int:
        results, waited = self._call(
            "acquire", key, lambda t: self._take(script, [key], [token], ttl_ms, t), True, retry_until
        )
        return self._confirmed("acquire", [key], [token], results, waited)[0]

    def _take(
        self, script: Script, keys: list[bytes], tokens: list[bytes], ttl_ms: int, timeout: float | None
    ) -> tuple[list[int], list[int]]:
        """One try of the acquires (a lost reply resends it whole, with the same tokens):
        each key's result, and WAIT's reply under wait_replicas. By transaction where it
        serves (by_transaction), the keys it leaves to the script in a second round trip,
        within the same ``timeout``."""
        if not (self._transactions and by_transaction(self.dialect, script, tokens)):
            return self._by_script(script, keys, tokens, ttl_ms, timeout)
        deadline = None if timeout is None else time.monotonic() + timeout
        taking = Transaction(keys, tokens, ttl_ms, self._wait_command(ACQUIRE), self.fenced)
        try:
            rest = taking.read(self._send(taking.commands, taking.shapes, timeout, taking.framed))
        finally:
            if taking.refused is not None and self._transactions:
                self._transactions = False
                refused_warning(self.server, taking.refused)
        if rest:
            left = None if deadline is None else max(deadline - time.monotonic(), 0.001)
            keys, tokens = [keys[i] for i in rest], [tokens[i] for i in rest]
            taking.scripted(rest, *self._by_script(ACQUIRE, keys, tokens, ttl_ms, left))
        return taking.outcome()

    def _by_script(
        self, script: Script, keys: list[bytes], tokens: list[bytes], ttl_ms: int, timeout: float | None
    ) -> tuple[list[int], list[int]]:
        """The acquires as ``script``, in one round trip: each key's result, and WAIT's reply."""
        ms = b"%d" % ttl_ms
        replies = self._scripts(script, [(k, t, ms) for k, t in zip(keys, tokens, strict=True)], timeout)
        return replies[: len(keys)], replies[len(keys) :]

    def acquire_wait(self, key: bytes, token: bytes, ttl_ms: int, wait_ms: int) -> tuple[int, float, int]:
        retry_until = self._retry_until(wait_ms)
        return wait(self._wakeups, key, lambda s: self._acquire(key, token, ttl_ms, retry_until, s), wait_ms)

    def acquire_many(self, keys: list[bytes], tokens: list[bytes], ttl_ms: int) -> list[int]:
        # The caller's lists as they are now: another thread may change them during the round trip.
        keys, tokens = list(keys), list(tokens)
        results, waited = self._call("acquire_many", None, lambda t: self._take(ACQUIRE, keys, tokens, ttl_ms, t), True)
        return self._confirmed("acquire_many", keys, tokens, results, waited)

    def extend(self, key: bytes, token: bytes, ttl_ms: int) -> bool:
        # Not resent: a lost extend reply is a CacheError; the caller retries while valid_for() lasts.
        return self.extend_many([key], [token], ttl_ms, "extend", key)[0]

    def extend_many(
        self,
        keys: list[bytes],
        tokens: list[bytes],
        ttl_ms: int,
        what: str = "extend_many",
        key: bytes | None = None,
        scripted: bool = False,
    ) -> list[bool]:
        keys, tokens = list(keys), list(tokens)  # as in acquire_many
        # Under wait_replicas by script: it takes a waiter's mark and permits as they are, so
        # one write carries every extend and the one WAIT behind them.
        if self.dialect.lua_free and not scripted and not by_script(tokens) and not self._wait_replicas:
            # SET IFEQ replies OK when the key held this value (now with the new TTL), nil otherwise.
            sets = [extend_command(k, t, ttl_ms) for k, t in zip(keys, tokens, strict=True)]
            try:
                done = [r is not None for r in self._call(what, key, lambda t: self._commands(sets, is_ok_or_nil, t))]
            except CacheError as exc:
                if not reply_serves_script(exc):
                    raise
                # Refused at maxmemory, or a key now holds permits: the script serves (see _dialect).
            else:
                # SET IFEQ compares the whole value: one a waiter marked ('+') is extended
                # by the script, which accepts the mark (only under contention, or when lost).
                return self._missed(done, keys, tokens, lambda k, t: self.extend_many(k, t, ttl_ms, what, key, True))
        calls = [(k, t, b"%d" % ttl_ms) for k, t in zip(keys, tokens, strict=True)]
        replies = self._call(what, key, lambda t: self._scripts(EXTEND, calls, t))
        return self._renewed(what, keys, tokens, [bool(r) for r in replies[: len(calls)]], replies[len(calls) :])

    @staticmethod
    def _missed(
        done: list[bool],
        keys: list[bytes],
        tokens: list[bytes],
        again: Callable[[list[bytes], list[bytes]], list[bool]],
    ) -> list[bool]:
        """After a Lua-free batch: what it missed once more by script (``again``)."""
        missed = [i for i, ok in enumerate(done) if not ok]
        if missed:
            for i, ok in zip(missed, again([keys[i] for i in missed], [tokens[i] for i in missed]), strict=True):
                done[i] = ok
        return done

    def release(self, key: bytes, token: bytes) -> bool:
        # A lost release reply is retried: the second try finds the key gone (False) or
        # still ours (releases it), and either way the caller sees no error.
        return self.release_many([key], [token], "release", key)[0]

    def release_many(
        self,
        keys: list[bytes],
        tokens: list[bytes],
        what: str = "release_many",
        key: bytes | None = None,
        scripted: bool = False,
    ) -> list[bool]:
        keys, tokens = list(keys), list(tokens)  # as in acquire_many
        if self.dialect.lua_free and not scripted and not by_script(tokens):
            dels = [release_command(self.dialect, k, t) for k, t in zip(keys, tokens, strict=True)]
            try:
                done = [bool(r) for r in self._call(what, key, lambda t: self._commands(dels, is_flag, t), True)]
            except CacheError as exc:
                if not reply_serves_script(exc):
                    raise
                done = [False] * len(keys)  # a key now holds permits: all once more by script
            # DELIFEQ/DELEX compare the whole value: one a waiter marked ('+') is released
            # by the script, which accepts the mark and wakes the waiter (only under
            # contention, or when the lock was lost anyway).
            return self._missed(done, keys, tokens, lambda k, t: self.release_many(k, t, what, key, True))
        calls = [(k, t) for k, t in zip(keys, tokens, strict=True)]
        return [bool(r) for r in self._call(what, key, lambda t: self._scripts(RELEASE, calls, t), True)]

    def set_nx(self, key: bytes, value: bytes, ttl_ms: int) -> bool:
        command = (b"SET", key, value, b"NX", b"PX", b"%d" % ttl_ms)
        return self._call("set_nx", key, lambda t: self._commands([command], is_ok_or_nil, t))[0] is not None

    def incr(self, key: bytes, amount: int) -> int:
        command = (b"INCRBY", key, b"%d" % amount)
        reply: int = self._call("incr", key, lambda t: self._commands([command], is_int, t))[0]
        return reply

    def info(self) -> dict[str, str] | None:
        reply = self._call("INFO", None, lambda t: self._send([(b"INFO",)], [is_text], t))[0]
        if isinstance(reply, NoPermissionError):
            return None
        if isinstance(reply, Exception):
            raise cache_error(f"INFO failed: {describe(reply)}", self.server) from reply
        return info_fields(reply)

    def command_info(self) -> list[Any] | None:
        """COMMAND INFO DELIFEQ DELEX's raw reply, or None when the server or its ACL refuses it."""
        try:
            reply = self._call("COMMAND INFO", None, lambda t: self._commands([COMMAND_PROBE], is_anything, t))[0]
        except CacheError as exc:
            return probe_refused(exc)
        return reply if isinstance(reply, list) else None

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


def probe_refused(exc: CacheError) -> list[Any] | None:
    """COMMAND INFO's failure (_dialect.COMMAND_PROBE) raised, unless the server or its ACL
    refused it (NOPERM, or a proxy without COMMAND): then the version decides, and the probe
    gives None. Shared with redispy_async."""
    if isinstance(exc.__cause__, ResponseError):
        return None
    raise exc


def reply_error(exc: ResponseError | BusyLoadingError) -> ReplyError:
    """A redis-py error reply as the server sent it, its code put back (redis-py keeps some
    codes in the exception's type): what Route reads. Shared with redispy_async."""
    code = ERROR_CODES.get(type(exc))
    return ReplyError(f"{code} {exc}" if code else str(exc))


def reply_serves_script(exc: CacheError) -> bool:
    """_dialect.script_serves for a Lua-free command's CacheError (redis-py drops the OOM
    code from the message, and keeps it in the exception's type)."""
    return isinstance(exc.__cause__, OutOfMemoryError) or script_serves(str(exc.__cause__))


def _raised(replies: list[Any]) -> list[Any]:
    """``replies``, or the first error reply among them raised (to _call, which decides)."""
    for reply in replies:
        if isinstance(reply, Exception):
            raise reply
    return replies


def transient_code(exc: BaseException) -> str | None:
    """hotlock._transient.code of a redis-py error reply (redis-py keeps the code of some
    replies in the exception's type, and the rest in its text). Shared with redispy_async."""
    if not isinstance(exc, ResponseError | BusyLoadingError):
        return None
    return code(ERROR_CODES.get(type(exc)) or str(exc))


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
