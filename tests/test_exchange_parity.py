"""The extension's sync client (ext/_sync.pxi, which keeps its own copy of the protocol
rules in C for the hot path) held to the Python core (hotlock._exchange, as redis-py's
backend carries it out) by a differential test: the same scripted server conversation
(tests/fakeserver.py) fed to a native and to a redis-py backend must come to the same
outcome (the same result, or the same error class with the same essential words) and
send the same lock commands (the handshake, SCRIPT LOAD and redis-py's framing TIME
aside: how each transport loads scripts and checks its stream is its own business)."""

from __future__ import annotations

import logging
import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import pytest

import hotlock
from hotlock._scripts import ACQUIRE, EXTEND, RELEASE
from hotlock.errors import CacheError, Unreplicated

from .conftest import native_for_module
from .fakeserver import FakeRedis, bulk, fence_of, honest

native_for_module()  # a run that requires the extension fails without it

TIMEOUT = 0.3
TTL = 5000
K1, K2, K3 = b"parity:k1", b"parity:k2", b"parity:k3"
T1, T2, T3 = b"a" * 16, b"b" * 16, b"c" * 16

NOSCRIPT = b"-NOSCRIPT No matching script. Please use EVAL.\r\n"
LOADING = b"-LOADING Redis is loading the dataset in memory\r\n"
OOM = b"-OOM command not allowed when used memory > 'maxmemory'.\r\n"
EXECABORT = b"-EXECABORT Transaction discarded because of previous errors.\r\n"
NOAUTH = b"-NOAUTH Authentication required.\r\n"
NOW = b"*2\r\n" + bulk(b"1764582723") + bulk(b"123456")


# -- the conversations -------------------------------------------------------------------------


@dataclass(frozen=True)
class Case:
    """One conversation: ``script`` adds the fake server's rules, ``call`` runs on the
    backend; ``expect`` is the result, or (error class, the words its text must hold)."""

    script: Callable[[FakeRedis], None]
    call: Callable[[Any], object]
    expect: object
    connect: dict[str, Any] = field(default_factory=dict)
    answer: Callable[[list[bytes], dict[bytes, str]], bytes] = honest
    # The resends after transient replies: as many as the jittered pauses fit in the
    # budget, so the two paths' counts may differ (each is checked against its own text).
    jittered: bool = False
    warned: int = 0  # the WARNINGs the call logs (the refused MULTI's, once)


def _rules(*rules: tuple[tuple[bytes, ...], dict[str, Any]]) -> Callable[[FakeRedis], None]:
    def script(fake: FakeRedis) -> None:
        for match, how in rules:
            fake.on(*match, **how)

    return script


def on(*match: bytes, **how: Any) -> tuple[tuple[bytes, ...], dict[str, Any]]:
    return match, how


def always(match: tuple[bytes, ...], reply: bytes) -> Callable[[list[bytes], dict[bytes, str]], bytes]:
    """An answer that gives every command starting with ``match`` ``reply``."""

    def answer(command: list[bytes], scripts: dict[bytes, str]) -> bytes:
        if tuple(command[: len(match)]) == match:
            return reply
        return honest(command, scripts)

    return answer


def lua_free(command: list[bytes], scripts: dict[bytes, str]) -> bytes:
    """A Redis 8.4 with DELEX and SET IFEQ: extend and release go without Lua."""
    name = command[0].upper()
    if name == b"INFO":
        return bulk(b"# Server\r\nredis_version:8.4.0\r\nredis_mode:standalone\r\n")
    if name == b"COMMAND":
        return b"*2\r\n*-1\r\n*1\r\n$5\r\ndelex\r\n"  # DELIFEQ: none; DELEX: its info
    if name == b"DELEX":
        return b":1\r\n"
    return honest(command, scripts)


def acquire(backend: Any) -> object:
    return backend.acquire(K1, T1, TTL)


def extend(backend: Any) -> object:
    return backend.extend(K1, T1, TTL)


def release(backend: Any) -> object:
    return backend.release(K1, T1)


def set_nx(backend: Any) -> object:
    return backend.set_nx(K1, T1, TTL)


def incr(backend: Any) -> object:
    return backend.incr(K1, 3)


def two_acquires(backend: Any) -> object:
    return [backend.acquire(K1, T1, TTL), backend.acquire(K2, T2, TTL)]


