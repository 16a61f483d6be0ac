"""hotlock._exchange's rules, one at a time: an Exchange driven by ``drive`` over a scripted
transport (each Send answered by the next scripted outcome: its replies, error replies in
place as ReplyError, or the Failure that lost them) and a fake clock (a Pause moves it;
nothing sleeps). Each test checks what every Send carried and what the call came to."""

from __future__ import annotations

import logging
import types
from collections.abc import Iterator
from typing import Any

import pytest

from hotlock import _exchange
from hotlock._config import ServerConfig
from hotlock._dialect import Dialect, detect
from hotlock._exchange import Exchange, Failure, Lost, NotSent, Send, Steps, drive
from hotlock._scripts import ACQUIRE, ACQUIRE_WAIT, EXTEND, RELEASE, SCRIPTS
from hotlock.errors import CacheError, ReplyError, Unreplicated

from .conftest import FakeClock

T = 1.0  # the reply timeout
TTL = 5000
MS = b"5000"
K1, K2, K3 = b"lock:k1", b"lock:k2", b"lock:k3"
T1, T2, T3 = b"1" * 16, b"2" * 16, b"3" * 16
NOW = [b"1764582723", b"123456"]  # TIME's reply
FENCE = 1764582723123456
SERVER = "redis://fake:6379/0"

REDIS7 = detect({"redis_version": "7.0.15"}, None, "auto")  # scripts for extend/release
ALWAYS = detect({"redis_version": "7.0.15"}, None, "always")  # the acquire by script too
NO_FENCES = detect({"redis_version": "7.0.15"}, None, "auto", fences=False)
VALKEY9 = detect({"server_name": "valkey", "valkey_version": "9.0.0"}, {"DELIFEQ": True, "DELEX": False}, "auto")
REDIS84 = detect({"redis_version": "8.4.0"}, {"DELIFEQ": False, "DELEX": True}, "auto")

LOST = Lost("no reply within the timeout")


def err(text: str) -> ReplyError:
    return ReplyError(text)


def noscript() -> ReplyError:
    return err("NOSCRIPT No matching script. Please use EVAL.")


def taken(key: bytes, token: bytes) -> list[tuple[bytes, ...]]:
    """The transaction acquire's four commands."""
    return [(b"MULTI",), (b"SET", key, token, b"NX", b"PX", MS), (b"TIME",), (b"EXEC",)]


def evalsha(script: Any, key: bytes, *args: bytes) -> tuple[bytes, ...]:
    return (b"EVALSHA", script.sha, b"1", key, *args)


WAIT = (b"WAIT", b"1", b"500")
LOADS = [(b"SCRIPT", b"LOAD", s.source) for s in SCRIPTS]  # after NOSCRIPT: every script
SHAS = [s.sha for s in SCRIPTS]
FREE = [b"OK", b"QUEUED", b"QUEUED", [b"OK", NOW]]  # the transaction took the key
HELD = [b"OK", b"QUEUED", b"QUEUED", [None, NOW]]  # SET NX found the key


class Took:
    """An outcome that takes ``seconds`` of the fake clock before it comes."""

    def __init__(self, seconds: float, outcome: list[Any] | Failure) -> None:
        self.seconds = seconds
        self.outcome = outcome


class Always:
    """An outcome given to this Send and every later one."""

    def __init__(self, outcome: list[Any] | Failure) -> None:
        self.outcome = outcome


Outcome = list[Any] | Failure | Took | Always


class Server:
    """The transport: records each Send and answers it with the next outcome. A reply that
    is not an error must pass the Send's shape check, as a real transport's would."""

    def __init__(self, clock: FakeClock, outcomes: list[Outcome]) -> None:
        self.clock = clock
        self.outcomes = list(outcomes)
        self.sends: list[Send] = []

    def carry(self, send: Send) -> list[Any]:
        self.sends.append(send)
        assert self.outcomes, f"a Send nobody scripted: {send.commands}"
        outcome = self.outcomes[0]
        if isinstance(outcome, Always):
            outcome = outcome.outcome
        else:
            self.outcomes.pop(0)
        if isinstance(outcome, Took):
            self.clock.now += outcome.seconds
            outcome = outcome.outcome
        if isinstance(outcome, Failure):
            raise outcome
        assert len(outcome) == len(send.commands) == len(send.shapes), (send.commands, outcome)
        for command, reply, shape in zip(send.commands, outcome, send.shapes, strict=True):
            assert isinstance(reply, ReplyError) or shape(reply), (command, reply)
        return list(outcome)

    @property
    def commands(self) -> list[list[tuple[bytes, ...]]]:
        return [send.commands for send in self.sends]


