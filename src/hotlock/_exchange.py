"""One call's protocol rules on one server, with no I/O: the steps a transport carries out
(send these commands, pause) and what each reply makes of the call.

Every call of a single-server Python backend (redis-py sync and async, the extension's
asyncio client) is a generator of steps written here once, and the backend only carries
them out: it writes a ``Send``'s commands on one connection and sends the replies back in
(error replies in place, as ``ReplyError``), or throws in the ``Failure`` that lost them
(or the ``ReplyError`` a new connection's handshake got in their place: none of them ran);
it sleeps a ``Pause``. The generator's return value is the call's result; a ``CacheError``
(or ``Unreplicated``) it raises is the call's error. The sync drivers loop with
``generator.send``, the async ones await the same steps.

The rules, in the order a reply meets them (docs/architecture.md tells why each is safe).
They are written once, for one server's calls here and for a cluster's in its Route
(hotlock.backends.cluster), which takes from here what a failure and each error reply
make of a call (``Tries``, ``after``, ``lua_free_done``, ``LOADS``):

- A lost reply (``Lost``: a timeout, a dropped connection) is resent once, with the same
  token, for the calls that may be resent (an acquire, a release), within what is left of
  the call's budget (``hotlock._transient.resend_until``). Nothing of the call ran
  (``NotSent``: a connect that failed, a handshake that lost its reply): any call goes
  once more. NOAUTH/WRONGPASS on a live connection (rotated credentials): the call goes
  once more on a new connection, which asks the credential provider again.
- A transient error reply (``hotlock._transient``: the command did not run) is resent,
  whatever the command, after a jittered pause, until the pauses would pass the call's own
  timeout; of a batch, only the calls that got one (a release that ran, sent again, would
  say False for the key it freed).
- NOSCRIPT (a restart, SCRIPT FLUSH, a failover emptied the script cache): every script is
  loaded and only the calls that did not run are sent again, in one write.
- The transaction acquire (``hotlock._acquire``): the keys it leaves to the ACQUIRE script
  go next by script; a MULTI refused alone sends every later acquire by script.
- The Lua-free extend and release (SET IFEQ, DELIFEQ, DELEX): what they missed (a waiter's
  mark, a lost lock) goes once more by script, and so does a key they are refused on (OOM,
  WRONGTYPE: ``_dialect.script_serves``).
- Under wait_replicas a WAIT rides behind the acquires and extends on their connection; an
  acquire too few replicas confirmed is undone (CacheError), an extend's lease is lost
  (``Unreplicated``), and the keys are released.

A transport may write a call's first Send its own faster way (the extension's asyncio
client: one C call for the common one-key acquire, extend and release) and hand the steps
that Send's outcome when it does not settle the call (``Running.carried``); the steps go on
as if they had sent it.

The extension's sync client keeps its own copy of these rules in C (ext/_sync.pxi), where
the hot path cannot afford a generator: tests/unit/test_exchange.py holds the rules here to
their cases by a scripted transport and a fake clock, and tests/test_exchange_parity.py
feeds the C client and this core the same scripted server and asks for the same outcome.
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import time
from collections.abc import Awaitable, Callable, Generator, Sequence
from typing import TYPE_CHECKING, Any, Final, Generic, TypeVar

from . import _acquire
from ._credentials import is_auth_refusal
from ._dialect import (
    COMMAND_PROBE,
    Detected,
    Dialect,
    by_script,
    extend_command,
    info_fields,
    release_command,
    script_serves,
)
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
    "LOADS",
    "After",
    "Decided",
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
    "Tries",
    "after",
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
    "lua_free_done",
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
    """Nothing of the commands ran: the connection could not be made, or its handshake
    lost its reply."""


def retires(reply: ReplyError) -> int:
    """What an error reply does to the connection it came on: 0 nothing; 1 it takes no
    other command (a transient reply: the resend goes on a fresh connection, the host
    resolved again; NOAUTH: it is not authenticated any more); 2 neither does any other
    connection of the cache to that server (READONLY: the endpoint reaches a replica now)."""
    if reply.code == "READONLY":
        return 2
    return 1 if after(reply) in (After.PAUSE, After.REAUTH) else 0


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
# (Transaction.frame): each EXEC's reply, a pair beginning with SET's OK or nil, is of a
# shape no other reply of theirs has, so a shift before it shows in its place.
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
    """EXEC's: SET's reply (OK, or nil: the key exists) and TIME's. A clock of another
    shape is hotlock._acquire.read's to judge (the script decides the key), as the C
    client and a cluster's Route judge it."""
    return type(reply) is list and len(reply) == 2 and is_ok_or_nil(reply[0])


