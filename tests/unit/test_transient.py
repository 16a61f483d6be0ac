"""hotlock._transient: which replies are transient, and the pause schedule every path uses."""

from __future__ import annotations

import pytest

from hotlock import _transient
from hotlock._transient import CAP_S, FIRST_S, Retrying, code, pause_s, tried

from ..conftest import native_for_module


@pytest.mark.parametrize("word", ["READONLY", "LOADING", "BUSY", "MASTERDOWN", "TRYAGAIN", "CLUSTERDOWN"])
def test_the_six_replies_that_say_the_command_did_not_run_are_transient(word: str) -> None:
    assert code(f"{word} some text") == word
    assert code(f"{word} some text".encode()) == word
    assert code(word) == word


@pytest.mark.parametrize(
    "text",
    [
        "BUSYKEY Target key name already exists.",
        "BUSYGROUP Consumer Group name already exists",
        "ERR READONLY",
        "",
        "NOSCRIPT No matching script.",
        "OOM command not allowed",
        "MOVED 3999 127.0.0.1:7002",
        "readonly lowercase",
    ],
)
def test_other_replies_are_not_transient(text: str) -> None:
    assert code(text) is None


def test_the_pauses_double_from_the_first_to_the_cap_in_the_upper_half() -> None:
    for attempt in range(12):
        ceiling = min(CAP_S, FIRST_S * 2**attempt)
        assert pause_s(attempt, 10.0, 0.0) == pytest.approx(ceiling / 2)
        assert pause_s(attempt, 10.0, 0.999999) == pytest.approx(ceiling, rel=1e-5)
        assert ceiling / 2 <= (pause_s(attempt, 10.0) or 0.0) <= ceiling
    assert pause_s(10_000, 10.0, 0.5) == pytest.approx(0.75 * CAP_S)  # no overflow in a long run


def test_a_pause_never_passes_the_budget_and_none_when_it_is_spent() -> None:
    assert pause_s(5, 0.01, 0.9) == 0.01
    assert pause_s(0, 0.0009) is None
    assert pause_s(0, -1.0) is None


def test_retrying_counts_and_names_what_was_retried(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(_transient.random, "random", lambda: 0.0)
    retrying = Retrying()
    assert retrying.tried("acquire") == "acquire"
    assert retrying.pause(1.0) == pytest.approx(FIRST_S / 2)
    assert retrying.tried("acquire") == "acquire (retried once within the call's timeout)"
    assert retrying.pause(0.0) is None  # not counted
    assert retrying.pause(1.0) == pytest.approx(FIRST_S)
    assert retrying.tried("acquire") == "acquire (retried 2 times within the call's timeout)"
    assert tried("release", True, retrying) == (
        "release (retried after a lost reply) (retried 2 times within the call's timeout)"
    )
    assert tried("release", False, Retrying()) == "release"


@pytest.mark.parametrize(
    ("start", "wait_s", "timeout", "until"),
    [
        (100.0, 0.0, 2.0, 104.0),  # lock, extend, release: two reply timeouts
        (100.0, 1.0, 2.0, 104.0),  # a wait shorter than a reply timeout changes nothing
        (100.0, 10.0, 2.0, 112.0),  # lock_wait: its wait, then one reply timeout
        (0.0, 0.25, 0.25, 0.5),
    ],
)
def test_a_call_is_resent_within_its_wait_or_one_timeout_plus_one_timeout(
    start: float, wait_s: float, timeout: float, until: float
) -> None:
    assert _transient.resend_until(start, wait_s, timeout) == until


def test_the_c_budget_is_the_python_one() -> None:
    native = native_for_module()
    for start in (0.0, 12.5, 1e6):
        for wait_s in (0.0, 0.001, 0.5, 2.0, 30.0):
            for timeout in (0.001, 0.5, 2.0, 15.0):
                c_until = native._resend_deadline(start, wait_s, timeout)
                assert c_until == _transient.resend_until(start, wait_s, timeout)