class Rig:
    """One Exchange on the fake clock, and the Pauses it asked for."""

    def __init__(self, clock: FakeClock, pauses: list[float]) -> None:
        self.clock = clock
        self.pauses = pauses
        self.server: Server | None = None

    def exchange(self, dialect: Dialect = REDIS7, wait_replicas: int = 0) -> Exchange:
        config = ServerConfig(url=SERVER, host="fake", port=6379, timeout=T, wait_replicas=wait_replicas)
        exchange = Exchange(config)
        exchange.clock = self.clock.monotonic
        exchange.use_dialect(dialect)
        return exchange

    def run(self, steps: Steps[Any], *outcomes: Outcome) -> Any:
        """The call's result; every scripted outcome must have been used (Always aside)."""
        self.server = Server(self.clock, list(outcomes))
        try:
            return drive(steps, self.server.carry)
        finally:
            left = [o for o in self.server.outcomes if not isinstance(o, Always)]
            assert not left, f"scripted but never sent: {left}"

    def fails(self, steps: Steps[Any], *outcomes: Outcome) -> str:
        """The call's CacheError text."""
        with pytest.raises(CacheError) as info:
            self.run(steps, *outcomes)
        return str(info.value)

    @property
    def sent(self) -> list[list[tuple[bytes, ...]]]:
        assert self.server is not None
        return self.server.commands

    @property
    def sends(self) -> list[Send]:
        assert self.server is not None
        return self.server.sends


@pytest.fixture
def rig(clock: FakeClock, monkeypatch: pytest.MonkeyPatch) -> Iterator[Rig]:
    pauses: list[float] = []

    def sleep(seconds: float) -> None:
        pauses.append(seconds)
        clock.now += seconds

    monkeypatch.setattr(_exchange, "time", types.SimpleNamespace(monotonic=clock.monotonic, sleep=sleep))
    yield Rig(clock, pauses)


def acquire(ex: Exchange, keys: list[bytes], tokens: list[bytes], script: Any = ACQUIRE) -> Steps[list[int]]:
    return ex.acquire_steps("acquire", keys, tokens, TTL, script, ex.retry_until())


# -- the transaction acquire -------------------------------------------------------------------


def test_a_free_key_is_taken_by_the_transaction_its_fence_from_time(rig: Rig) -> None:
    ex = rig.exchange()
    assert rig.run(acquire(ex, [K1], [T1]), FREE) == [FENCE]
    assert rig.sent == [taken(K1, T1)]
    # EXEC's reply frames the write: no TIME of the transport's behind it.
    assert rig.sends[0].frame is False


def test_a_held_key_goes_to_the_acquire_script_next_and_only_that_key(rig: Rig) -> None:
    ex = rig.exchange()
    assert rig.run(acquire(ex, [K1], [T1]), HELD, [-29_000]) == [-29_000]
    assert rig.sent == [taken(K1, T1), [evalsha(ACQUIRE, K1, T1, MS)]]
    # In a batch, the held key alone goes by script, in a second round trip.
    results = rig.run(acquire(ex, [K1, K2, K3], [T1, T2, T3]), FREE + HELD + FREE, [-100])
    assert results == [FENCE, -100, FENCE]
    assert rig.sent == [taken(K1, T1) + taken(K2, T2) + taken(K3, T3), [evalsha(ACQUIRE, K2, T2, MS)]]