_TRANSACTION_REPLY: list[Shape] = [_is_ok, _is_queued_set, _is_queued_time, _is_exec]
_SET_REPLY: list[Shape] = [is_ok_or_nil]  # connect(fences=False): SET NX PX alone


class Transaction(Send):
    """The acquires of some keys by hotlock._acquire's transaction, as the Send of them,
    and what the replies say.

    ``commands`` go in one write (every key's transaction, then ``wait``: the WAIT of
    wait_replicas, which confirms the SETs before it on its connection); ``read`` takes the
    replies, keeps the fences of the keys taken, and names the keys the ACQUIRE script is
    to decide. Under connect(fences=False) each key's transaction is SET NX PX alone (one
    reply).

    A transport that reads a transaction's replies itself (the extension's asyncio client,
    in C by hotlock._acquire's rules: AioCore.acquire_many) may write this Send from
    ``keys``, ``tokens``, ``ttl_ms``, ``fenced`` and ``wait`` and send back a Decided."""

    __slots__ = ("_n", "_per", "fenced", "keys", "refused", "tokens", "ttl_ms", "wait")

    def __init__(
        self,
        keys: list[bytes],
        tokens: list[bytes],
        ttl_ms: int,
        wait: list[tuple[bytes, ...]],
        fenced: bool,
        timeout: float | None,
    ) -> None:
        self.keys, self.tokens, self.ttl_ms, self.wait, self.fenced = keys, tokens, ttl_ms, wait, fenced
        self._n = len(keys)
        self._per = 4 if fenced else 1  # replies per key
        commands: list[tuple[bytes, ...]] = [
            command for k, t in zip(keys, tokens, strict=True) for command in _acquire.commands(k, t, ttl_ms, fenced)
        ]
        shapes = (_TRANSACTION_REPLY if fenced else _SET_REPLY) * self._n + [is_count] * len(wait)
        # EXEC's reply frames the write; bare SETs do not.
        super().__init__(commands + wait, shapes, timeout, not fenced)
        # MULTI's error reply when it was refused alone: this server takes no transaction
        # from us, and every later acquire goes by script.
        self.refused: ReplyError | None = None

    def read(self, replies: list[Any], kept: _Kept, todo: list[int]) -> list[int]:
        """The transactions' replies (or a Decided), for the calls ``todo`` of the batch
        (their indices in it, in the order of ``keys``): each key taken is kept (``kept``,
        by that index, with this WAIT's reply), and the keys the script is to decide
        returned (their places in ``keys``). Then the first error reply is raised, to be
        treated as a script's (transient, NOAUTH...): the keys it came to go again, the
        ones taken do not."""
        n = self._n
        answers: list[int | BaseException]
        if type(replies) is Decided:
            answers = replies[:n]
            self.refused = replies.refused
        else:
            per = self._per
            fours = [replies[per * i : per * i + per] for i in range(n)]
            # Noted before any error is raised: the next acquire goes by script.
            self.refused = next((four[0] for four in fours if _acquire.refused_multi(four, ReplyError)), None)
            answers = [_acquire.read(four, ReplyError) for four in fours]
        rest: list[int] = []
        errors: list[Any] = []
        failed: list[bytes] = []  # the keys of ``errors``
        for i, result in enumerate(answers):
            if isinstance(result, BaseException):
                errors.append(result)
                failed.append(self.keys[i])
            elif result <= _acquire.SCRIPT:  # a Decided's -1 too: MULTI refused alone
                rest.append(i)
            else:
                kept.replies[todo[i]] = result
        waits = replies[len(replies) - len(self.wait) :]
        _raise_first(waits)
        if len(rest) + len(errors) < n:
            # A key was taken: this WAIT confirms it. One that took nothing confirms
            # nothing of ours (the script's own WAIT covers the keys it decides, and a
            # SET run outside a refused MULTI too: the script writes after it).
            kept.waits += waits
        _raise_first(errors, failed)
        return rest


