"""The native async backend: the Cython asyncio protocol of ext/_aio.pxi, driven from here.

The protocol moves bytes: it formats commands, pipelines every task's commands on one
connection and answers futures in order. This module owns what the sync native client
owns in C: connecting (AUTH, SELECT, script loads), reconnecting after a broken
connection, the lost-reply rule (_roundtrip), NOSCRIPT recovery, READONLY, and turning
every failure into a CacheError naming the key and the server.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable
from typing import Any, Protocol

from .._acquire import warn_refused
from .._config import ServerConfig, command_name, keepalive, naming_commands, naming_optional, tls_context
from .._credentials import auth_command_async, is_auth_refusal, reauth_command_async
from .._dialect import COMMAND_PROBE, UNDETECTED, Dialect, by_script, extend_command, release_command, script_serves
from .._ident import TOKEN_BYTES
from .._scripts import ACQUIRE, EXTEND, RELEASE, SCRIPTS, Script, held_value, resent
from .._sentinel import PrimaryWatch
from .._transient import Retrying, code, tried
from ..errors import CacheError, LinkLost, ReplyError, cache_error
from .retry_async import info_fields, retry_until, unconfirmed, unconfirmed_renewals, wait_ms, within
from .wakeup_async import async_slot

__all__ = ["NativeAsyncBackend", "NotSent", "ReplyError"]

log = logging.getLogger("hotlock")


# An error reply, as the protocol hands it over: returned as a value, never raised by it
# (hotlock.backends.cluster's, so a cluster link's replies need no translation).


class NotSent(ConnectionError):
    """Nothing of the call ran: the command never reached the transport, or the connection
    it needed lost its handshake's reply. Trying again cannot run anything twice."""


class TransientHandshake(NotSent):
    """A new connection's handshake (a SCRIPT LOAD on a loading server, say) got a
    transient reply (hotlock._transient): nothing of the call ran, and the call resends
    after a pause, as after a transient reply to its own command."""

    def __init__(self, reply: ReplyError, proto: AioConnection) -> None:
        super().__init__(reply)
        self.proto = proto


class AioConnection(Protocol):
    """What this module uses of ext/_aio.pxi's AioProtocol."""

    def usable(self) -> bool: ...
    def execute(self, *args: bytes | int) -> asyncio.Future[Any]: ...
    def pipeline(self, commands: list[tuple[bytes | int, ...]]) -> asyncio.Future[list[Any]]: ...
    # The transaction acquire (hotlock._acquire; SET NX PX alone when not fenced), decided in
    # C: the fence (1 without one), 0 (the script is to decide), -1 (that too, MULTI refused
    # alone: multi_refusal), or the error reply.
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


Send = Callable[[AioConnection], Awaitable[Any]]

_LOST = (ConnectionError, TimeoutError)