def test_the_waiting_forms_and_permits_go_by_script(rig: Rig) -> None:
    ex = rig.exchange()
    assert rig.run(acquire(ex, [K1], [T1], ACQUIRE_WAIT), [7]) == [7]
    assert rig.sent == [[evalsha(ACQUIRE_WAIT, K1, T1, MS)]]
    ask = T1 + b"#3"
    assert rig.run(acquire(ex, [K1], [ask]), [7]) == [7]
    assert rig.sent == [[evalsha(ACQUIRE, K1, ask, MS)]]
    # connect(scripts='always'): the plain acquire too.
    ex = rig.exchange(ALWAYS)
    assert rig.run(acquire(ex, [K1], [T1]), [7]) == [7]
    assert rig.sent == [[evalsha(ACQUIRE, K1, T1, MS)]]


def test_multi_refused_alone_sends_this_and_every_later_acquire_by_script(
    rig: Rig, caplog: pytest.LogCaptureFixture
) -> None:
    ex = rig.exchange()
    refused = [err("NOPERM this user has no permissions to run the 'multi' command"), b"OK", NOW]
    refused.append(err("ERR EXEC without MULTI"))
    with caplog.at_level(logging.WARNING, logger="hotlock"):
        # SET ran on its own in both: the script decides (and finds its own token).
        assert rig.run(acquire(ex, [K1, K2], [T1, T2]), refused + refused, [FENCE, FENCE + 1]) == [FENCE, FENCE + 1]
        assert rig.sent == [taken(K1, T1) + taken(K2, T2), [evalsha(ACQUIRE, K1, T1, MS), evalsha(ACQUIRE, K2, T2, MS)]]
        assert rig.run(acquire(ex, [K3], [T3]), [FENCE + 2]) == [FENCE + 2]
        assert rig.sent == [[evalsha(ACQUIRE, K3, T3, MS)]]
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "refused MULTI (NOPERM" in warnings[0].getMessage()
    assert SERVER in warnings[0].getMessage()


def test_multi_refused_with_the_set_is_that_error_not_a_refusal(rig: Rig, caplog: pytest.LogCaptureFixture) -> None:
    ex = rig.exchange()
    oom = [err("ERR MULTI calls can not be nested"), err("OOM command not allowed"), b"QUEUED", err("EXECABORT x")]
    text = rig.fails(acquire(ex, [K1], [T1]), oom)
    assert "acquire failed: the server replied OOM command not allowed" in text
    assert rig.run(acquire(ex, [K1], [T1]), FREE) == [FENCE]  # still by transaction
    assert not [r for r in caplog.records if r.levelno == logging.WARNING]


def test_fences_off_take_a_free_key_by_set_nx_px_alone(rig: Rig) -> None:
    ex = rig.exchange(NO_FENCES)
    set_nx = (b"SET", K1, T1, b"NX", b"PX", MS)
    assert rig.run(acquire(ex, [K1], [T1]), [b"OK"]) == [1]  # TAKEN: the lock's fence is 0
    assert rig.sent == [[set_nx]]
    assert rig.run(acquire(ex, [K1], [T1]), [None], [-300]) == [-300]
    assert rig.sent == [[set_nx], [evalsha(ACQUIRE, K1, T1, MS)]]


# -- lost replies ------------------------------------------------------------------------------


def test_a_lost_acquire_is_resent_once_with_the_same_token_within_the_budget(rig: Rig) -> None:
    ex = rig.exchange()
    steps = acquire(ex, [K1], [T1])  # the budget: 2 reply timeouts from now
    assert rig.run(steps, Took(1.5 * T, LOST), FREE) == [FENCE]
    assert rig.sent == [taken(K1, T1), taken(K1, T1)]
    assert rig.sends[0].timeout is None  # the connection's own reply timeout
    assert rig.sends[1].timeout == pytest.approx(0.5 * T)  # what is left of the budget


def test_a_lost_release_is_resent_once_with_the_same_token(rig: Rig) -> None:
    ex = rig.exchange()
    assert rig.run(ex.release_steps("release", [K1], [T1]), LOST, [0]) == [False]
    assert rig.sent == [[evalsha(RELEASE, K1, T1)]] * 2
    assert rig.sends[1].timeout == pytest.approx(T)