class _Kept:
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
        return [i for i in range(n) if i not in self.replies] if self.replies else list(range(n))

    def keep(self, todo: list[int], replies: list[Any]) -> bool:
        """Note the replies to ``todo`` that are not error replies; whether there was one."""
        kept = False
        for i, reply in zip(todo, replies, strict=True):
            if not isinstance(reply, ReplyError):
                self.replies[i] = reply
                kept = True
        return kept


class Decided(list[Any]):
    """A Transaction's replies as a transport that reads them itself sends them back: each
    key's answer (the fence, SCRIPT, -1 for SCRIPT after a MULTI refused alone, or the
    error reply), then the replies to its ``wait``; ``refused``: the MULTI refusal, as a
    ReplyError, when an answer is -1."""

    __slots__ = ("refused",)

    def __init__(self, replies: list[Any], refused: ReplyError | None) -> None:
        super().__init__(replies)
        self.refused = refused


def _raise_first(replies: list[Any], keys: Sequence[bytes] = ()) -> None:
    """The first error reply raised, with the key of the call it came to (``keys``, in
    the replies' order; none for a WAIT's or a load's)."""
    for i, reply in enumerate(replies):
        if isinstance(reply, ReplyError):
            if i < len(keys):
                reply.key = keys[i]
            raise reply


def _by_transaction(dialect: Dialect, script: Script, tokens: Sequence[bytes]) -> bool:
    """Whether an acquire with ``script`` of these tokens goes as the transaction: only the
    ACQUIRE script itself (the waiting forms are the contended path), and only plain
    locks (a permit's ask, token '#' limit, always goes by script)."""
    return script is ACQUIRE and dialect.transaction and all(len(t) == TOKEN_BYTES for t in tokens)


# -- what a failure or an error reply makes of a call --------------------------------------
# The same on every Python path: one server's Exchange (below) and a cluster's Route
# (hotlock.backends.cluster), which sends a call's commands to many nodes, round after
# round, and meets the same replies.


class After(enum.Enum):
    """What an error reply makes of the call it came to (``after``)."""

    FAIL = "fail"  # the call's CacheError, naming the reply
    PAUSE = "pause"  # transient (hotlock._transient): it did not run; resent after a pause
    REAUTH = "reauth"  # NOAUTH/WRONGPASS: it did not run; resent on a new connection
    RELOAD = "reload"  # NOSCRIPT: every script loaded and what did not run resent, in one write
    REDIRECT = "redirect"  # MOVED/ASK: a cluster's slot is served elsewhere (one server: FAIL)


def after(reply: ReplyError) -> After:
    """What ``reply`` makes of the call it came to, by its code alone."""
    code = reply.code
    if code in TRANSIENT:
        return After.PAUSE
    if is_auth_refusal(code):
        return After.REAUTH
    if code == "NOSCRIPT":
        return After.RELOAD
    if code in ("MOVED", "ASK"):
        return After.REDIRECT
    return After.FAIL


