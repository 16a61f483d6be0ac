"""The transaction acquire's reply, decided twice: by hotlock._acquire.read (the Python
backends) and by the extension's C (_native._read_acquire runs the decision the native
backends run on a hiredis reader's replies). The same scripted replies must give the same
answer: the fence, SCRIPT, or the error reply the call fails with. Under
connect(fences=False) the acquire is SET NX PX alone, and its one reply is decided alike."""

from __future__ import annotations

import itertools
from types import ModuleType

import hiredis
import pytest

from hotlock import _acquire
from hotlock.errors import ReplyError

from ..conftest import native_for_module


def _native() -> ModuleType:
    native: ModuleType = native_for_module()  # a run that requires the extension fails without it
    return native


def bulk(data: bytes) -> bytes:
    return b"$%d\r\n%s\r\n" % (len(data), data)


def clock(seconds: bytes, micros: bytes) -> bytes:
    return b"*2\r\n" + bulk(seconds) + bulk(micros)


OK, QUEUED = b"+OK\r\n", b"+QUEUED\r\n"
NOW = clock(b"1764582723", b"123456")
EXECABORT = b"-EXECABORT Transaction discarded because of previous errors.\r\n"
NOAUTH = b"-NOAUTH Authentication required.\r\n"
NOPERM = b"-NOPERM User locker has no permissions to run the 'multi' command\r\n"


def exec_of(taken: bytes, time_reply: bytes = NOW) -> bytes:
    return b"*2\r\n" + taken + time_reply


def python_answer(resp: bytes) -> int | str:
    """hotlock._acquire.read over the replies as the Python hiredis reader gives them; -1
    for SCRIPT when MULTI was refused alone (refused_multi), as the C hook says it."""
    reader = hiredis.Reader(replyError=ReplyError)
    reader.feed(resp)
    replies = [reader.gets() for _ in range(4)]
    assert all(r is not False for r in replies) and reader.gets() is False, "four whole replies"
    answer = _acquire.read(replies, ReplyError)
    if isinstance(answer, BaseException):
        return str(answer)
    if _acquire.refused_multi(replies, ReplyError):
        assert answer == _acquire.SCRIPT
        return -1
    return answer


CASES: dict[str, tuple[bytes, int | str]] = {
    "taken": (OK + QUEUED + QUEUED + exec_of(OK), 1764582723123456),
    "taken, OK as a bulk string": (OK + QUEUED + QUEUED + exec_of(bulk(b"OK")), 1764582723123456),
    "taken, microseconds with fewer digits": (
        OK + QUEUED + QUEUED + exec_of(OK, clock(b"1764582723", b"7")),
        1764582723000007,
    ),
    "held (SET NX nil)": (OK + QUEUED + QUEUED + exec_of(b"$-1\r\n"), 0),
    "WRONGTYPE at SET, EXECABORT": (
        OK + b"-WRONGTYPE Operation against a key holding the wrong kind of value\r\n" + QUEUED + EXECABORT,
        "WRONGTYPE Operation against a key holding the wrong kind of value",
    ),
    "OOM at SET, EXECABORT": (
        OK + b"-OOM command not allowed when used memory > 'maxmemory'.\r\n" + QUEUED + EXECABORT,
        "OOM command not allowed when used memory > 'maxmemory'.",
    ),
    "NOAUTH on all four": (NOAUTH * 4, "NOAUTH Authentication required."),
    "LOADING on all four": (
        b"-LOADING Redis is loading the dataset in memory\r\n" * 4,
        "LOADING Redis is loading the dataset in memory",
    ),
    "TIME refused when queued": (OK + QUEUED + b"-NOPERM no TIME for you\r\n" + EXECABORT, "NOPERM no TIME for you"),
    "EXEC refused alone": (OK + QUEUED + QUEUED + b"-ERR something else\r\n", "ERR something else"),
    "MULTI refused alone, SET OK": (NOPERM + OK + NOW + b"-ERR EXEC without MULTI\r\n", -1),
    "MULTI refused alone, SET nil": (NOPERM + b"$-1\r\n" + NOW + b"-ERR EXEC without MULTI\r\n", -1),
    "MULTI refused alone, TIME refused too": (NOPERM + OK + NOPERM + NOPERM, -1),
    "TIME with one element": (OK + QUEUED + QUEUED + exec_of(OK, b"*1\r\n" + bulk(b"1764582723")), 0),
    "TIME not a number": (OK + QUEUED + QUEUED + exec_of(OK, clock(b"17645x2723", b"1")), 0),
    "TIME empty strings": (OK + QUEUED + QUEUED + exec_of(OK, clock(b"", b"")), 0),
    "TIME at zero seconds": (OK + QUEUED + QUEUED + exec_of(OK, clock(b"0", b"5")), 0),
    "TIME negative": (OK + QUEUED + QUEUED + exec_of(OK, clock(b"-5", b"5")), 0),
    "TIME a million microseconds": (OK + QUEUED + QUEUED + exec_of(OK, clock(b"1764582723", b"1000000")), 0),
    "TIME nil": (OK + QUEUED + QUEUED + exec_of(OK, b"$-1\r\n"), 0),
    "TIME a nil element": (OK + QUEUED + QUEUED + exec_of(OK, b"*2\r\n$-1\r\n" + bulk(b"1")), 0),
    "TIME as integers": (OK + QUEUED + QUEUED + exec_of(OK, b"*2\r\n:1764582723\r\n:5\r\n"), 1764582723000005),
    "EXEC nil": (OK + QUEUED + QUEUED + b"*-1\r\n", 0),
    "EXEC empty": (OK + QUEUED + QUEUED + b"*0\r\n", 0),
    "EXEC with three replies": (OK + QUEUED + QUEUED + b"*3\r\n" + OK + NOW + OK, 0),
    "EXEC a status": (OK + QUEUED + QUEUED + OK, 0),
    "EXEC's SET reply an error": (OK + QUEUED + QUEUED + exec_of(b"-ERR inside\r\n"), 0),
    "EXEC's SET reply something else": (OK + QUEUED + QUEUED + exec_of(bulk(b"NO")), 0),
}