@pytest.mark.parametrize("call", ["extend", "set_nx", "incr"])
def test_a_lost_extend_set_nx_or_incr_is_not_resent(rig: Rig, call: str) -> None:
    ex = rig.exchange()
    text = rig.fails(_call(ex, call), LOST)
    assert len(rig.sent) == 1
    assert text == f"{call} failed: no reply within the timeout on key 'lock:k1' (server {SERVER})"


def _call(ex: Exchange, call: str) -> Steps[Any]:
    if call == "extend":
        return ex.extend_steps("extend", [K1], [T1], TTL)
    if call == "set_nx":
        return ex.command_steps("set_nx", K1, (b"SET", K1, T1, b"NX", b"PX", MS), _exchange.is_ok_or_nil)
    if call == "incr":
        return ex.command_steps("incr", K1, (b"INCRBY", K1, b"1"), _exchange.is_int)
    if call == "release":
        return ex.release_steps("release", [K1], [T1])
    assert call == "acquire", call
    return acquire(ex, [K1], [T1])


GOOD: dict[str, list[Any]] = {"extend": [1], "set_nx": [b"OK"], "incr": [1], "release": [1], "acquire": FREE}
RESULT: dict[str, object] = {"extend": [True], "set_nx": b"OK", "incr": 1, "release": [True], "acquire": [FENCE]}


@pytest.mark.parametrize("call", list(GOOD))
def test_not_sent_goes_once_more_for_any_call(rig: Rig, call: str) -> None:
    ex = rig.exchange()
    assert rig.run(_call(ex, call), NotSent("connection refused"), GOOD[call]) == RESULT[call]
    assert len(rig.sent) == 2 and rig.sent[0] == rig.sent[1]
    # Only once: nothing ran either time, and the call's error says it was retried.
    text = rig.fails(_call(ex, call), NotSent("connection refused"), NotSent("connection refused"))
    assert f"{call} (retried after a lost reply) failed: connection refused" in text
    assert len(rig.sent) == 2


@pytest.mark.parametrize("call", ["acquire", "release"])
def test_a_second_lost_reply_is_the_calls_error(rig: Rig, call: str) -> None:
    ex = rig.exchange()
    text = rig.fails(_call(ex, call), LOST, Lost("connection lost"))
    assert text == f"{call} (retried after a lost reply) failed: connection lost on key 'lock:k1' (server {SERVER})"
    assert len(rig.sent) == 2


def test_no_resend_once_the_budget_is_spent_nor_after_a_failure_no_retry_mends(rig: Rig) -> None:
    ex = rig.exchange()
    text = rig.fails(acquire(ex, [K1], [T1]), Took(2 * T, LOST))
    assert "acquire failed: no reply within the timeout" in text and len(rig.sent) == 1
    text = rig.fails(acquire(ex, [K1], [T1]), Failure("certificate verify failed"))
    assert "acquire failed: certificate verify failed" in text and len(rig.sent) == 1


def test_noauth_on_a_live_connection_is_resent_once(rig: Rig) -> None:
    ex = rig.exchange()
    noauth = [err("NOAUTH Authentication required.")]
    assert rig.run(ex.extend_steps("extend", [K1], [T1], TTL), noauth, [1]) == [True]
    assert rig.sent == [[evalsha(EXTEND, K1, T1, MS)]] * 2
    text = rig.fails(ex.extend_steps("extend", [K1], [T1], TTL), noauth, [err("WRONGPASS invalid password")])
    # As the C client words it: a new connection is no resend of what may have run.
    assert "extend failed: the server replied WRONGPASS" in text
    # A lost reply after it still has its own resend (an acquire may be sent twice).
    assert rig.run(acquire(ex, [K1], [T1]), [noauth[0]] * 4, Lost("timeout"), FREE) == [FENCE]
    # On the transaction's MULTI it is that error, never a server without transactions.
    noauth_multi = [noauth[0], noauth[0], noauth[0], noauth[0]]
    assert rig.run(acquire(ex, [K1], [T1]), noauth_multi, FREE) == [FENCE]
    assert rig.sent == [taken(K1, T1)] * 2