class Tries:
    """One call's resends, all within its budget (``until``, on ``clock``: by default
    resend_until from now, so the budget runs from the call's start, as the C client's
    does, not from its first failure):

    - one resend, shared by every round trip of the call: after a lost reply (the
      commands may have run) only of a call that may be sent twice (an acquire with its
      own token, a release); after a failure where nothing ran (no connection, a lost
      handshake), of any call;
    - one new connection per node after NOAUTH/WRONGPASS (``reauthed``: the nodes that
      had it; one server's node is None), whatever the call;
    - resends after transient replies, each after a jittered pause, until the pauses would
      pass the call's own timeout (the budget less the one reply timeout kept for the last
      try).

    Each ``after_*`` returns the reply timeout of the resend (what is left of the budget,
    at most one reply timeout), or the pause before it, or None: the call fails, and
    ``words()`` names it as its error does."""

    __slots__ = ("_clock", "_timeout", "reauthed", "resent", "transient", "until", "what")

    def __init__(self, what: str, timeout: float, clock: Callable[[], float], until: float | None = None) -> None:
        self.what = what
        self._timeout = timeout
        self._clock = clock
        self.until = resend_until(clock(), 0.0, timeout) if until is None else until
        self.resent = False  # the one resend has been used
        self.reauthed: set[object] = set()
        self.transient = Retrying()

    def left(self) -> float | None:
        """What is left of the budget, at most one reply timeout; None under 1 ms."""
        left = min(self._timeout, self.until - self._clock())
        return left if left >= 0.001 else None

    def after_lost(self, resend: bool) -> float | None:
        return self._resend() if resend else None

    def after_unsent(self) -> float | None:
        return self._resend()

    def _resend(self) -> float | None:
        left = None if self.resent else self.left()
        self.resent = self.resent or left is not None
        return left

    def after_transient(self) -> float | None:
        return self.transient.pause(self.until - self._timeout - self._clock())

    def words(self) -> str:
        return tried(self.what, self.resent, self.transient)