class NativeAsyncBackend:
    name = "native"

    def __init__(self, config: ServerConfig, protocol_class: Callable[..., AioConnection]) -> None:
        self.server = config.display
        # What extend and release send: the scripts until connect() detects the server.
        self.dialect: Dialect = UNDETECTED
        self.fenced = True
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
        # long has passed (loop time) since the last (_reauthenticate).
        self._reauth = config.reauth_interval
        self._authed_at = 0.0
        # The acquire of a free key goes as the transaction (hotlock._acquire): the dialect's
        # transaction, until the server refuses MULTI alone (then False for good).
        self._txn = False
        self._multi_refused = False

    @classmethod
    async def open(cls, config: ServerConfig, protocol_class: Callable[..., AioConnection]) -> NativeAsyncBackend:
        backend = cls(config, protocol_class)
        # The first connection is a round trip like any other: its lost handshake reply is retried.
        await backend._roundtrip("connect", None, _connected)
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
                # it may connect again under its lost-reply rule (_roundtrip).
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
                if code(str(reply)) is not None:
                    raise TransientHandshake(reply, proto)
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

    # -- round trips ------------------------------------------------------------------

    async def _live(self) -> AioConnection:
        """The connection to send on: the live one, or a new one if it broke or the primary moved."""
        proto = self._proto
        if proto is not None and self._watch is not None and await self._primary_moved():
            # The old primary may take writes until it is demoted: not one more here.
            proto.abort()
        if proto is None or not proto.usable():
            proto = await self._connection()
        return proto

    async def _roundtrip(
        self, what: str, key: bytes | None, send: Send, retry_lost_reply: bool = False, until: float | None = None
    ) -> Any:
        """Send on the live connection (reconnecting first if it broke), under the
        lost-reply rule (docs/architecture.md), in this one place for every round trip of this
        backend, the connect handshake included: after a lost reply, one more try, which
        ends by ``until`` (loop time) when given, else within one more reply timeout.

        What is tried again: anything after NotSent (the command never reached the
        transport, or its connection's handshake lost its reply: nothing of the call ran);
        a command whose own reply was lost only with ``retry_lost_reply`` (an acquire with
        the same token, whose script counts "already my token" as success; a release,
        which finds nothing to do the second time). Never INCRBY or SET NX: a resent
        INCRBY counts twice, a resent SET NX answers "not set" for the value this call set."""
        proto = self._proto
        try:
            if proto is None or self._watch is not None or not proto.usable():
                proto = await self._live()
            if self._reauth:
                await self._reauth_if_due(proto)
            reply = await send(proto)
        except TransientHandshake as exc:
            return await self._again(what, key, send, retry_lost_reply, until, None, exc.proto, exc)
        except NotSent as exc:
            lost: BaseException = exc
        except _LOST as exc:
            if not retry_lost_reply:
                raise self._error(what, key, exc) from exc
            lost = exc
        else:
            if _transient(reply) is None:  # the common case: one type check per reply
                if type(reply) is int or not _auth_refused(reply):
                    return reply
                # NOAUTH (the server no longer holds this connection authenticated): nothing
                # ran. A new connection asks the credential provider again; once more on it.
                self._retire(proto)
                refusal = NotSent(f"the server replied {_first(reply)}")
                return await self._again(what, key, send, retry_lost_reply, until, refusal, None, None)
            return await self._again(what, key, send, retry_lost_reply, until, None, proto, reply)
        return await self._again(what, key, send, retry_lost_reply, until, lost, None, None)

    async def _again(
        self,
        what: str,
        key: bytes | None,
        send: Send,
        retry_lost_reply: bool,
        until: float | None,
        lost: BaseException | None,
        proto: AioConnection | None,
        reply: Any,
    ) -> Any:
        """After a lost reply (``lost``) or a transient reply (``reply``, on ``proto``):
        the one retry after a lost reply, reconnect included, and resends after transient
        replies (hotlock._transient: the protocol retired, a pause, a new connection) while
        the call's own timeout lasts; all cut off at ``until`` (else two reply timeouts
        from now, of which the pauses take at most the first)."""
        loop = asyncio.get_running_loop()
        timeout = self._config.timeout
        until = loop.time() + 2 * timeout if until is None else until
        spent = False
        transient = Retrying()

        async def once() -> tuple[AioConnection, Any]:
            live = await self._live()
            return live, await send(live)

        while True:
            if lost is not None:
                left = min(timeout, until - loop.time())
                if spent or left < 0.001:
                    raise self._error(tried(what, spent, transient), key, lost) from lost
                spent = True
            else:
                bad = _transient(reply)
                assert proto is not None and bad is not None
                proto.retire()  # every task's next command goes on a new connection
                if isinstance(bad, Exception) and not isinstance(bad, ReplyError):
                    bad = bad.args[0]  # a handshake's transient reply (TransientHandshake)
                pause = transient.pause(until - timeout - loop.time())
                if pause is None:
                    raise cache_error(
                        f"{tried(what, spent, transient)} failed: the server replied {bad}", self.server, key
                    )
                await asyncio.sleep(pause)
                left = max(min(timeout, until - loop.time()), 0.001)
            try:
                # A cancelled waiter still takes its reply off the wire (FIFO holds), and a
                # connect in flight goes on for the next caller: cutting this short is safe.
                proto, reply = await within(once(), left)
            except TransientHandshake as exc:
                proto, reply, lost = exc.proto, exc, None
                continue
            except _LOST as exc:
                if not (retry_lost_reply or isinstance(exc, NotSent)):
                    raise self._error(tried(what, spent, transient), key, exc) from exc
                lost = exc
                continue
            if _transient(reply) is None:
                return reply
            lost = None

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
        """No new command on ``proto`` (its authentication was refused): the next call
        connects anew; it closes once the replies already owed on it have come, so no other
        task's command in flight is cut off (AioCore.retire)."""
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

    def _error(self, what: str, key: bytes | None, exc: BaseException) -> Exception:
        return cache_error(f"{what} failed: {_describe(exc)}", self.server, key)

    def _unexpected(self, what: str, key: bytes | None, reply: object) -> Exception:
        """A reply of a shape the command never gets: the replies on this connection may
        not be the ones their commands got, so it is dropped, never used again."""
        if self._proto is not None:
            self._proto.abort()
        return cache_error(f"{what} failed: unexpected reply {_shown(reply)}", self.server, key)

    def _int(self, what: str, key: bytes | None, reply: object) -> int:
        """An integer reply (a script's, INCRBY's, WAIT's), else the connection is dropped and CacheError."""
        if type(reply) is int:
            return reply
        raise self._unexpected(what, key, reply)

    def _ok(self, what: str, key: bytes | None, reply: object) -> bool:
        """SET's reply: OK (True) or nil (False); anything else drops the connection (CacheError)."""
        if reply is None or reply == b"OK":
            return reply is not None
        raise self._unexpected(what, key, reply)

    def _refused(self, what: str, key: bytes | None, reply: ReplyError) -> Exception:
        if str(reply).startswith("READONLY") and self._proto is not None:
            # A demoted primary: the next call goes on a new connection (the calls of
            # other tasks already written on this one still get their replies).
            self._proto.retire()
        return cache_error(f"{what} failed: the server replied {reply}", self.server, key)

    async def _script(
        self, what: str, script: Script, key: bytes, *args: bytes | int, retry: bool = False, until: float | None = None
    ) -> Any:
        command = (b"EVALSHA", script.sha, 1, key, *args)
        reply = await self._roundtrip(what, key, lambda p: p.execute(*command), retry, until)
        if _noscript(reply):
            # Restart, SCRIPT FLUSH or failover emptied the script cache. The load and
            # the retry go together on one connection, so they cost one round trip.
            load = (b"SCRIPT", b"LOAD", script.source)
            loaded, reply = await self._roundtrip(what, key, lambda p: p.pipeline([load, command]), retry, until)
            if isinstance(loaded, ReplyError):
                raise self._refused(what, key, loaded)
        if isinstance(reply, ReplyError):
            raise self._refused(what, key, reply)
        return reply

    async def _script_many(
        self,
        what: str,
        script: Script,
        keys: list[bytes],
        tokens: list[bytes],
        *args: int,
        retry: bool = False,
        trailer: tuple[bytes | int, ...] | None = None,
    ) -> list[Any]:
        """EVALSHA ``script`` once per key, in one write; ``trailer`` (a WAIT) rides last
        and its reply comes last."""
        tail: list[tuple[bytes | int, ...]] = [] if trailer is None else [trailer]

        def commands(indices: range | list[int]) -> list[tuple[bytes | int, ...]]:
            calls: list[tuple[bytes | int, ...]] = [
                (b"EVALSHA", script.sha, 1, keys[i], tokens[i], *args) for i in indices
            ]
            return calls + tail

        batch = commands(range(len(keys)))
        replies: list[Any] = await self._roundtrip(what, None, lambda p: p.pipeline(batch), retry)
        missing = [i for i, reply in enumerate(replies[: len(keys)]) if _noscript(reply)]
        if missing:
            # Only the calls that did not run go again (resent), the trailer behind them.
            again = [(b"SCRIPT", b"LOAD", script.source), *commands(missing)]
            loaded, *redone = await self._roundtrip(what, None, lambda p: p.pipeline(again), retry)
            if isinstance(loaded, ReplyError):
                raise self._refused(what, None, loaded)
            resent(replies, missing, redone, len(keys))
        for reply in replies:
            if isinstance(reply, ReplyError):
                raise self._refused(what, None, reply)
        return replies

    async def _command(self, what: str, key: bytes, *command: bytes | int, retry: bool = False) -> Any:
        reply = await self._roundtrip(what, key, lambda p: p.execute(*command), retry)
        if isinstance(reply, ReplyError):
            raise self._refused(what, key, reply)
        return reply

    async def _commands(self, what: str, commands: list[tuple[bytes, ...]], retry: bool = False) -> list[Any]:
        """Plain commands (the Lua-free extend and release) in one write; error replies raised."""
        replies: list[Any] = await self._roundtrip(what, None, lambda p: p.pipeline(list(commands)), retry)
        for reply in replies:
            if isinstance(reply, ReplyError):
                raise self._refused(what, None, reply)
        return replies

    # -- the AsyncBackend interface ---------------------------------------------------
    # Ordering promise: every command of this backend goes through one connection in
    # FIFO order, so a release queued after an (even cancelled) acquire runs after it.

    async def acquire(
        self, key: bytes, token: bytes, ttl_ms: int, since: float | None, wait_ms: int, script: Script
    ) -> int:
        if self._config.wait_replicas:
            return (await self._acquire_confirmed("acquire", [key], [token], ttl_ms, script))[0]
        until = retry_until(since, wait_ms, self._config.timeout)
        if script is ACQUIRE and self._txn and len(token) == TOKEN_BYTES:
            # The transaction (hotlock._acquire), resent whole after a lost reply (same token).
            answer = await self._roundtrip(
                "acquire", key, lambda p: p.acquire(key, token, ttl_ms, self.fenced), True, until
            )
            if type(answer) is not int:
                raise self._refused("acquire", key, answer)
            if answer > 0:
                return answer
            if answer < 0:
                self._refuse_multi()
            # The key exists (held, ours after a lost reply, permits): the script decides.
        return self._int(
            "acquire", key, await self._script("acquire", script, key, token, ttl_ms, retry=True, until=until)
        )

    async def acquire_many(self, keys: list[bytes], tokens: list[bytes], ttl_ms: int) -> list[int]:
        # Copies: the caller's lists may change while this awaits (a NOSCRIPT resend reads them again).
        keys, tokens = list(keys), list(tokens)
        if self._config.wait_replicas:
            return await self._acquire_confirmed("acquire_many", keys, tokens, ttl_ms)
        if self._txn:
            return (await self._take("acquire_many", keys, tokens, ttl_ms, None))[0]
        replies = await self._script_many("acquire_many", ACQUIRE, keys, tokens, ttl_ms, retry=True)
        return [self._int("acquire_many", None, r) for r in replies]

    async def _take(
        self, what: str, keys: list[bytes], tokens: list[bytes], ttl_ms: int, wait: tuple[bytes | int, ...] | None
    ) -> tuple[list[int], int]:
        """The acquires of plain tokens as transactions (hotlock._acquire) in one write,
        ``wait`` (a WAIT) behind them; then those left to the script, and permits' asks, as
        ACQUIRE in a second write with a WAIT of its own. Each key's result, and the fewest
        replicas a WAIT that confirmed an acquire counted (-1 without ``wait``)."""
        results = [0] * len(keys)
        rest = [i for i, t in enumerate(tokens) if len(t) != TOKEN_BYTES]
        plain = [i for i, t in enumerate(tokens) if len(t) == TOKEN_BYTES]
        counts: list[int] = []
        if plain:
            ks, ts = [keys[i] for i in plain], [tokens[i] for i in plain]
            answers = await self._roundtrip(
                what, None, lambda p: p.acquire_many(ks, ts, ttl_ms, wait, self.fenced), True
            )
            taken = False
            for i, answer in zip(plain, answers, strict=False):
                if type(answer) is not int:
                    raise self._refused(what, None, answer)
                if answer > 0:
                    results[i] = answer
                    taken = True
                else:
                    rest.append(i)
                    if answer < 0:
                        self._refuse_multi()
            if wait is not None and isinstance(answers[-1], ReplyError):
                raise self._refused(f"{what} (WAIT)", None, answers[-1])
            # A WAIT behind transactions that took nothing confirms nothing of ours.
            if wait is not None and taken:
                counts.append(self._int(f"{what} (WAIT)", None, answers[-1]))
        if rest:
            rest.sort()
            ks, ts = [keys[i] for i in rest], [tokens[i] for i in rest]
            replies = await self._script_many(what, ACQUIRE, ks, ts, ttl_ms, retry=True, trailer=wait)
            for i, reply in zip(rest, replies, strict=False):
                results[i] = self._int(what, None, reply)
            if wait is not None:
                counts.append(self._int(f"{what} (WAIT)", None, replies[-1]))
        return results, min(counts, default=-1)

    def _refuse_multi(self) -> None:
        """MULTI was refused alone (an ACL without it, a proxy): every later acquire goes by
        script (hotlock._acquire.refused_multi), said once."""
        self._txn = False
        if not self._multi_refused:
            self._multi_refused = True
            why = getattr(self._proto, "multi_refusal", None)
            warn_refused(self.server, why)

    async def _acquire_confirmed(
        self, what: str, keys: list[bytes], tokens: list[bytes], ttl_ms: int, script: Script = ACQUIRE
    ) -> list[int]:
        """Under wait_replicas: the acquires and a WAIT behind them on the same connection
        (WAIT confirms the writes made before it on its own connection), in one write; a
        second write for those the transactions left to the script, with its own WAIT."""
        config = self._config
        wait = (b"WAIT", config.wait_replicas, wait_ms(config))
        if script is ACQUIRE and self._txn:
            results, confirmed = await self._take(what, keys, tokens, ttl_ms, wait)
        else:
            *replies, confirmed = await self._script_many(what, script, keys, tokens, ttl_ms, retry=True, trailer=wait)
            results = [self._int(what, None, r) for r in replies]
            confirmed = self._int(f"{what} (WAIT)", None, confirmed)
        if confirmed >= config.wait_replicas:
            return results
        held = [(k, held_value(t, r)) for k, t, r in zip(keys, tokens, results, strict=True) if r > 0]
        if held:
            # If the undo fails too, the keys expire by their TTL; the caller hears about the replicas.
            with contextlib.suppress(CacheError):
                await self.release_many([k for k, _ in held], [t for _, t in held])
        raise unconfirmed(what, confirmed, config, keys[0] if len(keys) == 1 else None)

    async def _extend_confirmed(self, what: str, keys: list[bytes], tokens: list[bytes], ttl_ms: int) -> list[bool]:
        """Under wait_replicas: the extends and a WAIT behind them in one write, as for the
        acquires. By script whatever the dialect: it takes a waiter's mark and permits as
        they are, so a batch is one write with one WAIT (SET IFEQ would send the marked ones
        again, with a WAIT of their own). Not resent: a lost reply is a CacheError."""
        config = self._config
        wait = (b"WAIT", config.wait_replicas, wait_ms(config))
        *replies, confirmed = await self._script_many(what, EXTEND, keys, tokens, ttl_ms, trailer=wait)
        results = [bool(self._int(what, None, r)) for r in replies]
        confirmed = self._int(f"{what} (WAIT)", None, confirmed)
        if confirmed >= config.wait_replicas or not any(results):
            return results
        # If the release fails too, the keys expire by their TTL; the leases are lost either way.
        with contextlib.suppress(CacheError):
            await self.release_many(
                [k for k, ok in zip(keys, results, strict=True) if ok],
                [t for t, ok in zip(tokens, results, strict=True) if ok],
            )
        raise unconfirmed_renewals(what, results, confirmed, config)

    async def extend(self, key: bytes, token: bytes, ttl_ms: int) -> bool:
        if self._config.wait_replicas:
            return (await self._extend_confirmed("extend", [key], [token], ttl_ms))[0]
        if self.dialect.lua_free and not by_script([token]):
            # SET IFEQ replies OK when the key held this value (now with the new TTL), nil otherwise.
            reply = await self._roundtrip("extend", key, lambda p: p.execute(*extend_command(key, token, ttl_ms)))
            if not _script_serves(reply):  # refused at maxmemory, or the key holds permits (see _dialect)
                if isinstance(reply, ReplyError):
                    raise self._refused("extend", key, reply)
                if self._ok("extend", key, reply):
                    return True
                # SET IFEQ compares the whole value: a lock a waiter marked ('+') is
                # extended by the script, which accepts the mark (contended, or lost).
        return bool(self._int("extend", key, await self._script("extend", EXTEND, key, token, ttl_ms)))

    async def extend_many(self, keys: list[bytes], tokens: list[bytes], ttl_ms: int) -> list[bool]:
        # Copies, as in acquire_many.
        keys, tokens = list(keys), list(tokens)
        if self._config.wait_replicas:
            return await self._extend_confirmed("extend_many", keys, tokens, ttl_ms)
        if self.dialect.lua_free and not by_script(tokens):
            sets: list[tuple[bytes | int, ...]] = [
                extend_command(k, t, ttl_ms) for k, t in zip(keys, tokens, strict=True)
            ]
            replies: list[Any] = await self._roundtrip("extend_many", None, lambda p: p.pipeline(sets))
            if not any(_script_serves(r) for r in replies):  # refused at maxmemory, or permits (see _dialect)
                for reply in replies:
                    if isinstance(reply, ReplyError):
                        raise self._refused("extend_many", None, reply)
                done = [self._ok("extend_many", None, r) for r in replies]
                # What SET IFEQ missed once more by script, which accepts a waiter's mark ('+').
                missed = [i for i, ok in enumerate(done) if not ok]
                if missed:
                    again = await self._script_many(
                        "extend_many", EXTEND, [keys[i] for i in missed], [tokens[i] for i in missed], ttl_ms
                    )
                    for i, r in zip(missed, again, strict=True):
                        done[i] = bool(self._int("extend_many", None, r))
                return done
        replies = await self._script_many("extend_many", EXTEND, keys, tokens, ttl_ms)
        return [bool(self._int("extend_many", None, r)) for r in replies]

    async def release(self, key: bytes, token: bytes) -> bool:
        # A lost release reply is retried, as in sync: the second try finds the key gone
        # (False) or still ours (releases it), and either way the caller sees no error.
        # DELIFEQ/DELEX compare the whole value: a lock a waiter marked ('+') is released
        # by the script, which accepts the mark and wakes the waiter.
        if self.dialect.lua_free and not by_script([token]):
            command = release_command(self.dialect, key, token)
            reply = await self._roundtrip("release", key, lambda p: p.execute(*command), True)
            if reply == 1:
                return True
            if isinstance(reply, ReplyError) and not _script_serves(reply):  # WRONGTYPE: the key holds permits
                raise self._refused("release", key, reply)
        return bool(self._int("release", key, await self._script("release", RELEASE, key, token, retry=True)))

    async def release_many(self, keys: list[bytes], tokens: list[bytes]) -> list[bool]:
        # Copies, as in acquire_many.
        keys, tokens = list(keys), list(tokens)
        if self.dialect.lua_free and not by_script(tokens):
            dels: list[tuple[bytes | int, ...]] = [
                release_command(self.dialect, k, t) for k, t in zip(keys, tokens, strict=True)
            ]
            replies: list[Any] = await self._roundtrip("release_many", None, lambda p: p.pipeline(dels), True)
            for reply in replies:
                if isinstance(reply, ReplyError) and not _script_serves(reply):
                    raise self._refused("release_many", None, reply)
            done = [r == 1 for r in replies]
            missed = [i for i, ok in enumerate(done) if not ok]  # once more by script, as in release
            if missed:
                again = await self._script_many(
                    "release_many", RELEASE, [keys[i] for i in missed], [tokens[i] for i in missed], retry=True
                )
                for i, r in zip(missed, again, strict=True):
                    done[i] = bool(self._int("release_many", None, r))
            return done
        replies = await self._script_many("release_many", RELEASE, keys, tokens, retry=True)
        return [bool(self._int("release_many", None, r)) for r in replies]

    async def set_nx(self, key: bytes, value: bytes, ttl_ms: int) -> bool:
        return self._ok("set_nx", key, await self._command("set_nx", key, b"SET", key, value, b"NX", b"PX", ttl_ms))

    async def incr(self, key: bytes, amount: int) -> int:
        return self._int("incr", key, await self._command("incr", key, b"INCRBY", key, amount))

    async def info(self) -> dict[str, str] | None:
        reply = await self._roundtrip("INFO", None, lambda p: p.execute(b"INFO"))
        if isinstance(reply, ReplyError):
            if str(reply).startswith("NOPERM"):
                return None
            raise self._refused("INFO", None, reply)
        if type(reply) is not bytes:
            raise self._unexpected("INFO", None, reply)
        return info_fields(reply)

    async def command_info(self) -> list[Any] | None:
        """COMMAND INFO DELIFEQ DELEX's reply, or None when the server or its ACL refuses it."""
        reply = await self._roundtrip("COMMAND INFO", None, lambda p: p.execute(*COMMAND_PROBE))
        if isinstance(reply, ReplyError):
            return None  # NOPERM, or a proxy without COMMAND: the version decides
        return reply if isinstance(reply, list) else None

    def use_dialect(self, dialect: Dialect) -> None:
        self.dialect = dialect
        self.fenced = dialect.fenced
        self._txn = dialect.transaction and not self._multi_refused

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


