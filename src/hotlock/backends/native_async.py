"""The native async backend: the Cython asyncio protocol of ext/_aio.pxi, carrying out
hotlock._exchange's steps.

The protocol moves bytes: it formats commands, pipelines every task's commands on one
connection and answers futures in order. What each call sends and what its replies make
of it (the lost-reply resend, transient pauses, NOSCRIPT, the transaction acquire and its
script fallback, the Lua-free extend and release, WAIT) is hotlock._exchange's, as for the
redis-py backends; this module owns the connection: connecting (AUTH, SELECT, script
loads in one round trip), reconnecting after a broken one, following the Sentinel
primary, AUTH again when due, retiring it after a transient, NOAUTH or READONLY reply,
checking each reply's shape, and turning what a write lost into the Failure the steps
take. A transaction's replies are read in C (AioCore.acquire_many) and handed back decided,
and the common acquire, extend and release of one key are one C call with no steps when
the reply settles them (hotlock._exchange: a transport's shortcut).
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any, Protocol, TypeVar

from .._config import ServerConfig, command_name, keepalive, naming_commands, naming_optional, tls_context
from .._credentials import auth_command_async, reauth_command_async
from .._exchange import (
    Decided,
    Exchange,
    Failure,
    Lost,
    NotSent,
    Send,
    Shape,
    Steps,
    Transaction,
    drive_async,
    is_flag,
    is_int,
    retires,
)
from .._inflight import within
from .._scripts import SCRIPTS, Script
from .._sentinel import PrimaryWatch
from .._transient import TRANSIENT
from ..errors import LinkLost, ReplyError, cache_error
from .wakeup_async import async_slot

__all__ = ["NativeAsyncBackend"]

T = TypeVar("T")


class TransientHandshake(NotSent):
    """A new connection's handshake (a SCRIPT LOAD on a loading server, say) got a
    transient reply (hotlock._transient): nothing of the call ran, and the steps take
    ``reply`` as their commands' (a pause, then a resend on a new connection)."""

    def __init__(self, reply: ReplyError) -> None:
        super().__init__(f"the server replied {reply}")
        self.reply = reply


class AioConnection(Protocol):
    """What this module uses of ext/_aio.pxi's AioProtocol."""

    def usable(self) -> bool: ...
    def execute(self, *args: bytes | int) -> asyncio.Future[Any]: ...
    def pipeline(
        self, commands: list[tuple[bytes, ...]] | list[tuple[bytes | int, ...]]
    ) -> asyncio.Future[list[Any]]: ...
    # Transactions (hotlock._acquire; SET NX PX alone when not fenced) read in C: each
    # key's answer, the fence (1 without one), 0 (the script is to decide), -1 (that too,
    # MULTI refused alone: multi_refusal), or the error reply; then the trailer's reply.
    # acquire: one key's answer alone.
    def acquire(self, key: bytes, token: bytes, ms: int, fenced: bool = True) -> asyncio.Future[int | ReplyError]: ...
    def acquire_many(
        self,
        keys: list[bytes],
        tokens: list[bytes],
        ms: int,
        trailer: tuple[bytes | int, ...] | None = None,
        fenced: bool = True,
    ) -> asyncio.Future[list[Any]]: ...
    @property
    def multi_refusal(self) -> str | None: ...
    def close(self) -> None: ...
    def retire(self) -> None: ...
    def abort(self) -> None: ...
    def lost(self) -> asyncio.Future[None]: ...


# What a write may lose: its replies (the connection dropped, no reply in time), or the
# write itself (NotSent: the protocol closed before it went out).
_LOST = (ConnectionError, TimeoutError, NotSent)