# -- transient replies ---------------------------------------------------------------------------

TRANSIENT = {
    "LOADING": "LOADING Redis is loading the dataset in memory",
    "READONLY": "READONLY You can't write against a read only replica.",
    "BUSY": "BUSY Redis is busy running a script.",
    "MASTERDOWN": "MASTERDOWN Link with MASTER is down",
    "TRYAGAIN": "TRYAGAIN Multiple keys request during rehashing of slot",
    "CLUSTERDOWN": "CLUSTERDOWN The cluster is down",
}


@pytest.mark.parametrize("code", list(TRANSIENT))
@pytest.mark.parametrize("call", ["extend", "set_nx", "incr"])
def test_a_transient_reply_is_paused_and_resent_whatever_the_command(rig: Rig, code: str, call: str) -> None:
    ex = rig.exchange()
    assert rig.run(_call(ex, call), [err(TRANSIENT[code])], GOOD[call]) == RESULT[call]
    assert len(rig.sent) == 2 and rig.sent[0] == rig.sent[1]
    assert len(rig.pauses) == 1 and 0 < rig.pauses[0] <= 0.005
    # The resend gets what is left of the call's timeout.
    assert rig.sends[1].timeout == pytest.approx(T)


def test_a_transient_reply_to_the_transaction_resends_the_transaction(rig: Rig) -> None:
    ex = rig.exchange()
    loading = [b"OK", err(TRANSIENT["LOADING"]), b"QUEUED", err("EXECABORT Transaction discarded")]
    assert rig.run(acquire(ex, [K1], [T1]), loading, FREE) == [FENCE]
    assert rig.sent == [taken(K1, T1)] * 2 and len(rig.pauses) == 1


def test_a_transient_reply_to_one_transaction_of_a_batch_resends_that_one_only(rig: Rig) -> None:
    """The keys taken are kept: an acquire that ran is not sent again. A key left to the
    script goes again with the one that got the reply (the try ended at the reply)."""
    ex = rig.exchange()
    loading = [b"OK", err(TRANSIENT["LOADING"]), b"QUEUED", err("EXECABORT Transaction discarded")]
    results = rig.run(acquire(ex, [K1, K2, K3], [T1, T2, T3]), FREE + loading + HELD, FREE + HELD, [-100])
    assert results == [FENCE, FENCE, -100]
    assert rig.sent == [
        taken(K1, T1) + taken(K2, T2) + taken(K3, T3),
        taken(K2, T2) + taken(K3, T3),
        [evalsha(ACQUIRE, K3, T3, MS)],
    ]


@pytest.mark.parametrize("call", ["extend", "acquire", "incr"])
def test_a_transient_reply_until_the_budget_ends_is_the_calls_error(rig: Rig, call: str) -> None:
    ex = rig.exchange()
    busy = [err(TRANSIENT["BUSY"])] * len(GOOD[call])
    start = rig.clock.now
    text = rig.fails(_call(ex, call), Always(busy))
    tries = len(rig.pauses)
    assert tries >= 5 and len(rig.sent) == tries + 1
    assert f"{call} (retried {tries} times within the call's timeout) failed: the server replied BUSY" in text
    # The pauses end by the call's own timeout (one reply timeout kept for the last try).
    assert sum(rig.pauses) == pytest.approx(T, abs=0.002)
    assert rig.clock.now - start <= T + 0.002


def test_a_lost_reply_and_transient_replies_both_show_in_the_error(rig: Rig) -> None:
    ex = rig.exchange()
    text = rig.fails(_call(ex, "release"), LOST, Always([err(TRANSIENT["LOADING"])]))
    assert f"release (retried after a lost reply) (retried {len(rig.pauses)} times" in text


# -- NOSCRIPT ----------------------------------------------------------------------------------