def lua_free_done(reply: Any) -> bool | None:
    """A Lua-free extend's or release's reply (SET IFEQ's OK or nil, DELIFEQ's or DELEX's 1
    or 0, or an error reply): True when it did the work; False when the key goes once more
    by script (these compare the whole value, so they miss a waiter's mark ('+') and a
    lost lock, which the script tells apart; and a key they are refused on as
    _dialect.script_serves says); None for an error reply the call's other rules take."""
    if not isinstance(reply, ReplyError):
        return bool(reply == b"OK" or reply == 1)
    return False if script_serves(str(reply)) else None


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
        kept = _Kept()
        yield from self._call(
            what, key, lambda limit: self._take(script, keys, tokens, ttl_ms, limit, kept), True, until
        )
        results: list[int] = [kept.replies[i] for i in range(len(keys))]
        got = min(kept.waits, default=self._wait_replicas)  # the fewest replicas a WAIT confirmed
        if got < self._wait_replicas:
            held = [(k, held_value(t, r)) for k, t, r in zip(keys, tokens, results, strict=True) if r > 0]
            # If the undo fails too, the keys expire by their TTL; the caller hears about the replicas.
            yield from self._release_quietly(held)
            raise cache_error(unreplicated(what, got, self._wait_replicas, self._wait_ms), self.server, key)
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
            kept = _Kept()
            done = yield from self._call(what, key, lambda limit: self._lua_free(sets, is_ok_or_nil, limit, kept))
            # SET IFEQ compares the whole value: one a waiter marked ('+') is extended by
            # the script, which accepts the mark (only under contention, or when lost).
            return (yield from self._missed(what, key, done, EXTEND, keys, tokens, (ms,), False))
        calls = [(k, t, ms) for k, t in zip(keys, tokens, strict=True)]
        wait = self._wait_command(EXTEND)
        kept = _Kept()
        replies = yield from self._call(what, key, lambda limit: self._scripts(EXTEND, calls, limit, wait, kept))
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
            kept = _Kept()
            done = yield from self._call(what, key, lambda limit: self._lua_free(dels, is_flag, limit, kept), True)
            # DELIFEQ/DELEX compare the whole value: one a waiter marked ('+') is released
            # by the script, which accepts the mark and wakes the waiter (only under
            # contention, or when the lock was lost anyway).
            return (yield from self._missed(what, key, done, RELEASE, keys, tokens, (), True))
        calls = [(k, t) for k, t in zip(keys, tokens, strict=True)]
        kept = _Kept()
        replies = yield from self._call(what, key, lambda limit: self._scripts(RELEASE, calls, limit, None, kept), True)
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

    def set_nx_steps(self, key: bytes, value: bytes, ttl_ms: int) -> Steps[bool]:
        """Whether SET NX set ``value`` (never resent after a lost reply: command_steps)."""
        command = (b"SET", key, value, b"NX", b"PX", b"%d" % ttl_ms)
        return (yield from self.command_steps("set_nx", key, command, is_ok_or_nil)) is not None

    def incr_steps(self, key: bytes, amount: int) -> Steps[int]:
        reply: int = yield from self.command_steps("incr", key, (b"INCRBY", key, b"%d" % amount), is_int)
        return reply

    def info_steps(self) -> Steps[dict[str, str] | None]:
        """INFO's fields, or None when an ACL refuses INFO."""
        reply = yield from self.command_steps("INFO", None, (b"INFO",), is_text, declined=no_permission)
        return None if reply is None else info_fields(reply)

    def command_info_steps(self) -> Steps[list[Any] | None]:
        """COMMAND INFO DELIFEQ DELEX's reply, or None when the server or its ACL refuses it."""
        reply = yield from self.command_steps("COMMAND INFO", None, COMMAND_PROBE, is_anything, declined=any_refusal)
        return reply if isinstance(reply, list) else None

    def load_steps(self) -> Steps[None]:
        """Every script loaded, in one round trip (loading twice changes nothing: a lost
        reply is resent)."""

        def once(limit: float | None) -> Steps[None]:
            _raise_first((yield Send(LOADS, _LOADED, limit)))

        yield from self._call("SCRIPT LOAD", None, once, True)

    def connect_steps(self) -> Steps[None]:
        """A connection made, for a transport whose handshake is a round trip of its own
        (the extension's asyncio client: AUTH, SELECT and the script loads in one write): a
        Send of no commands, under the rules of any call (a handshake that lost its reply
        is NotSent, one that got a transient reply goes again after a pause)."""

        def once(limit: float | None) -> Steps[None]:
            yield Send([], [], limit)

        yield from self._call("connect", None, once)

    # -- a transport's shortcut -----------------------------------------------------------
    # The common acquire and release are one write whose reply settles the call. A
    # transport that writes that first Send more cheaply than a driver runs the steps (the
    # extension's asyncio client: one C call, no generator) may write it itself, return
    # the result when the reply settles the call, and otherwise run the steps with that
    # Send's outcome carried in (Running.carried): they go on as if they had sent it.

    def transacts(self, script: Script, token: bytes) -> bool:
        """Whether an acquire of one key by ``script`` with ``token`` begins with the
        one-key Transaction, and ends with it when that takes the key: its fence (> 0) is
        then the result (no WAIT behind it)."""
        return (
            script is ACQUIRE
            and self._transactions
            and not self._wait_replicas
            and self.dialect.transaction
            and len(token) == TOKEN_BYTES
        )

    def release_first(self, key: bytes, token: bytes) -> tuple[bytes, ...]:
        """The one command a release of one key begins with (its reply is_flag's); a reply
        of 1 settles the release: True."""
        if self.dialect.lua_free and not by_script((token,)):
            return release_command(self.dialect, key, token)
        return (b"EVALSHA", RELEASE.sha, b"1", key, token)

    def extend_first(self, key: bytes, token: bytes, ttl_ms: int) -> Send | None:
        """The Send an extend of one key begins with, one command; a reply in its shape
        that is OK (SET IFEQ) or 1 (the script) settles the extend: True. None under
        wait_replicas: a WAIT rides behind it."""
        if self._wait_replicas:
            return None
        if self.dialect.lua_free and not by_script((token,)):
            return Send([extend_command(key, token, ttl_ms)], [is_ok_or_nil], None)
        return Send([(b"EVALSHA", EXTEND.sha, b"1", key, token, b"%d" % ttl_ms)], [is_flag], None)

    def retry_until(self, wait_ms: int = 0, since: float | None = None) -> float:
        """Until when a call begun at ``since`` (on ``clock``; None: now) may be resent
        (hotlock._transient.resend_until)."""
        return resend_until(self.clock() if since is None else since, wait_ms / 1000.0, self._timeout)

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
        budget) under the resend rules (Tries: ``resend`` says whether the call may be sent
        twice; ``until``, the budget's end), until it returns; every failure ends as the
        call's CacheError."""
        tries = Tries(what, self._timeout, self.clock, until)
        limit: float | None = None
        while True:
            try:
                return (yield from attempt(limit))
            except ReplyError as reply:
                then = after(reply)
                if then is After.PAUSE:
                    # On a fresh connection (retires()), while the call's own timeout lasts.
                    pause = tries.after_transient()
                    if pause is not None:
                        yield Pause(pause)
                        limit = tries.left() or 0.001
                        continue
                elif then is After.REAUTH and None not in tries.reauthed:
                    # The connection was retired (retires()): the new one asks the
                    # credential provider again.
                    tries.reauthed.add(None)
                    limit = tries.left()
                    if limit is not None:
                        continue
                raise self._error(tries.words(), reply.key or key, f"the server replied {reply}") from reply
            except Failure as failure:
                if isinstance(failure, Lost):
                    limit = tries.after_lost(resend)
                elif isinstance(failure, NotSent):
                    limit = tries.after_unsent()
                else:
                    limit = None
                if limit is None:
                    raise self._error(tries.words(), key, str(failure)) from failure

    def _error(self, what: str, key: bytes | None, why: str) -> CacheError:
        return cache_error(f"{what} failed: {why}", self.server, key)

    def _take(
        self,
        script: Script,
        keys: list[bytes],
        tokens: list[bytes],
        ttl_ms: int,
        limit: float | None,
        kept: _Kept,
    ) -> Steps[None]:
        """One try of the acquires ``kept`` has not decided (a lost reply resends them all,
        with the same tokens; after an error reply to some, only those go again). By
        transaction where it serves, the keys it leaves to the script in a second round
        trip, within the same ``limit``."""
        todo = kept.todo(len(keys))
        if len(todo) < len(keys):
            keys, tokens = [keys[i] for i in todo], [tokens[i] for i in todo]
        wait = self._wait_command(script)
        if self._transactions and _by_transaction(self.dialect, script, tokens):
            deadline = None if limit is None else self.clock() + limit
            taking = Transaction(keys, tokens, ttl_ms, wait, self.fenced, limit)
            try:
                rest = taking.read((yield taking), kept, todo)
            finally:
                if taking.refused is not None and self._transactions:
                    self._transactions = False
                    _acquire.warn_refused(self.server, taking.refused)
            if not rest:
                return
            keys, tokens, todo = [keys[i] for i in rest], [tokens[i] for i in rest], [todo[i] for i in rest]
            script = ACQUIRE
            limit = None if deadline is None else max(deadline - self.clock(), 0.001)
        ms = b"%d" % ttl_ms
        calls = [(k, t, ms) for k, t in zip(keys, tokens, strict=True)]
        scripted = _Kept()
        try:
            yield from self._scripts(script, calls, limit, wait, scripted)
        finally:
            for j, result in scripted.replies.items():
                kept.replies[todo[j]] = result
            kept.waits += scripted.waits

    def _scripts(
        self,
        script: Script,
        calls: Sequence[tuple[bytes, ...]],
        limit: float | None,
        wait: list[tuple[bytes, ...]] | None = None,
        kept: _Kept | None = None,
    ) -> Steps[list[Any]]:
        """EVALSHA ``script`` once per (key, *args) in ``calls``, ``wait`` behind them, in
        one round trip; after NOSCRIPT the script is loaded and only the calls that did not
        run go again, the WAIT behind them, in one more. The first error reply is raised.
        ``kept``: what the earlier tries of this call decided, not sent again."""
        wait = wait or []
        kept = _Kept() if kept is None else kept
        todo = kept.todo(len(calls))
        n = len(todo)
        commands = [(b"EVALSHA", script.sha, b"1", *calls[i]) for i in todo] + wait
        shapes = [_SCRIPT_REPLY[script]] * n + [is_count] * len(wait)
        replies: list[Any] = yield Send(commands, shapes, limit)
        missing = [i for i, r in enumerate(replies[:n]) if isinstance(r, ReplyError) and after(r) is After.RELOAD]
        if missing:
            # Restart, SCRIPT FLUSH or failover emptied the script cache: every script
            # loaded (one reload per flush, whichever call meets it first), then what did
            # not run, in the same write.
            loads = len(LOADS)
            again = [*LOADS, *(commands[i] for i in missing), *wait]
            replies_again = yield Send(again, [*_LOADED, *(shapes[i] for i in missing), *shapes[n:]], limit)
            _raise_first(replies_again[:loads])
            resent(replies, missing, replies_again[loads:], n)
        if kept.keep(todo, replies[:n]):
            kept.waits += [w for w in replies[n:] if not isinstance(w, ReplyError)]
        _raise_first(replies, [calls[i][0] for i in todo])
        return [kept.replies[i] for i in range(len(calls))] + (
            [min(kept.waits)] if wait and kept.waits else replies[n:]
        )

    def _lua_free(
        self, commands: list[tuple[bytes, ...]], shape: Shape, limit: float | None, kept: _Kept
    ) -> Steps[list[bool]]:
        """The Lua-free extends or releases, in one round trip: each done (True) or to go
        by script (False: missed, or refused as _dialect.script_serves says). Another error
        reply is raised. ``kept``: what the earlier tries of this call decided, not sent again."""
        todo = kept.todo(len(commands))
        replies = yield Send([commands[i] for i in todo], [shape] * len(todo), limit)
        unsettled, keys = [], []
        for i, reply in zip(todo, replies, strict=True):
            done = lua_free_done(reply)
            if done is None:
                unsettled.append(reply)
                keys.append(commands[i][1])
            else:
                kept.replies[i] = done  # False: to go by script
        _raise_first(unsettled, keys)
        return [kept.replies[i] for i in range(len(commands))]

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
            kept = _Kept()
            again = yield from self._call(
                what, key, lambda limit: self._scripts(script, calls, limit, None, kept), resend
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


# Every script, loaded in one write with the calls a NOSCRIPT sends again (here and in a
# cluster's Route): one reload per flush, whichever call meets it first.
LOADS: list[tuple[bytes, ...]] = [(b"SCRIPT", b"LOAD", s.source) for s in SCRIPTS]
_LOADED: list[Shape] = [_loaded(s) for s in SCRIPTS]


class Running(Generic[T]):
    """A call's steps as a driver carries them out: ``for step in running`` gives each
    step, the driver hands back each one's outcome (``took``: a Send's replies, None after
    a Pause) or the Failure that lost a Send's replies (``failed``; or a handshake's
    ReplyError), and ``result`` holds the call's result once the loop ends. The sync and
    async drivers differ only in whether they await."""

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

    def failed(self, failure: Failure | ReplyError) -> None:
        self._resume, self._given = self._steps.throw, failure

    def carried(self, outcome: Any) -> None:
        """The first step, a Send, was carried out before the steps ran (a transport's
        shortcut: Exchange.transacts, release_first, extend_first): skipped, and ``outcome`` (its
        replies, or the Failure that lost them) handed back in its place."""
        next(self)
        if isinstance(outcome, Failure | ReplyError):
            self.failed(outcome)
        else:
            self.took(outcome)


def _sleep(seconds: float) -> Any:
    time.sleep(seconds)
    return None  # a Pause's outcome


def drive(steps: Steps[T], carry: Callable[[Send], list[Any]]) -> T:
    """Carry ``steps`` out on a blocking transport: ``carry`` writes a Send and returns its
    replies, or raises the Failure that lost them (or a handshake's ReplyError)."""
    running = Running(steps)
    for step in running:
        try:
            running.took(_sleep(step.seconds) if isinstance(step, Pause) else carry(step))
        except (Failure, ReplyError) as failure:
            running.failed(failure)
    return running.result


async def _pause(seconds: float) -> Any:
    await asyncio.sleep(seconds)
    return None  # a Pause's outcome


async def drive_async(steps: Steps[T], carry: Callable[[Send], Awaitable[list[Any]]], carried: Any = None) -> T:
    """Carry ``steps`` out on an asyncio transport: ``carry`` writes a Send and returns
    its replies, or raises the Failure that lost them (or a handshake's ReplyError).
    ``carried``: the outcome of the first Send, which the transport carried out already
    (Running.carried)."""
    running = Running(steps)
    if carried is not None:
        running.carried(carried)
    for step in running:
        try:
            running.took(await (_pause(step.seconds) if isinstance(step, Pause) else carry(step)))
        except (Failure, ReplyError) as failure:
            running.failed(failure)
    return running.result