def release_many(backend: Any) -> object:
    return backend.release_many([K1, K2, K3], [T1, T2, T3])


FENCE = fence_of(K1)
HELD_EXEC = b"*2\r\n$-1\r\n" + NOW  # SET NX found the key
SCRIPTS = {"scripts": "always"}

CASES: dict[str, Case] = {
    # NOSCRIPT: the script loaded, and only what did not run sent again.
    "noscript-acquire": Case(_rules(on(b"EVALSHA", ACQUIRE.sha, reply=NOSCRIPT)), acquire, FENCE, SCRIPTS),
    "noscript-acquire-held": Case(
        _rules(on(b"EXEC", reply=HELD_EXEC), on(b"EVALSHA", ACQUIRE.sha, reply=NOSCRIPT)), acquire, FENCE
    ),
    "noscript-extend": Case(_rules(on(b"EVALSHA", EXTEND.sha, reply=NOSCRIPT)), extend, True),
    "noscript-release": Case(_rules(on(b"EVALSHA", RELEASE.sha, reply=NOSCRIPT)), release, True),
    "noscript-release-many": Case(
        _rules(on(b"EVALSHA", RELEASE.sha, b"1", K2, reply=NOSCRIPT)), release_many, [True, True, True]
    ),
    # A transient reply, then success: resent whatever the command.
    "transient-acquire": Case(_rules(on(b"SET", reply=LOADING), on(b"EXEC", reply=EXECABORT)), acquire, FENCE),
    "transient-extend": Case(_rules(on(b"EVALSHA", EXTEND.sha, reply=LOADING)), extend, True),
    "transient-release": Case(_rules(on(b"EVALSHA", RELEASE.sha, reply=LOADING)), release, True),
    # One call of a batch refused: only it is sent again (a release that ran must not run twice).
    "transient-release-many": Case(
        _rules(on(b"EVALSHA", RELEASE.sha, b"1", K2, reply=LOADING)), release_many, [True, True, True]
    ),
    "transient-extend-many": Case(
        _rules(on(b"EVALSHA", EXTEND.sha, b"1", K2, reply=b"-BUSY Redis is busy running a script.\r\n")),
        lambda backend: backend.extend_many([K1, K2, K3], [T1, T2, T3], TTL),
        [True, True, True],
    ),
    "transient-incr": Case(_rules(on(b"INCRBY", reply=LOADING)), incr, 3),
    # A transient reply until the call's budget ends.
    "transient-forever-acquire": Case(
        _rules(),
        acquire,
        (CacheError, "acquire (retried N times within the call's timeout) failed: the server replied LOADING"),
        SCRIPTS,
        always((b"EVALSHA", ACQUIRE.sha), LOADING),
        jittered=True,
    ),
    "transient-forever-extend": Case(
        _rules(),
        extend,
        (CacheError, "extend (retried N times within the call's timeout) failed: the server replied LOADING"),
        answer=always((b"EVALSHA", EXTEND.sha), LOADING),
        jittered=True,
    ),
    # A lost reply: an acquire and a release are resent (same token), an extend, a SET NX not.
    "cut-acquire": Case(_rules(on(b"EXEC", cut=True)), acquire, FENCE),
    "stall-acquire": Case(_rules(on(b"EXEC", silent=True)), acquire, FENCE),
    "cut-release": Case(_rules(on(b"EVALSHA", RELEASE.sha, cut=True)), release, True),
    "cut-extend": Case(_rules(on(b"EVALSHA", EXTEND.sha, cut=True)), extend, (CacheError, "extend failed: ")),
    "stall-extend": Case(
        _rules(on(b"EVALSHA", EXTEND.sha, silent=True)), extend, (CacheError, "extend failed: no reply")
    ),
    "cut-set_nx": Case(_rules(on(b"SET", cut=True)), set_nx, (CacheError, "set_nx failed: ")),
    "cut-acquire-twice": Case(
        _rules(on(b"EXEC", cut=True), on(b"EXEC", cut=True)),
        acquire,
        (CacheError, "acquire (retried after a lost reply) failed: "),
    ),
    # NOAUTH on a live connection: nothing ran, once more on a new connection.
    "noauth-extend": Case(_rules(on(b"EVALSHA", EXTEND.sha, reply=NOAUTH)), extend, True),
    # Another error reply: the call's CacheError at once.
    "oom-acquire": Case(
        _rules(on(b"SET", reply=OOM), on(b"EXEC", reply=EXECABORT)),
        acquire,
        (CacheError, "acquire failed: the server replied OOM command not allowed"),
    ),
    "oom-extend": Case(
        _rules(on(b"EVALSHA", EXTEND.sha, reply=OOM)),
        extend,
        (CacheError, "extend failed: the server replied OOM command not allowed"),
    ),
    # An error reply in a batch: the error names the key of the call it came to.
    "oom-release-many": Case(
        _rules(on(b"EVALSHA", RELEASE.sha, b"1", K2, reply=OOM)),
        release_many,
        (CacheError, f"release_many failed: the server replied {OOM[1:-2].decode()} on key 'parity:k2'"),
    ),
    # MULTI refused alone: SET and TIME ran on their own; this acquire and every later one by script.
    "multi-refused": Case(
        _rules(
            on(b"MULTI", reply=b"-NOPERM this user has no permissions to run the 'multi' command\r\n"),
            on(b"SET", reply=b"+OK\r\n"),
            on(b"TIME", reply=NOW),
            on(b"EXEC", reply=b"-ERR EXEC without MULTI\r\n"),
        ),
        two_acquires,
        [FENCE, fence_of(K2)],
        warned=1,
    ),
    # Under wait_replicas: too few replicas undoes an acquire; an extend's lease is lost.
    "wait-short-acquire": Case(
        _rules(on(b"WAIT", reply=b":0\r\n")),
        acquire,
        (CacheError, "acquire undone: 0 of 1 replicas confirmed it within 100 ms (wait_replicas)"),
        {"wait_replicas": 1, "wait_timeout": 0.1},
    ),
    "wait-short-extend": Case(
        _rules(on(b"WAIT", reply=b":0\r\n")),
        extend,
        (Unreplicated, "is lost: extend undone: 0 of 1 replicas confirmed it within 100 ms (wait_replicas)"),
        {"wait_replicas": 1, "wait_timeout": 0.1},
    ),
    # A reply of a shape the command never gets.
    # The Lua-free extend and release: what they miss, or are refused OOM or WRONGTYPE on,
    # once more by script.
    "luafree-extend-missed": Case(_rules(on(b"SET", K1, reply=b"$-1\r\n")), extend, True, answer=lua_free),
    "luafree-extend-oom": Case(_rules(on(b"SET", K1, reply=OOM)), extend, True, answer=lua_free),
    "luafree-release-missed": Case(_rules(on(b"DELEX", K1, reply=b":0\r\n")), release, True, answer=lua_free),
    "luafree-release-many-wrongtype": Case(
        _rules(on(b"DELEX", K2, reply=b"-WRONGTYPE Operation against a key holding the wrong kind of value\r\n")),
        release_many,
        [True, True, True],
        answer=lua_free,
    ),
    # A reply of a kind the command never gets: the call's CacheError at once, naming the
    # command and only the reply's kind (it might echo a token), never resent.
    "unexpected-extend": Case(
        _rules(on(b"EVALSHA", EXTEND.sha, reply=bulk(T1))),
        extend,
        (CacheError, "extend failed: unexpected reply to EVALSHA: a bytes on key"),
    ),
    "unexpected-release": Case(
        _rules(on(b"EVALSHA", RELEASE.sha, reply=b"*1\r\n:1\r\n")),
        release,
        (CacheError, "release failed: unexpected reply to EVALSHA: a list on key"),
    ),
    "unexpected-incr": Case(
        _rules(on(b"INCRBY", reply=bulk(b"abc"))), incr, (CacheError, "incr failed: unexpected reply")
    ),
    "unexpected-set_nx": Case(
        _rules(on(b"SET", reply=bulk(b"abc"))), set_nx, (CacheError, "set_nx failed: unexpected reply")
    ),
    # A transient reply to one transaction of a batch: only that one goes again (the keys
    # taken are kept, as a release's are: nothing that ran is sent twice).
    "transient-acquire-many": Case(
        _rules(on(b"SET", K2, reply=LOADING)),
        lambda backend: backend.acquire_many([K1, K2, K3], [T1, T2, T3], TTL),
        [FENCE, fence_of(K2), fence_of(K3)],
    ),
    # EXEC's reply with an integer in TIME's place: a clock of no known shape, so the
    # ACQUIRE script decides the key (hotlock._acquire.read), and its reply is checked.
    "odd-clock-acquire": Case(_rules(on(b"EXEC", reply=b"*2\r\n+OK\r\n:5\r\n")), acquire, FENCE),
}