def test_noscript_loads_every_script_and_resends_only_the_missing_calls_in_one_send(rig: Rig) -> None:
    ex = rig.exchange()
    steps = ex.release_steps("release_many", [K1, K2, K3], [T1, T2, T3])
    results = rig.run(steps, [noscript(), 1, noscript()], [*SHAS, 0, 1])
    assert results == [False, True, True]
    assert rig.sent == [
        [evalsha(RELEASE, K1, T1), evalsha(RELEASE, K2, T2), evalsha(RELEASE, K3, T3)],
        [*LOADS, evalsha(RELEASE, K1, T1), evalsha(RELEASE, K3, T3)],
    ]


def test_noscript_under_wait_replicas_sends_the_wait_behind_the_missing_calls(rig: Rig) -> None:
    ex = rig.exchange(ALWAYS, wait_replicas=1)
    results = rig.run(acquire(ex, [K1, K2], [T1, T2]), [7, noscript(), 1], [*SHAS, 8, 1])
    assert results == [7, 8]
    assert rig.sent == [
        [evalsha(ACQUIRE, K1, T1, MS), evalsha(ACQUIRE, K2, T2, MS), WAIT],
        [*LOADS, evalsha(ACQUIRE, K2, T2, MS), WAIT],
    ]


def test_noscript_on_extend_and_after_a_held_key(rig: Rig) -> None:
    ex = rig.exchange()
    assert rig.run(ex.extend_steps("extend", [K1], [T1], TTL), [noscript()], [*SHAS, 1]) == [True]
    assert rig.sent[1] == [*LOADS, evalsha(EXTEND, K1, T1, MS)]
    assert rig.run(acquire(ex, [K1], [T1]), HELD, [noscript()], [*SHAS, -5]) == [-5]
    assert rig.sent[2] == [*LOADS, evalsha(ACQUIRE, K1, T1, MS)]


# -- the Lua-free extend and release ----------------------------------------------------------


def test_lua_free_extend_and_release_send_no_script_when_they_hit(rig: Rig) -> None:
    ex = rig.exchange(VALKEY9)
    assert rig.run(ex.extend_steps("extend", [K1], [T1], TTL), [b"OK"]) == [True]
    assert rig.sent == [[(b"SET", K1, T1, b"IFEQ", T1, b"PX", MS)]]
    assert rig.run(ex.release_steps("release", [K1], [T1]), [1]) == [True]
    assert rig.sent == [[(b"DELIFEQ", K1, T1)]]
    ex = rig.exchange(REDIS84)
    assert rig.run(ex.release_steps("release", [K1], [T1]), [1]) == [True]
    assert rig.sent == [[(b"DELEX", K1, b"IFEQ", T1)]]


def test_lua_free_misses_go_once_more_by_script(rig: Rig) -> None:
    ex = rig.exchange(VALKEY9)
    # SET IFEQ missed the second (a waiter's mark, or lost): the script decides it.
    steps = ex.extend_steps("extend_many", [K1, K2], [T1, T2], TTL)
    assert rig.run(steps, [b"OK", None], [1]) == [True, True]
    assert rig.sent[1] == [evalsha(EXTEND, K2, T2, MS)]
    steps = ex.release_steps("release_many", [K1, K2, K3], [T1, T2, T3])
    assert rig.run(steps, [0, 1, 0], [1, 0]) == [True, True, False]
    assert rig.sent[1] == [evalsha(RELEASE, K1, T1), evalsha(RELEASE, K3, T3)]


@pytest.mark.parametrize("refusal", ["OOM command not allowed when used memory > 'maxmemory'.", "WRONGTYPE Op"])
def test_lua_free_refused_oom_or_wrongtype_goes_by_script(rig: Rig, refusal: str) -> None:
    ex = rig.exchange(REDIS84)
    assert rig.run(ex.extend_steps("extend", [K1], [T1], TTL), [err(refusal)], [1]) == [True]
    assert rig.sent == [[(b"SET", K1, T1, b"IFEQ", T1, b"PX", MS)], [evalsha(EXTEND, K1, T1, MS)]]
    assert rig.run(ex.release_steps("release", [K1], [T1]), [err(refusal)], [0]) == [False]
    assert rig.sent == [[(b"DELEX", K1, b"IFEQ", T1)], [evalsha(RELEASE, K1, T1)]]


