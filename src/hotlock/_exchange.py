"""One call's protocol rules on one server, with no I/O: the steps a transport carries out
(send these commands, pause) and what each reply makes of the call.

Every call of a single-server Python backend (redis-py sync and async, the extension's
asyncio client) is a generator of steps written here once, and the backend only carries
them out: it writes a ``Send``'s commands on one connection and sends the replies back in
(error replies in place, as ``ReplyError``), or throws in the ``Failure`` that lost them;
it sleeps a ``Pause``. The generator's return value is the call's result; a ``CacheError``
(or ``Unreplicated``) it raises is the call's error. The sync drivers loop with
``generator.send``, the async ones await the same steps.

The rules, in the order a reply meets them (docs/architecture.md tells why each is safe):

- A lost reply (``Lost``: a timeout, a dropped connection) is resent once, with the same
  token, for the calls that may be resent (an acquire, a release), within what is left of
  the call's budget (``hotlock._transient.resend_until``). Nothing of the call ran
  (``NotSent``: a connect that failed, a handshake that lost its reply, NOAUTH on a live
  connection): any call goes once more.
- A transient error reply (``hotlock._transient``: the command did not run) is resent,
  whatever the command, after a jittered pause, until the pauses would pass the call's own
  timeout.
- NOSCRIPT (a restart, SCRIPT FLUSH, a failover emptied the script cache): the script is
  loaded and only the calls that did not run are sent again, in one round trip.
- The transaction acquire (``hotlock._acquire``): the keys it leaves to the ACQUIRE script
  go next by script; a MULTI refused alone sends every later acquire by script.
- The Lua-free extend and release (SET IFEQ, DELIFEQ, DELEX): what they missed (a waiter's
  mark, a lost lock) goes once more by script, and so does a key they are refused on (OOM,
  WRONGTYPE: ``_dialect.script_serves``).
- Under wait_replicas a WAIT rides behind the acquires and extends on their connection; an
  acquire too few replicas confirmed is undone (CacheError), an extend's lease is lost
  (``Unreplicated``), and the keys are released.

The extension's sync client keeps its own copy of these rules in C (ext/_sync.pxi), where
the hot path needs it; tests/unit/test_exchange.py holds this one to them by scripted
replies.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Awaitable, Callable, Generator, Sequence
from typing import TYPE_CHECKING, Any, Final, Generic, TypeVar

from . import _acquire
from ._credentials import is_auth_refusal
from ._dialect import Detected, Dialect, by_script, extend_command, release_command, script_serves
from ._ident import TOKEN_BYTES
from ._scripts import (
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
from ._transient import TRANSIENT, Retrying, resend_until, tried
from .errors import CacheError, ReplyError, cache_error, unconfirmed_extends, unreplicated

if TYPE_CHECKING:
    from ._config import ServerConfig

__all__ = [
    "FRAME",
    "Exchange",
    "Failure",
    "Lost",
    "NotSent",
    "Pause",
    "Running",
    "Send",
    "Shape",
    "Steps",
    "Transaction",
    "any_refusal",
    "drive",
    "drive_async",
    "is_anything",
    "is_count",
    "is_flag",
    "is_frame",
    "is_int",
    "is_ok_or_nil",
    "is_text",
    "no_permission",
    "retires",
]

T = TypeVar("T")

# -- the steps ------------------------------------------------------------------------------

# What a command may answer, error replies aside: the transport checks each reply as it
# reads it, on the connection it came on; anything else is a server, proxy or endpoint that
# does not speak as Redis does, and the connection is dropped, never read again.
Shape = Callable[[object], bool]


class Send:
    """Write ``commands`` at once on one connection and read one reply for each, checked
    against its ``shapes`` entry; send back the list of replies, error replies in place as
    ReplyError (with the code the server gave). All of them within ``timeout`` seconds
    (None: the connection's reply timeout). ``frame``: whether the transport's own check
    that nothing more came (a trailing TIME, FRAME) is wanted behind several commands;
    False when their replies frame themselves (EXEC's)."""

    __slots__ = ("commands", "frame", "shapes", "timeout")

    def __init__(
        self, commands: list[tuple[bytes, ...]], shapes: list[Shape], timeout: float | None, frame: bool = True
    ) -> None:
        self.commands = commands
        self.shapes = shapes
        self.timeout = timeout
        self.frame = frame


class Pause:
    """Sleep ``seconds``, then send None back."""

    __slots__ = ("seconds",)

    def __init__(self, seconds: float) -> None:
        self.seconds = seconds


Steps = Generator[Send | Pause, Any, T]


class Failure(Exception):
    """What a transport throws into the steps when a Send got no replies: its text says
    why, as the CacheError will ("no reply within the timeout"). This class itself is a
    failure no retry mends (a refusal at connect, a reply out of shape): raised at once."""


class Lost(Failure):
    """The commands were written and their replies did not all come (a timeout, a dropped
    connection, a reply beyond the ones asked for): they may have run."""


class NotSent(Failure):
    """Nothing of the commands ran: the connection could not be made, its handshake lost
    its reply, or the server answered NOAUTH/WRONGPASS on a live connection (the transport
    retires it: the next one asks the credential provider again)."""


def retires(reply: ReplyError) -> int:
    """What an error reply does to the connection it came on: 0 nothing; 1 it takes no
    other command (a transient reply: the resend goes on a fresh connection, the host
    resolved again; NOAUTH: it is not authenticated any more); 2 neither does any other
    connection of the cache to that server (READONLY: the endpoint reaches a replica now)."""
    code = reply.code
    if code == "READONLY":
        return 2
    return 1 if code in TRANSIENT or is_auth_refusal(code) else 0


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


# A pipeline's replies end with TIME's (two bulk strings, unlike any reply a lock command
# gives): a server that sent one reply too many in the middle of a pipeline shifts the
# rest by one, and the reply found in TIME's place shows it, where a check of what is left
# to read can miss a reply the server has yet to send. TIME, since the scripts need its
# ACL permission anyway. A single command needs no frame: an extra reply behind its own is
# found in the parser's buffer, or when the connection is next used. Nor do transactions
# (Transaction.frame): each EXEC's reply, a pair holding TIME's, is of a shape no other
# reply of theirs has, so a shift before it shows in its place.
FRAME: Final = (b"TIME",)


def is_frame(reply: object) -> bool:
    return type(reply) is list and len(reply) == 2 and type(reply[0]) is bytes and type(reply[1]) is bytes


# What each script returns: an acquire a fence or -(TTL left) (an integer), the others 0 or 1.
_SCRIPT_REPLY: dict[Script, Shape] = {
    ACQUIRE: is_int,
    ACQUIRE_WAIT: is_int,
    ACQUIRE_CHAIN: is_int,
    ACQUIRE_POLL: is_int,
    EXTEND: is_flag,
    RELEASE: is_flag,
    RELEASE_SHARDED: is_flag,
}


# -- the transaction acquire (hotlock._acquire) --------------------------------------------
# Its four replies, as each is checked on arrival. With MULTI refused (an ACL, a proxy), SET
# and TIME run on their own and EXEC is refused: SET then answers OK or nil, TIME the clock.


def _is_ok(reply: object) -> bool:
    return reply == b"OK"


def _is_queued_set(reply: object) -> bool:
    return reply == b"QUEUED" or is_ok_or_nil(reply)


def _is_queued_time(reply: object) -> bool:
    return reply == b"QUEUED" or is_frame(reply)


def _is_exec(reply: object) -> bool:
    """EXEC's: SET's reply (OK, or nil: the key exists) and TIME's."""
    return type(reply) is list and len(reply) == 2 and is_ok_or_nil(reply[0]) and is_frame(reply[1])


_TRANSACTION_REPLY: list[Shape] = [_is_ok, _is_queued_set, _is_queued_time, _is_exec]
_SET_REPLY: list[Shape] = [is_ok_or_nil]  # connect(fences=False): SET NX PX alone


class Transaction:
    """The acquires of some keys by hotlock._acquire's transaction: what to send and what
    the replies say.

    ``commands`` go in one write (every key's transaction, then ``wait``: the WAIT of
    wait_replicas, which confirms the SETs before it on its connection); ``read`` takes the
    replies and names the keys the ACQUIRE script is to decide. Those go next as ACQUIRE
    (with their own WAIT), and ``scripted`` takes their results. ``outcome`` is then what
    one acquire by script gives: each key's result, and the WAIT reply ([] without
    wait_replicas). Under connect(fences=False) each key's transaction is SET NX PX alone
    (one reply)."""

    __slots__ = ("_n", "_per", "_waits", "commands", "frame", "refused", "results", "shapes")

    def __init__(
        self,
        keys: Sequence[bytes],
        tokens: Sequence[bytes],
        ttl_ms: int,
        wait: list[tuple[bytes, ...]],
        fenced: bool,
    ) -> None:
        self._n = len(keys)
        self._per = 4 if fenced else 1  # replies per key
        self.commands: list[tuple[bytes, ...]] = [
            command for k, t in zip(keys, tokens, strict=True) for command in _acquire.commands(k, t, ttl_ms, fenced)
        ]
        self.commands += wait
        self.shapes = (_TRANSACTION_REPLY if fenced else _SET_REPLY) * self._n + [is_count] * len(wait)
        self.frame = not fenced  # EXEC's reply frames the write; bare SETs do not
        self.results: list[int] = []
        # MULTI's error reply when it was refused alone: this server takes no transaction
        # from us, and every later acquire goes by script.
        self.refused: ReplyError | None = None
        self._waits: list[int] = []

    def read(self, replies: list[Any]) -> list[int]:
        """The transactions' replies: the indices of the keys that go by script next. The
        first error reply is raised, to be treated as a script's (transient, NOAUTH...)."""
        per = self._per
        fours = [replies[per * i : per * i + per] for i in range(self._n)]
        # Noted before any error is raised: the next acquire goes by script.
        self.refused = next((four[0] for four in fours if _acquire.refused_multi(four, ReplyError)), None)
        rest: list[int] = []
        for i, four in enumerate(fours):
            result = _acquire.read(four, ReplyError)
            if isinstance(result, BaseException):
                raise result
            self.results.append(result)
            if result == _acquire.SCRIPT:
                rest.append(i)
        waits = replies[per * self._n :]
        _raise_first(waits)
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


class _Decided:
    """What the earlier tries of one call decided of its batch, kept so that a try after
    an error reply to some of its calls (transient, NOAUTH: they did not run) sends only
    those again, never a call that ran (a release run twice says False for the key it
    freed), as the C client does. ``replies`` by index; ``waits``: the WAIT replies of the
    tries that decided any (the fewest confirms them all)."""

    __slots__ = ("replies", "waits")

    def __init__(self) -> None:
        self.replies: dict[int, Any] = {}
        self.waits: list[int] = []

    def todo(self, n: int) -> list[int]:
        """The indices of the calls (of ``n``) still to send."""
        return [i for i in range(n) if i not in self.replies]

    def keep(self, todo: list[int], replies: list[Any]) -> bool:
        """Note the replies to ``todo`` that are not error replies; whether there was one."""
        kept = False
        for i, reply in zip(todo, replies, strict=True):
            if not isinstance(reply, ReplyError):
                self.replies[i] = reply
                kept = True
        return kept


def _raise_first(replies: list[Any]) -> None:
    for reply in replies:
        if isinstance(reply, ReplyError):
            raise reply


def _by_transaction(dialect: Dialect, script: Script, tokens: Sequence[bytes]) -> bool:
    """Whether an acquire with ``script`` of these tokens goes as the transaction: only the
    ACQUIRE script itself (the waiting forms are the contended path), and only plain
    locks (a permit's ask, token '#' limit, always goes by script)."""
    return script is ACQUIRE and dialect.transaction and all(len(t) == TOKEN_BYTES for t in tokens)


# -- one call's rules -------------------------------------------------------------------------


class Exchange(Detected):
    """What a single-server backend sends for each call, and what it makes of the replies,
    as steps (see the module docstring). A backend is an Exchange, and its methods run
    ``*_steps`` generators through its driver.

    ``clock`` is the caller's (time.monotonic, or the event loop's time): budgets handed in
    (``until``) are on it."""

    clock: Callable[[], float] = time.monotonic

    def __init__(self, config: ServerConfig) -> None:
        self.server = config.display  # as errors name it
        self._timeout = config.timeout  # the reply timeout, in seconds
        self._wait_replicas = config.wait_replicas  # 0: no WAIT
        self._wait_ms = round(config.wait_timeout * 1000)
        self._transactions = True  # False once this server refused MULTI: acquires go by script

    # -- the calls ------------------------------------------------------------------------

    def acquire_steps(
        self,
        what: str,
        keys: list[bytes],
        tokens: list[bytes],
        ttl_ms: int,
        script: Script = ACQUIRE,
        until: float | None = None,
    ) -> Steps[list[int]]:
        """Each key's acquire result (a fence > 0, or the script's refusal); resent once
        after a lost reply, with the same tokens, within ``until``. Under wait_replicas the
        acquires too few replicas confirmed are undone: CacheError."""
        key = keys[0] if len(keys) == 1 else None
        results, waits = yield from self._call(
            what, key, lambda limit: self._take(script, keys, tokens, ttl_ms, limit), True, until
        )
        if waits and waits[0] < self._wait_replicas:
            held = [(k, held_value(t, r)) for k, t, r in zip(keys, tokens, results, strict=True) if r > 0]
            # If the undo fails too, the keys expire by their TTL; the caller hears about the replicas.
            yield from self._release_quietly(held)
            raise cache_error(unreplicated(what, waits[0], self._wait_replicas, self._wait_ms), self.server, key)
        return results

    def extend_steps(self, what: str, keys: list[bytes], tokens: list[bytes], ttl_ms: int) -> Steps[list[bool]]:
        """Each key's extend: True when it still held this value (now with the new TTL).
        Not resent after a lost reply: that is a CacheError, and the caller retries while
        the lease lasts. Under wait_replicas, Unreplicated when too few replicas confirmed
        the extends that ran (those keys are released: their leases are lost)."""
        key = keys[0] if len(keys) == 1 else None
        ms = b"%d" % ttl_ms
        # Under wait_replicas by script: it takes a waiter's mark and permits as they are,
        # so one write carries every extend and the one WAIT behind them.
        if self.dialect.lua_free and not by_script(tokens) and not self._wait_replicas:
            sets = [extend_command(k, t, ttl_ms) for k, t in zip(keys, tokens, strict=True)]
            decided = _Decided()
            done = yield from self._call(what, key, lambda limit: self._lua_free(sets, is_ok_or_nil, limit, decided))
            # SET IFEQ compares the whole value: one a waiter marked ('+') is extended by
            # the script, which accepts the mark (only under contention, or when lost).
            return (yield from self._missed(what, key, done, EXTEND, keys, tokens, (ms,), False))
        calls = [(k, t, ms) for k, t in zip(keys, tokens, strict=True)]
        wait = self._wait_command(EXTEND)
        decided = _Decided()
        replies = yield from self._call(what, key, lambda limit: self._scripts(EXTEND, calls, limit, wait, decided))
        results = [bool(r) for r in replies[: len(calls)]]
        if wait and replies[-1] < self._wait_replicas and any(results):
            # If the release fails too, the keys expire by their TTL; the leases are lost either way.
            yield from self._release_quietly([(k, t) for k, t, ok in zip(keys, tokens, results, strict=True) if ok])
            raise unconfirmed_extends(what, results, replies[-1], self._wait_replicas, self._wait_ms)
        return results

    def release_steps(self, what: str, keys: list[bytes], tokens: list[bytes]) -> Steps[list[bool]]:
        """Each key's release: True when it held this value. A lost reply is resent: the
        second try finds the key gone (False) or still ours (releases it)."""
        key = keys[0] if len(keys) == 1 else None
        if self.dialect.lua_free and not by_script(tokens):
            dels = [release_command(self.dialect, k, t) for k, t in zip(keys, tokens, strict=True)]
            decided = _Decided()
            done = yield from self._call(what, key, lambda limit: self._lua_free(dels, is_flag, limit, decided), True)
            # DELIFEQ/DELEX compare the whole value: one a waiter marked ('+') is released
            # by the script, which accepts the mark and wakes the waiter (only under
            # contention, or when the lock was lost anyway).
            return (yield from self._missed(what, key, done, RELEASE, keys, tokens, (), True))
        calls = [(k, t) for k, t in zip(keys, tokens, strict=True)]
        decided = _Decided()
        replies = yield from self._call(
            what, key, lambda limit: self._scripts(RELEASE, calls, limit, None, decided), True
        )
        return [bool(r) for r in replies]

    def command_steps(
        self,
        what: str,
        key: bytes | None,
        command: tuple[bytes, ...],
        shape: Shape,
        resend: bool = False,
        declined: Callable[[ReplyError], bool] | None = None,
    ) -> Steps[Any]:
        """One plain command's reply (SET NX, INCRBY, INFO, COMMAND INFO), or None for an
        error reply ``declined`` says the caller does without (NOPERM on INFO, say); any
        other error reply is the call's CacheError. Never resend INCRBY or SET NX after a
        lost reply: a resent INCRBY counts twice, a resent SET NX answers "not set" for the
        value this call set."""

        def once(limit: float | None) -> Steps[Any]:
            (reply,) = yield Send([command], [shape], limit)
            if isinstance(reply, ReplyError):
                if declined is not None and not retires(reply) and declined(reply):
                    return None
                raise reply
            return reply

        return (yield from self._call(what, key, once, resend))

    def load_steps(self) -> Steps[None]:
        """Every script loaded, in one round trip (loading twice changes nothing: a lost
        reply is resent)."""

        def once(limit: float | None) -> Steps[None]:
            _raise_first((yield Send(_LOADS, _LOADED, limit)))

        yield from self._call("SCRIPT LOAD", None, once, True)

    def retry_until(self, wait_ms: int = 0) -> float:
        """Until when a call begun now may be resent (hotlock._transient.resend_until)."""
        return resend_until(self.clock(), wait_ms / 1000.0, self._timeout)

    # -- the rules ------------------------------------------------------------------------

    def _call(
        self,
        what: str,
        key: bytes | None,
        attempt: Callable[[float | None], Steps[T]],
        resend: bool = False,
        until: float | None = None,
    ) -> Steps[T]:
        """Run ``attempt`` (given a reply-timeout override: None, or what is left of the
        budget) under the lost-reply and transient-reply rules, until it returns; every
        failure ends as the call's CacheError. ``until`` is the budget's end (by default a
        call that does not wait: resend_until with no wait, from now: the budget runs from
        the call's start, as the C client's does, not from its first failure)."""
        clock = self.clock
        until = self.retry_until() if until is None else until
        limit: float | None = None
        lost = False  # the one retry after a lost reply has been used
        transient = Retrying()
        while True:
            try:
                return (yield from attempt(limit))
            except ReplyError as reply:
                if is_auth_refusal(reply.code):
                    # NOAUTH/WRONGPASS on a live connection (retired: retires()): nothing
                    # ran, and the new connection asks the credential provider again.
                    failure: Failure | ReplyError = NotSent(f"the server replied {reply}")
                elif reply.code in TRANSIENT:
                    # The command did not run: resent on a fresh connection (retires())
                    # after a pause, while the call's own timeout lasts.
                    pause = transient.pause(until - self._timeout - clock())
                    if pause is None:
                        raise self._error(tried(what, lost, transient), key, f"the server replied {reply}") from reply
                    yield Pause(pause)
                    limit = max(min(self._timeout, until - clock()), 0.001)
                    continue
                else:
                    raise self._error(tried(what, lost, transient), key, f"the server replied {reply}") from reply
            except Failure as exc:
                failure = exc
            if not isinstance(failure, Lost | NotSent) or lost or not (resend or isinstance(failure, NotSent)):
                raise self._error(tried(what, lost, transient), key, str(failure)) from failure
            left = min(self._timeout, until - clock())
            if left < 0.001:
                raise self._error(tried(what, lost, transient), key, str(failure)) from failure
            lost = True
            limit = left

    def _error(self, what: str, key: bytes | None, why: str) -> CacheError:
        return cache_error(f"{what} failed: {why}", self.server, key)

    def _take(
        self, script: Script, keys: list[bytes], tokens: list[bytes], ttl_ms: int, limit: float | None
    ) -> Steps[tuple[list[int], list[int]]]:
        """One try of the acquires (a lost reply resends it whole, with the same tokens):
        each key's result, and WAIT's reply under wait_replicas. By transaction where it
        serves, the keys it leaves to the script in a second round trip, within the same
        ``limit``."""
        wait = self._wait_command(script)
        if not (self._transactions and _by_transaction(self.dialect, script, tokens)):
            return (yield from self._by_script(script, keys, tokens, ttl_ms, limit, wait))
        deadline = None if limit is None else self.clock() + limit
        taking = Transaction(keys, tokens, ttl_ms, wait, self.fenced)
        try:
            rest = taking.read((yield Send(taking.commands, taking.shapes, limit, taking.frame)))
        finally:
            if taking.refused is not None and self._transactions:
                self._transactions = False
                _acquire.warn_refused(self.server, taking.refused)
        if rest:
            left = None if deadline is None else max(deadline - self.clock(), 0.001)
            ks, ts = [keys[i] for i in rest], [tokens[i] for i in rest]
            taking.scripted(rest, *(yield from self._by_script(ACQUIRE, ks, ts, ttl_ms, left, wait)))
        return taking.outcome()

    def _by_script(
        self,
        script: Script,
        keys: list[bytes],
        tokens: list[bytes],
        ttl_ms: int,
        limit: float | None,
        wait: list[tuple[bytes, ...]],
    ) -> Steps[tuple[list[int], list[int]]]:
        """The acquires as ``script``, in one round trip: each key's result, and WAIT's reply."""
        ms = b"%d" % ttl_ms
        replies = yield from self._scripts(script, [(k, t, ms) for k, t in zip(keys, tokens, strict=True)], limit, wait)
        return replies[: len(keys)], replies[len(keys) :]

    def _scripts(
        self,
        script: Script,
        calls: Sequence[tuple[bytes, ...]],
        limit: float | None,
        wait: list[tuple[bytes, ...]] | None = None,
        decided: _Decided | None = None,
    ) -> Steps[list[Any]]:
        """EVALSHA ``script`` once per (key, *args) in ``calls``, ``wait`` behind them, in
        one round trip; after NOSCRIPT the script is loaded and only the calls that did not
        run go again, the WAIT behind them, in one more. The first error reply is raised.
        ``decided``: what the earlier tries of this call decided, not sent again."""
        wait = wait or []
        decided = _Decided() if decided is None else decided
        todo = decided.todo(len(calls))
        n = len(todo)
        commands = [(b"EVALSHA", script.sha, b"1", *calls[i]) for i in todo] + wait
        shapes = [_SCRIPT_REPLY[script]] * n + [is_count] * len(wait)
        replies: list[Any] = yield Send(commands, shapes, limit)
        missing = [i for i, r in enumerate(replies[:n]) if isinstance(r, ReplyError) and r.code == "NOSCRIPT"]
        if missing:
            # Restart, SCRIPT FLUSH or failover emptied the script cache: every script
            # loaded (one reload per flush, whichever call meets it first), then what did
            # not run, in the same write.
            loads = len(_LOADS)
            again = [*_LOADS, *(commands[i] for i in missing), *wait]
            replies_again = yield Send(again, [*_LOADED, *(shapes[i] for i in missing), *shapes[n:]], limit)
            _raise_first(replies_again[:loads])
            resent(replies, missing, replies_again[loads:], n)
        if decided.keep(todo, replies[:n]):
            decided.waits += [w for w in replies[n:] if not isinstance(w, ReplyError)]
        _raise_first(replies)
        return [decided.replies[i] for i in range(len(calls))] + (
            [min(decided.waits)] if wait and decided.waits else replies[n:]
        )

    def _lua_free(
        self, commands: list[tuple[bytes, ...]], shape: Shape, limit: float | None, decided: _Decided
    ) -> Steps[list[bool]]:
        """The Lua-free extends or releases, in one round trip: each done (True) or to go
        by script (False: missed, or refused as _dialect.script_serves says). Another error
        reply is raised. ``decided``: what the earlier tries of this call decided, not sent again."""
        todo = decided.todo(len(commands))
        replies = yield Send([commands[i] for i in todo], [shape] * len(todo), limit)
        for i, reply in zip(todo, replies, strict=True):
            if not isinstance(reply, ReplyError):
                decided.replies[i] = reply == b"OK" or reply == 1
            elif script_serves(str(reply)):
                decided.replies[i] = False  # to go by script
        _raise_first([r for r in replies if not (isinstance(r, ReplyError) and script_serves(str(r)))])
        return [decided.replies[i] for i in range(len(commands))]

    def _missed(
        self,
        what: str,
        key: bytes | None,
        done: list[bool],
        script: Script,
        keys: list[bytes],
        tokens: list[bytes],
        args: tuple[bytes, ...],
        resend: bool,
    ) -> Steps[list[bool]]:
        """After a Lua-free batch: what it did not do once more by ``script``."""
        missed = [i for i, ok in enumerate(done) if not ok]
        if missed:
            calls = [(keys[i], tokens[i], *args) for i in missed]
            decided = _Decided()
            again = yield from self._call(
                what, key, lambda limit: self._scripts(script, calls, limit, None, decided), resend
            )
            for i, reply in zip(missed, again, strict=True):
                done[i] = bool(reply)
        return done

    def _wait_command(self, script: Script) -> list[tuple[bytes, ...]]:
        # WAIT confirms the writes made earlier *on its own connection*, so it rides in the
        # same write as the acquires or extends it confirms: no extra round trip, no other
        # connection.
        if self._wait_replicas and script in CONFIRMED:
            return [(b"WAIT", b"%d" % self._wait_replicas, b"%d" % self._wait_ms)]
        return []

    def _release_quietly(self, held: list[tuple[bytes, bytes]]) -> Steps[None]:
        """Release ``held`` (key, held value) pairs after a WAIT fell short; a failure is
        dropped: the keys then expire by their TTL."""
        if held:
            with contextlib.suppress(CacheError):
                yield from self.release_steps("undo", [k for k, _ in held], [v for _, v in held])


def no_permission(reply: ReplyError) -> bool:
    """INFO refused by an ACL without it: the caller does without (command_steps' ``declined``)."""
    return reply.code == "NOPERM"


def any_refusal(reply: ReplyError) -> bool:
    """COMMAND INFO refused (NOPERM, a proxy without COMMAND): the version decides."""
    return True


def _loaded(script: Script) -> Shape:
    """SCRIPT LOAD's reply for ``script``: its SHA1."""
    return lambda reply: reply == script.sha


_LOADS: list[tuple[bytes, ...]] = [(b"SCRIPT", b"LOAD", s.source) for s in SCRIPTS]
_LOADED: list[Shape] = [_loaded(s) for s in SCRIPTS]


class Running(Generic[T]):
    """A call's steps as a driver carries them out: ``for step in running`` gives each
    step, the driver hands back each one's outcome (``took``: a Send's replies, None after
    a Pause) or the Failure that lost a Send's replies (``failed``), and ``result`` holds
    the call's result once the loop ends. The sync and async drivers differ only in
    whether they await."""

    __slots__ = ("_given", "_resume", "_steps", "result")

    def __init__(self, steps: Steps[T]) -> None:
        self._steps = steps
        self._resume: Callable[[Any], Send | Pause] = steps.send
        self._given: Any = None
        self.result: T

    def __iter__(self) -> Running[T]:
        return self

    def __next__(self) -> Send | Pause:
        resume, given = self._resume, self._given
        self._resume, self._given = self._steps.send, None
        try:
            return resume(given)
        except StopIteration as done:
            self.result = done.value
            raise StopIteration from None

    def took(self, outcome: Any) -> None:
        self._given = outcome

    def failed(self, failure: Failure) -> None:
        self._resume, self._given = self._steps.throw, failure


def _sleep(seconds: float) -> Any:
    time.sleep(seconds)
    return None  # a Pause's outcome


def drive(steps: Steps[T], carry: Callable[[Send], list[Any]]) -> T:
    """Carry ``steps`` out on a blocking transport: ``carry`` writes a Send and returns its
    replies, or raises the Failure that lost them."""
    running = Running(steps)
    for step in running:
        try:
            running.took(_sleep(step.seconds) if isinstance(step, Pause) else carry(step))
        except Failure as failure:
            running.failed(failure)
    return running.result


async def _pause(seconds: float) -> Any:
    await asyncio.sleep(seconds)
    return None  # a Pause's outcome


async def drive_async(steps: Steps[T], carry: Callable[[Send], Awaitable[list[Any]]]) -> T:
    """Carry ``steps`` out on an asyncio transport: ``carry`` writes a
    Send and returns its replies, or raises the Failure that lost them."""
    running = Running(steps)
    for step in running:
        try:
            running.took(await (_pause(step.seconds) if isinstance(step, Pause) else carry(step)))
        except Failure as failure:
            running.failed(failure)
    return running.result
