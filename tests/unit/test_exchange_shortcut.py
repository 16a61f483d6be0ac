"""hotlock._exchange's shortcut (Exchange.transacts, release_first, Running.carried): a
transport that writes a call's first Send itself must write what the steps would have
sent, settle the call only as the steps would have, and hand anything else to the steps,
which go on as if they had sent it."""

from __future__ import annotations

import itertools
from typing import Any

import pytest

from hotlock._config import parse_url
from hotlock._dialect import UNDETECTED, Dialect
from hotlock._exchange import Decided, Exchange, Lost, Running, Send, Steps, Transaction
from hotlock._scripts import ACQUIRE, ACQUIRE_WAIT, RELEASE, Script
from hotlock.errors import ReplyError

TOKEN = b"t" * 16
PERMIT = TOKEN + b"#3"  # a permit's ask, token '#' limit: always by script

DIALECTS = [
    UNDETECTED,
    Dialect("redis", "7.0.15", "script", "no DELEX or SET IFEQ before Redis 8.4"),
    Dialect("redis", "8.4.0", "DELEX", "DELEX IFEQ and SET IFEQ, from the version"),
    Dialect("valkey", "9.0.0", "DELIFEQ", "DELIFEQ and SET IFEQ, from the version"),
    Dialect("redis", "7.0.15", "script", "connect(scripts='always')"),
    Dialect("redis", "7.0.15", "script", "no DELEX or SET IFEQ before Redis 8.4", fenced=False),
]


def exchange(dialect: Dialect, wait_replicas: int = 0) -> Exchange:
    config = parse_url("redis://127.0.0.1:1", connect_timeout=1.0, timeout=1.0, wait_replicas=wait_replicas)
    ex = Exchange(config)
    ex.use_dialect(dialect)
    return ex


def first(steps: Steps[Any]) -> Send:
    step = next(steps)
    assert isinstance(step, Send)
    return step


def finish(steps: Steps[Any], carried: Any) -> Any:
    """The steps' result once the first Send was carried out with ``carried`` and nothing else is sent."""
    running = Running(steps)
    running.carried(carried)
    for step in running:
        raise AssertionError(f"sent more: {step}")
    return running.result


@pytest.mark.parametrize(
    ("dialect", "wait_replicas", "script", "token"),
    list(itertools.product(DIALECTS, [0, 1], [ACQUIRE, ACQUIRE_WAIT], [TOKEN, PERMIT])),
)
def test_transacts_says_when_an_acquire_begins_with_one_keys_transaction_and_ends_with_its_fence(
    dialect: Dialect, wait_replicas: int, script: Script, token: bytes
) -> None:
    ex = exchange(dialect, wait_replicas)
    step = first(ex.acquire_steps("acquire", [b"k"], [token], 30000, script))
    plain = type(step) is Transaction and not step.wait
    assert ex.transacts(script, token) == plain
    if plain:
        assert isinstance(step, Transaction)
        assert (step.keys, step.tokens, step.ttl_ms, step.fenced) == ([b"k"], [token], 30000, dialect.fenced)
        steps = ex.acquire_steps("acquire", [b"k"], [token], 30000, script)
        assert finish(steps, Decided([1764582723123456], None)) == [1764582723123456]


@pytest.mark.parametrize("dialect", DIALECTS)
@pytest.mark.parametrize("token", [TOKEN, PERMIT])
def test_release_first_is_what_a_release_sends_first_and_its_1_settles_it(dialect: Dialect, token: bytes) -> None:
    ex = exchange(dialect)
    step = first(ex.release_steps("release", [b"k"], [token]))
    assert step.commands == [ex.release_first(b"k", token)]
    assert finish(ex.release_steps("release", [b"k"], [token]), [1]) == [True]


@pytest.mark.parametrize("dialect", DIALECTS)
@pytest.mark.parametrize("token", [TOKEN, PERMIT])
@pytest.mark.parametrize("wait_replicas", [0, 1])
def test_extend_first_is_what_an_extend_sends_first_and_its_settling_reply_settles_it(
    dialect: Dialect, token: bytes, wait_replicas: int
) -> None:
    ex = exchange(dialect, wait_replicas)
    shortcut = ex.extend_first(b"k", token, 30000)
    step = first(ex.extend_steps("extend", [b"k"], [token], 30000))
    if wait_replicas:
        assert shortcut is None and len(step.commands) == 2  # the WAIT behind
        return
    assert shortcut is not None
    assert (step.commands, step.shapes) == (shortcut.commands, shortcut.shapes)
    settling = b"OK" if shortcut.shapes[0](b"OK") else 1
    assert shortcut.shapes[0](settling)
    assert finish(ex.extend_steps("extend", [b"k"], [token], 30000), [settling]) == [True]


def test_a_carried_lost_reply_is_resent_and_a_carried_refusal_goes_by_script() -> None:
    ex = exchange(DIALECTS[1])
    steps = ex.acquire_steps("acquire", [b"k"], [TOKEN], 30000)
    running = Running(steps)
    running.carried(Lost("no reply within the timeout"))
    resent = next(running)
    assert type(resent) is Transaction and resent.timeout is not None  # once more, within the budget
    running.took(Decided([-1], ReplyError("NOPERM no MULTI for you")))
    script = next(running)
    assert script.commands == [(b"EVALSHA", ACQUIRE.sha, b"1", b"k", TOKEN, b"30000")]
    assert not ex.transacts(ACQUIRE, TOKEN)  # MULTI refused alone: by script from now on
    running.took([7])
    with pytest.raises(StopIteration):
        next(running)
    assert running.result == [7]


def test_a_release_first_of_0_on_a_lua_free_server_goes_again_by_script() -> None:
    ex = exchange(DIALECTS[3])
    running = Running(ex.release_steps("release", [b"k"], [TOKEN]))
    running.carried([0])  # DELIFEQ missed: a waiter's mark, or the lock is gone
    again = next(running)
    assert again.commands == [(b"EVALSHA", RELEASE.sha, b"1", b"k", TOKEN)]
    running.took([0])
    with pytest.raises(StopIteration):
        next(running)
    assert running.result == [False]