def test_lua_free_refused_otherwise_is_the_calls_error(rig: Rig) -> None:
    ex = rig.exchange(VALKEY9)
    text = rig.fails(ex.extend_steps("extend", [K1], [T1], TTL), [err("ERR unknown command 'SET IFEQ'")])
    assert text.startswith("extend failed: the server replied ERR unknown command") and len(rig.sent) == 1


def test_a_permit_goes_by_script_on_a_lua_free_server(rig: Rig) -> None:
    ex = rig.exchange(VALKEY9)
    permit = T1 + b"#" + b"17"
    assert rig.run(ex.release_steps("release", [K1], [permit]), [1]) == [True]
    assert rig.sent == [[evalsha(RELEASE, K1, permit)]]


# -- other error replies -------------------------------------------------------------------------


@pytest.mark.parametrize("call", ["acquire", "extend", "release", "incr"])
def test_another_error_reply_is_the_calls_error_at_once(rig: Rig, call: str) -> None:
    ex = rig.exchange()
    oom = "OOM command not allowed when used memory > 'maxmemory'."
    replies = [b"OK", err(oom), b"QUEUED", err("EXECABORT Transaction discarded")] if call == "acquire" else [err(oom)]
    text = rig.fails(_call(ex, call), replies)
    assert text == f"{call} failed: the server replied {oom} on key 'lock:k1' (server {SERVER})"
    assert len(rig.sent) == 1 and not rig.pauses


def test_a_declined_reply_is_none_not_an_error(rig: Rig) -> None:
    ex = rig.exchange()
    info = ex.command_steps("INFO", None, (b"INFO",), _exchange.is_text, declined=_exchange.no_permission)
    assert rig.run(info, [err("NOPERM no INFO for you")]) is None
    info = ex.command_steps("INFO", None, (b"INFO",), _exchange.is_text, declined=_exchange.no_permission)
    assert rig.fails(info, [err("ERR nope")]) == f"INFO failed: the server replied ERR nope (server {SERVER})"


# -- wait_replicas -----------------------------------------------------------------------------


def test_wait_rides_behind_the_acquires_and_extends(rig: Rig) -> None:
    ex = rig.exchange(wait_replicas=1)
    assert rig.run(acquire(ex, [K1], [T1]), [*FREE, 1]) == [FENCE]
    assert rig.sent == [[*taken(K1, T1), WAIT]]
    assert rig.run(ex.extend_steps("extend", [K1], [T1], TTL), [1, 2]) == [True]
    assert rig.sent == [[evalsha(EXTEND, K1, T1, MS), WAIT]]
    # Not behind a release: it frees, nothing to confirm.
    assert rig.run(ex.release_steps("release", [K1], [T1]), [1]) == [True]
    assert rig.sent == [[evalsha(RELEASE, K1, T1)]]
    # A Lua-free server's extend goes by script under wait_replicas (one WAIT for all).
    ex = rig.exchange(VALKEY9, wait_replicas=1)
    assert rig.run(ex.extend_steps("extend", [K1], [T1], TTL), [1, 1]) == [True]
    assert rig.sent == [[evalsha(EXTEND, K1, T1, MS), WAIT]]


def test_an_acquire_too_few_replicas_confirmed_is_undone(rig: Rig) -> None:
    ex = rig.exchange(wait_replicas=1)
    text = rig.fails(acquire(ex, [K1, K2], [T1, T2]), [*FREE, *HELD, 0], [-10, 0], [1])
    assert text == f"acquire undone: 0 of 1 replicas confirmed it within 500 ms (wait_replicas) (server {SERVER})"
    # The held key went by script with its own WAIT; only the key taken is released.
    assert rig.sent == [
        [*taken(K1, T1), *taken(K2, T2), WAIT],
        [evalsha(ACQUIRE, K2, T2, MS), WAIT],
        [evalsha(RELEASE, K1, T1)],
    ]