# -- running one -------------------------------------------------------------------------------

# What a transport sends of its own: the handshake, script loads, a pipeline's framing TIME.
_OWN = {b"AUTH", b"HELLO", b"CLIENT", b"SELECT", b"INFO", b"COMMAND", b"PING", b"SCRIPT"}


def lock_commands(received: list[list[bytes]]) -> list[tuple[bytes, ...]]:
    """The lock commands sent: the transport's own left out, TIME too unless a MULTI
    came before it (a transaction's, refused or not)."""
    out: list[tuple[bytes, ...]] = []
    in_multi = False
    for command in received:
        name = command[0].upper()
        if name in _OWN or (name == b"TIME" and not in_multi):
            continue
        in_multi = name == b"MULTI" or (in_multi and name != b"EXEC")
        out.append(tuple(command))
    return out


def essential(exc: BaseException, server: str) -> str:
    """An error's text as the two paths must agree on it: how often it was retried and
    what the server replied, not how a transport words a lost connection, nor the fake
    server's port."""
    text = re.sub(r"retried \d+ times", "retried N times", str(exc).replace(server, "<server>"))
    head, sep, why = text.partition(" failed: ")
    if sep and not why.startswith("the server replied"):
        return f"{head} failed: <lost>"
    return text


@dataclass
class Ran:
    outcome: object  # the result, or (error class name, essential text)
    pending: int  # scripted replies never asked for: a resend one path skipped
    commands: list[tuple[bytes, ...]]
    warnings: list[str]
    text: str  # the error's whole text ("" for a result)