async def _connected(proto: AioConnection) -> None:
    """What connect() sends once connected: nothing (the handshake was the round trip)."""


def _auth_refused(reply: object) -> bool:
    """Whether a reply (or a pipeline's first) says the connection is not authenticated:
    then every command of the write was refused, none ran."""
    first = _first(reply)
    return type(first) is ReplyError and is_auth_refusal(str(first))


def _first(reply: object) -> object:
    return reply[0] if type(reply) is list and reply else reply


def _script_serves(reply: object) -> bool:
    return isinstance(reply, ReplyError) and script_serves(str(reply))


def _transient(reply: object) -> ReplyError | TransientHandshake | None:
    """The transient reply (hotlock._transient) in a round trip's outcome, if any: the
    reply itself, or one of a pipeline's, or a handshake's."""
    if type(reply) is ReplyError or type(reply) is TransientHandshake:
        return reply if type(reply) is TransientHandshake or code(str(reply)) is not None else None
    if type(reply) is list:
        for each in reply:
            if type(each) is ReplyError and code(str(each)) is not None:
                return each
    return None


def _noscript(reply: object) -> bool:
    return isinstance(reply, ReplyError) and str(reply).startswith("NOSCRIPT")


def _shown(reply: object) -> str:
    """A reply in an error message: its type and the start of its repr."""
    text = repr(reply)
    return f"{type(reply).__name__} {text[:60]}{'...' if len(text) > 60 else ''}"


def _describe(exc: BaseException) -> str:
    if isinstance(exc, TimeoutError):
        return "no reply within the timeout"
    return str(exc) or type(exc).__name__