@pytest.mark.parametrize("case", CASES)
def test_the_c_decision_is_the_python_one(case: str) -> None:
    resp, expected = CASES[case]
    assert python_answer(resp) == expected
    assert _native()._read_acquire(resp) == expected


# Every combination of these, one per reply: what each of the four may be, errors and
# shapes no server sends included (TIME's numbers with a sign, a space, an underscore or
# 19 digits among them; an EXEC whose SET reply is the integer 1, which Python takes for
# OK as redis-py may give it, is left out).
POOL: list[list[bytes]] = [
    [OK, NOPERM, NOAUTH, b"$-1\r\n", QUEUED],
    [QUEUED, OK, b"$-1\r\n", NOAUTH, b"-OOM full\r\n", b":1\r\n"],
    [QUEUED, NOW, NOAUTH, b"-NOPERM time\r\n", b"*0\r\n"],
    [
        exec_of(OK),
        exec_of(b"$-1\r\n"),
        exec_of(OK, clock(b"12", b"999999")),
        exec_of(OK, clock(b"1", b"x")),
        exec_of(OK, clock(b"+12", b"5")),
        exec_of(OK, clock(b"12", b" 5")),
        exec_of(OK, clock(b"1_2", b"5")),
        exec_of(OK, clock(b"1" * 19, b"5")),
        exec_of(OK, b"*2\r\n:7\r\n:-1\r\n"),
        exec_of(bulk(b"OK"), b"*3\r\n:1\r\n:2\r\n:3\r\n"),
        EXECABORT,
        NOAUTH,
        b"*-1\r\n",
        b":5\r\n",
    ],
]


def test_every_combination_is_decided_alike() -> None:
    native = _native()
    for replies in itertools.product(*POOL):
        resp = b"".join(replies)
        assert native._read_acquire(resp) == python_answer(resp), resp


@pytest.mark.parametrize("fenced", [True, False])
def test_the_c_wire_form_is_the_commands_as_hiredis_formats_them(fenced: bool) -> None:
    native = _native()
    for key, token, ms in [
        (b"k", b"t" * 16, 1),
        (b"hotlock:lock:{a}", bytes(range(16)), 30_000),
        (b"k" * 5000, b"\r\n" * 8, 10**12),
    ]:
        commands = _acquire.commands(key, token, ms, fenced)
        assert len(commands) == (4 if fenced else 1)
        theirs = b"".join(native._resp_pair(list(command))[1] for command in commands)
        assert native._acquire_wire(key, token, ms, fenced) == theirs


# SET NX PX alone (fences off): OK took the key, nil found it there, an error is the call's.
SET_REPLIES: dict[bytes, int | str] = {
    OK: _acquire.TAKEN,
    bulk(b"OK"): _acquire.TAKEN,
    b"$-1\r\n": _acquire.SCRIPT,
    b"*-1\r\n": _acquire.SCRIPT,
    NOAUTH: "NOAUTH Authentication required.",
    b"-OOM command not allowed\r\n": "OOM command not allowed",
    b"-LOADING loading\r\n": "LOADING loading",
    QUEUED: _acquire.SCRIPT,
    b":5\r\n": _acquire.SCRIPT,
    bulk(b"NO"): _acquire.SCRIPT,
}


@pytest.mark.parametrize("resp", SET_REPLIES)
def test_the_fenceless_set_reply_is_decided_alike(resp: bytes) -> None:
    reader = hiredis.Reader(replyError=ReplyError)
    reader.feed(resp)
    answer = _acquire.read([reader.gets()], ReplyError)
    assert (str(answer) if isinstance(answer, BaseException) else answer) == SET_REPLIES[resp]
    assert _native()._read_acquire(resp, False) == SET_REPLIES[resp]