class NativeAsyncBackend(Exchange):
    name = "native"

    # Ordering promise: every command of this backend goes through one connection in FIFO
    # order, and a call's first write is queued before its first await, so a release
    # queued after an (even cancelled) acquire runs after it.

    def __init__(self, config: ServerConfig, protocol_class: Callable[..., AioConnection]) -> None:
        super().__init__(config)
        self._config = config
        # The wake-up subscriber (hotlock.backends.wakeup_async), made on the first long lock_wait.
        self.wake_slot = async_slot(config)
        self._protocol_class = protocol_class
        self._proto: AioConnection | None = None
        # Under Sentinel: where the primary is, and the watch epoch the live connection is of.
        self._watch = PrimaryWatch(config.primary) if config.sentinels else None
        self._epoch = 0
        # One connect in flight at a time, shared by every task that needs the connection.
        self._connecting: asyncio.Task[AioConnection] | None = None
        # reauth_interval (0: never): AUTH is sent again on the live connection once this
        # long has passed (loop time) since the last (_reauth_if_due).
        self._reauth = config.reauth_interval
        self._authed_at = 0.0
        # Whether a call may go straight on the live connection (the shortcuts of acquire
        # and release): nothing is to be checked or sent before it.
        self._direct = self._watch is None and not self._reauth

    @classmethod
    async def open(cls, config: ServerConfig, protocol_class: Callable[..., AioConnection]) -> NativeAsyncBackend:
        backend = cls(config, protocol_class)
        backend.clock = asyncio.get_running_loop().time  # the clock of the budgets handed in
        # The first connection is a round trip like any other: its lost handshake reply is resent.
        await backend._run(backend.connect_steps())
        return backend

    # -- connections ------------------------------------------------------------------

    async def _open(self) -> AioConnection:
        config = self._config
        loop = asyncio.get_running_loop()

        def factory() -> AioConnection:
            return self._protocol_class(loop, config.timeout, ReplyError, NotSent)

        opening: Awaitable[tuple[asyncio.BaseTransport, Any]]
        if config.unix_path is not None:
            opening = loop.create_unix_connection(factory, config.unix_path)
        else:
            host, port = config.host, config.port
            if config.sentinels:
                # Whatever the sentinels name as the primary now, so a reconnect follows a
                # failover. Asking is a short blocking exchange (bounded by the connect
                # timeout): it runs in the default executor, off the loop.
                assert self._watch is not None
                host, port = await loop.run_in_executor(None, self._watch.address)
                self._epoch = self._watch.epoch
            # The loop's transport does TLS, so rediss:// needs nothing from hiredis.
            # A context per connection: rotated certificate files are read by the next one.
            tls = tls_context(config.ssl) if config.tls else None
            # The name checked and sent as SNI: ssl_server_name, else the host connected to.
            name = (config.ssl.server_name or host) if tls else None
            opening = loop.create_connection(factory, host, port, ssl=tls, server_hostname=name)
        try:
            transport, proto = await within(opening, config.connect_timeout)
        except (OSError, TimeoutError) as exc:
            why = "no answer within the connect timeout" if isinstance(exc, TimeoutError) else str(exc)
            raise cache_error(f"connect failed: {why}", self.server) from exc
        if config.unix_path is None:
            keepalive(transport.get_extra_info("socket"))
        # AUTH, the connection's name and SELECT go first, pipelined with the script loads:
        # one round trip, and the scripts are there before the first EVALSHA. The
        # credentials are the provider's answer now, when there is one (a username alone is
        # sent too).
        setup: list[tuple[bytes | int, ...]] = []
        try:
            auth = await auth_command_async(config)
        except BaseException:
            proto.abort()
            raise
        if auth is not None:
            setup.append(auth)
        setup += naming_commands(config)
        if config.db:
            setup.append((b"SELECT", config.db))
        setup += [(b"SCRIPT", b"LOAD", script.source) for script in SCRIPTS]
        try:
            replies = await proto.pipeline(setup)
        except BaseException as exc:
            proto.abort()
            if isinstance(exc, _LOST):
                # Nothing of any call went out on this connection: each call waiting for
                # it may connect again (hotlock._exchange: NotSent).
                raise NotSent(f"handshake: {_describe(exc)}") from exc
            raise
        # Each SCRIPT LOAD must answer the SHA1 of its source; AUTH, CLIENT SETNAME and
        # SELECT anything but an error; CLIENT SETINFO anything (a server before 7.2 refuses it).
        shas: list[bytes | None] = [None] * (len(setup) - len(SCRIPTS)) + [script.sha for script in SCRIPTS]
        for command, sha, reply in zip(setup, shas, replies, strict=True):
            if isinstance(reply, ReplyError) and naming_optional(command):
                continue
            if isinstance(reply, ReplyError):
                proto.abort()
                if reply.code in TRANSIENT:
                    raise TransientHandshake(reply)
                # Say what was refused: "authentication failed: AUTH: ...", "CLIENT SETNAME: ...".
                refusal = "authentication failed: " if command[0] == b"AUTH" else ""
                raise cache_error(
                    f"connect failed: {refusal}{command_name(command)}: the server replied {reply}", self.server
                )
            if sha is not None and reply != sha:
                # Not the SHA1 of what was sent: this is not a server that runs our scripts
                # as sent, or the replies are not the ones these commands got.
                proto.abort()
                raise cache_error(f"connect failed: SCRIPT LOAD returned {_shown(reply)}", self.server)
        self._authed_at = loop.time()
        conn: AioConnection = proto
        return conn

    async def _connection(self) -> AioConnection:
        """The live connection, or a new one (shared by every task that finds it broken)."""
        proto = self._proto
        if proto is not None and proto.usable():
            return proto
        task = self._connecting
        if task is None:
            task = self._connecting = asyncio.get_running_loop().create_task(self._open())
            task.add_done_callback(self._opened)
        # Shielded: one waiter's cancellation must not cancel the connect the others wait on.
        return await asyncio.shield(task)

    def _opened(self, task: asyncio.Task[AioConnection]) -> None:
        self._connecting = None
        if not task.cancelled() and task.exception() is None:
            self._proto = task.result()

    async def _live(self) -> AioConnection:
        """The connection to send on: the live one, or a new one if it broke or the primary moved."""
        proto = self._proto
        if proto is not None and self._watch is not None and await self._primary_moved():
            # The old primary may take writes until it is demoted: not one more here.
            proto.abort()
        if proto is None or not proto.usable():
            proto = await self._connection()
        return proto

    async def _reauth_if_due(self, proto: AioConnection) -> None:
        """reauth_interval: AUTH again on the live connection, with what the provider says
        now, once the interval has passed (no reconnect). Refused (WRONGPASS) or lost: the
        connection is retired and NotSent raised, so the call goes on a new connection,
        which asks the provider again."""
        loop = asyncio.get_running_loop()
        if loop.time() - self._authed_at < self._reauth:
            return
        self._authed_at = loop.time()  # the other tasks of this moment do not send it too
        command = await reauth_command_async(self._config)  # None also when the provider failed (logged)
        if command is None:
            return
        try:
            reply = await proto.execute(*command)
        except _LOST as exc:
            raise NotSent(f"AUTH again: {_describe(exc)}") from exc
        if isinstance(reply, ReplyError):
            self._retire(proto)
            raise NotSent(f"AUTH again: the server replied {reply}")

    def _retire(self, proto: AioConnection) -> None:
        """No new command on ``proto`` (its authentication was refused, a transient or
        READONLY reply: hotlock._exchange.retires): the next call connects anew; it closes
        once the replies already owed on it have come, so no other task's command in flight
        is cut off (AioCore.retire)."""
        if self._proto is proto:
            self._proto = None
        proto.retire()

    async def _primary_moved(self) -> bool:
        """Whether the sentinels now name another primary than the live connection's
        (asked again every PrimaryWatch.REFRESH_S, off the loop)."""
        watch = self._watch
        assert watch is not None
        if watch.due():
            await asyncio.get_running_loop().run_in_executor(None, watch.refresh)
        return watch.epoch != self._epoch

    # -- carrying out the steps ---------------------------------------------------------

    def _run(self, steps: Steps[T], carried: Any = None) -> Awaitable[T]:
        return drive_async(steps, self._carry, carried)

    async def _carry(self, step: Send) -> list[Any]:
        """One Send of hotlock._exchange on the live connection (made first if there is
        none), within the step's time when it gives one (else the protocol's reply
        timeout): its replies, error replies as ReplyError, or the Failure that lost them.
        A cancelled waiter still takes its reply off the wire (FIFO holds), and a connect
        in flight goes on for the next caller: cutting a step short is safe."""
        try:
            if step.timeout is None:
                return await self._send(step)
            return await within(self._send(step), step.timeout)
        except TransientHandshake as exc:
            raise exc.reply from None
        except Failure:
            raise
        except (ConnectionError, TimeoutError) as exc:
            raise _lost(exc) from exc

    async def _send(self, step: Send) -> list[Any]:
        """The step's commands in one write, every reply checked. No trailing frame
        (Send.frame): the protocol hands each reply to the next waiter in order, and drops
        the connection on one that no waiter is owed; a reply shifted onto the wrong
        command shows in its shape."""
        proto = self._proto
        if proto is None or self._watch is not None or not proto.usable():
            proto = await self._live()
        if self._reauth:
            await self._reauth_if_due(proto)
        commands = step.commands
        if type(step) is Transaction:
            # Read in C, by hotlock._acquire's rules: each key's answer, not its four replies.
            wait = step.wait
            replies = await proto.acquire_many(
                step.keys, step.tokens, step.ttl_ms, wait[0] if wait else None, step.fenced
            )
            return self._decided(proto, replies, len(step.keys), step.shapes[len(step.shapes) - len(wait) :])
        if len(commands) == 1:
            replies = [await proto.execute(*commands[0])]
        elif commands:
            replies = await proto.pipeline(commands)
        else:
            return []  # connect_steps: the handshake was the round trip
        self._check(proto, replies, step.shapes)
        return replies

    def _check(self, proto: AioConnection, replies: list[Any], shapes: list[Shape]) -> None:
        """Each reply of its command's shape, else the connection is dropped (the replies
        on it may not be the ones their commands got) and the call fails; an error reply
        that retires the connection (hotlock._exchange.retires) retires it."""
        for reply, shape in zip(replies, shapes, strict=True):
            if type(reply) is ReplyError:
                if retires(reply):
                    self._retire(proto)
            elif not shape(reply):
                proto.abort()
                raise Failure(f"unexpected reply {_shown(reply)}")

    def _decided(self, proto: AioConnection, replies: list[Any], n: int, wait: list[Shape]) -> Decided:
        """A Transaction's replies as AioCore.acquire_many gives them (``n`` answers, then
        the WAIT's), checked, and as the steps take them."""
        self._check(proto, replies, [is_int] * n + wait)
        refused = proto.multi_refusal if -1 in replies[:n] else None
        return Decided(replies, None if refused is None else ReplyError(refused))

    def _settled(self, proto: AioConnection, replies: list[Any], shapes: list[Shape]) -> Any:
        """The outcome a shortcut hands the steps (Running.carried) when its reply did not
        settle the call: the replies, checked, or the Failure a reply out of shape is."""
        try:
            self._check(proto, replies, shapes)
        except Failure as failure:
            return failure
        return replies

    # -- the AsyncBackend interface ---------------------------------------------------
    # The common acquire, extend and release take a shortcut (hotlock._exchange: a transport's
    # shortcut): one C call on the live connection, no steps, when no Sentinel watch or
    # AUTH again is to come first; any reply but the one that settles the call, and any
    # failure, is handed to the steps, which go on from there.

    async def acquire(
        self, key: bytes, token: bytes, ttl_ms: int, since: float | None, wait_ms: int, script: Script
    ) -> int:
        start = self.clock() if since is None else since
        proto = self._proto
        carried: Any = None
        if proto is not None and self._direct and proto.usable() and self.transacts(script, token):
            try:
                answer = await proto.acquire(key, token, ttl_ms, self.fenced)
            except _LOST as exc:
                carried = _lost(exc)
            else:
                if type(answer) is int and answer > 0:
                    return answer
                carried = self._decided(proto, [answer], 1, [])
        until = self.retry_until(wait_ms, start)
        return (await self._run(self.acquire_steps("acquire", [key], [token], ttl_ms, script, until), carried))[0]

    async def acquire_many(self, keys: list[bytes], tokens: list[bytes], ttl_ms: int) -> list[int]:
        # Copies: the caller's lists may change while this awaits (a NOSCRIPT resend reads them again).
        return await self._run(self.acquire_steps("acquire_many", list(keys), list(tokens), ttl_ms))

    async def extend(self, key: bytes, token: bytes, ttl_ms: int) -> bool:
        proto = self._proto
        carried: Any = None
        first = self.extend_first(key, token, ttl_ms)
        if proto is not None and self._direct and first is not None and proto.usable():
            try:
                reply = await proto.execute(*first.commands[0])
            except _LOST as exc:
                carried = _lost(exc)
            else:
                if (reply == b"OK" or (reply == 1 and type(reply) is int)) and first.shapes[0](reply):
                    return True
                carried = self._settled(proto, [reply], first.shapes)
        return (await self._run(self.extend_steps("extend", [key], [token], ttl_ms), carried))[0]

    async def extend_many(self, keys: list[bytes], tokens: list[bytes], ttl_ms: int) -> list[bool]:
        return await self._run(self.extend_steps("extend_many", list(keys), list(tokens), ttl_ms))

    async def release(self, key: bytes, token: bytes) -> bool:
        proto = self._proto
        carried: Any = None
        if proto is not None and self._direct and proto.usable():
            try:
                reply = await proto.execute(*self.release_first(key, token))
            except _LOST as exc:
                carried = _lost(exc)
            else:
                if reply == 1 and type(reply) is int:
                    return True
                carried = self._settled(proto, [reply], [is_flag])
        return (await self._run(self.release_steps("release", [key], [token]), carried))[0]

    async def release_many(self, keys: list[bytes], tokens: list[bytes]) -> list[bool]:
        return await self._run(self.release_steps("release_many", list(keys), list(tokens)))

    async def set_nx(self, key: bytes, value: bytes, ttl_ms: int) -> bool:
        return await self._run(self.set_nx_steps(key, value, ttl_ms))

    async def incr(self, key: bytes, amount: int) -> int:
        return await self._run(self.incr_steps(key, amount))

    async def info(self) -> dict[str, str] | None:
        return await self._run(self.info_steps())

    async def command_info(self) -> list[Any] | None:
        return await self._run(self.command_info_steps())

    # -- a cluster node's link (hotlock.backends.cluster_async.AsyncLink) -------------------------

    async def link_call(self, commands: list[tuple[bytes, ...]], timeout: float | None) -> list[Any]:
        """``commands`` pipelined on this node's protocol, their replies (errors in place);
        CacheError if it cannot connect, LinkLost when the reply may have been lost."""
        proto = self._proto
        if proto is None or not proto.usable():
            proto = await self._connection()
        try:
            if self._reauth:
                await self._reauth_if_due(proto)
            pending = proto.pipeline(list(commands))
            return await (pending if timeout is None else within(pending, timeout))
        except _LOST as exc:  # NotSent included: one resend is safe either way
            raise LinkLost(_describe(exc)) from exc

    async def link_one(self, command: tuple[bytes, ...]) -> Any:
        """One command on this node's protocol, its reply (an error in place): the cluster's
        fast path, which needs no pipeline list. As link_call, LinkLost or CacheError; a
        connection to make, or an AUTH that may be due, goes by link_call."""
        proto = self._proto
        if proto is None or self._reauth or not proto.usable():
            return (await self.link_call([command], None))[0]
        try:
            return await proto.execute(*command)
        except _LOST as exc:  # NotSent included: one resend is safe either way
            raise LinkLost(_describe(exc)) from exc

    async def link_close(self) -> None:
        await self.close()

    async def link_drop(self) -> None:
        """Route's answer to NOAUTH/WRONGPASS on this node: a new connection for the next
        command, which asks the credential provider again."""
        if self._proto is not None:
            self._retire(self._proto)

    async def close(self) -> None:
        if self.wake_slot is not None:
            await self.wake_slot.close()
        connecting, self._connecting = self._connecting, None
        if connecting is not None:
            # Cancelled and waited for: a connect still in flight when the loop ends would
            # be a task left pending (asyncio.wait raises nothing of its own, only a
            # cancellation of this close()).
            connecting.cancel()
            await asyncio.wait({connecting})
        proto, self._proto = self._proto, None
        if proto is not None:
            live = proto.usable()  # not in a forked child: its close leaves the parent's socket alone
            proto.close()
            if live and self._config.tls:
                # A TLS transport closes after its close_notify exchange, a round trip
                # later: wait for it (within one reply timeout, then drop it), or a loop
                # that ends right after close() leaves the socket to the garbage collector.
                try:
                    await within(asyncio.shield(proto.lost()), self._config.timeout)
                except TimeoutError:
                    proto.abort()


def _lost(exc: BaseException) -> Failure:
    """What a write lost, as the steps take it: NotSent as it is, else Lost (its replies)."""
    return exc if isinstance(exc, NotSent) else Lost(_describe(exc))


def _shown(reply: object) -> str:
    """A reply in an error message: its type and the start of its repr."""
    text = repr(reply)
    return f"{type(reply).__name__} {text[:60]}{'...' if len(text) > 60 else ''}"


def _describe(exc: BaseException) -> str:
    if isinstance(exc, TimeoutError):
        return "no reply within the timeout"
    return str(exc) or type(exc).__name__