def run(backend: str, case: Case, caplog: pytest.LogCaptureFixture) -> Ran:
    caplog.clear()
    with FakeRedis(case.answer) as fake:
        cache = hotlock.connect(fake.url, backend=backend, timeout=TIMEOUT, **case.connect)
        try:
            assert cache.backend == backend
            start = len(fake.received)
            case.script(fake)
            text = ""
            try:
                outcome: object = case.call(cache._backend)
            except (CacheError, Unreplicated) as exc:
                outcome = (type(exc).__name__, essential(exc, fake.url))
                text = str(exc)
            commands = lock_commands(fake.received[start:])
            warnings = [r.getMessage().replace(fake.url, "<server>") for r in caplog.records]
            return Ran(outcome, fake.pending(), commands, warnings, text)
        finally:
            cache.close()


@pytest.fixture
def log(caplog: pytest.LogCaptureFixture) -> Iterator[pytest.LogCaptureFixture]:
    with caplog.at_level(logging.WARNING, logger="hotlock"):
        yield caplog


@pytest.mark.parametrize("name", list(CASES))
def test_native_and_python_cores_agree(name: str, log: pytest.LogCaptureFixture) -> None:
    case = CASES[name]
    python = run("redis-py", case, log)
    native = run("native", case, log)
    assert native.outcome == python.outcome, (native.text, python.text)
    for ran in (python, native):
        assert not any(token.decode() in ran.text for token in (T1, T2, T3)), ran.text  # no error shows a token
    assert python.pending == native.pending == 0, "a scripted reply was never asked for"
    if case.jittered:
        for ran in (python, native):
            tries = int(re.findall(r"retried (\d+) times", ran.text)[0])
            assert len(ran.commands) == tries + 1 and len(set(ran.commands)) == 1, ran.text
        assert set(native.commands) == set(python.commands)
    else:
        assert native.commands == python.commands
    assert native.warnings == python.warnings and len(python.warnings) == case.warned, python.warnings
    outcome = python.outcome
    if isinstance(case.expect, tuple):
        kind, words = case.expect
        assert isinstance(outcome, tuple) and outcome[0] == kind.__name__, python.text
        for ran in (python, native):
            assert words in re.sub(r"retried \d+ times", "retried N times", ran.text), ran.text
    else:
        assert outcome == case.expect, python.text