def test_a_failed_undo_still_reports_the_replicas(rig: Rig) -> None:
    ex = rig.exchange(wait_replicas=1)
    text = rig.fails(acquire(ex, [K1], [T1]), [*FREE, 0], Failure("connection refused"))
    assert text.startswith("acquire undone: 0 of 1 replicas")


def test_extends_too_few_replicas_confirmed_are_lost_and_released(rig: Rig) -> None:
    ex = rig.exchange(wait_replicas=1)
    with pytest.raises(Unreplicated) as info:
        rig.run(ex.extend_steps("extend_many", [K1, K2], [T1, T2], TTL), [1, 0, 0], [1])
    assert info.value.results == [False, False]
    assert info.value.why == {
        0: "is lost: extend_many undone: 0 of 1 replicas confirmed it within 500 ms (wait_replicas)"
    }
    assert rig.sent == [
        [evalsha(EXTEND, K1, T1, MS), evalsha(EXTEND, K2, T2, MS), WAIT],
        [evalsha(RELEASE, K1, T1)],
    ]
    # An extend that found nothing wrote nothing to confirm: no loss to tell.
    assert rig.run(ex.extend_steps("extend", [K1], [T1], TTL), [0, 0]) == [False]


# -- a batch's error reply to some of its calls ----------------------------------------------------


def test_a_transient_reply_to_some_of_a_batch_resends_only_those(rig: Rig) -> None:
    ex = rig.exchange()
    # The first release ran: sent again it would find its key gone and say False.
    steps = ex.release_steps("release_many", [K1, K2, K3], [T1, T2, T3])
    assert rig.run(steps, [1, err(TRANSIENT["LOADING"]), 0], [1]) == [True, True, False]
    assert rig.sent[1] == [evalsha(RELEASE, K2, T2)]
    # NOAUTH on one of them (nothing of it ran) likewise.
    steps = ex.release_steps("release_many", [K1, K2], [T1, T2])
    assert rig.run(steps, [err("NOAUTH Authentication required."), 1], [1]) == [True, True]
    assert rig.sent[1] == [evalsha(RELEASE, K1, T1)]
    # And on a Lua-free server, where a refusal the script serves is decided too.
    ex = rig.exchange(VALKEY9)
    steps = ex.release_steps("release_many", [K1, K2, K3], [T1, T2, T3])
    assert rig.run(steps, [1, err(TRANSIENT["BUSY"]), err("WRONGTYPE Op")], [1], [0]) == [True, True, False]
    assert rig.sent[1:] == [[(b"DELIFEQ", K2, T2)], [evalsha(RELEASE, K3, T3)]]


def test_the_fewest_replicas_of_a_batchs_tries_decide(rig: Rig) -> None:
    ex = rig.exchange(wait_replicas=1)
    steps = ex.extend_steps("extend_many", [K1, K2], [T1, T2], TTL)
    # K1's extend ran behind a WAIT that confirmed none; K2's resend behind one that did.
    with pytest.raises(Unreplicated) as info:
        rig.run(steps, [1, err(TRANSIENT["LOADING"]), 0], [1, 1], [1, 1])
    assert sorted(info.value.why) == [0, 1]
    assert rig.sent[1] == [evalsha(EXTEND, K2, T2, MS), WAIT]
    assert rig.sent[2] == [evalsha(RELEASE, K1, T1), evalsha(RELEASE, K2, T2)]


def test_the_budget_runs_from_the_calls_start_not_its_first_failure(rig: Rig) -> None:
    ex = rig.exchange()
    # The first reply took most of the timeout: the pauses get what is left of it.
    steps = ex.extend_steps("extend", [K1], [T1], TTL)
    text = rig.fails(steps, Took(0.9 * T, [err(TRANSIENT["LOADING"])]), Always([err(TRANSIENT["LOADING"])]))
    assert "retried" in text and sum(rig.pauses) == pytest.approx(0.1 * T, abs=0.002)
    # A NotSent that came late: the one more try gets what is left of two timeouts.
    assert rig.run(_call(ex, "set_nx"), Took(1.5 * T, NotSent("connection refused")), [b"OK"]) == b"OK"
    assert rig.sends[1].timeout == pytest.approx(0.5 * T)
