"""Schedule, the renewer's decisions (which leases to extend now, which are lost), on a
clock the test moves: real Lease and Held records, no renewer thread, no server."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from hotlock._lock import TAKEN, UNCONFIRMED, Lease
from hotlock._renewer import EARLY, RENEW_AFTER, RETRY_AFTER, Held, Schedule


class Backend:
    server = "unit:0"
    fenced = True


class Renewer:
    """The renewer a Held reports to; the Schedule is what is under test, so nothing here."""

    def _forget(self, rec: Held) -> None: ...
    def _let_go(self, rec: Held, token: bytes) -> None: ...
    def _touch(self, rec: Held) -> None: ...
    def _on_lost(self, rec: Held, callback: Callable[[Lease], object]) -> None: ...


def held(ttl_ms: int, at: float, max_hold_ms: int | None = None, key: str = "k") -> Held:
    lease = Lease(Backend(), key, key.encode(), b"t" * 16, 1, ttl_ms, at)
    rec = Held(Renewer(), lease, max_hold_ms)
    lease._auto = rec
    return rec


def test_a_lease_is_renewed_once_a_third_of_its_ttl_has_run() -> None:
    schedule, rec = Schedule(), held(3000, at=0.0)
    schedule.add(rec)
    assert schedule.next_wake() == pytest.approx(3.0 * RENEW_AFTER)
    assert schedule.take(0.99) == ([], [])
    send, tell = schedule.take(1.0)
    assert send == [rec] and tell == [] and rec.sending
    assert schedule.take(1.5) == ([], [])  # in flight: not sent twice


def test_leases_of_one_ttl_due_soon_join_a_renewal_that_is_due_now() -> None:
    schedule = Schedule()
    first, soon, later = held(3000, 0.0, key="a"), held(3000, 0.4, key="b"), held(3000, 0.6, key="c")
    for rec in (first, soon, later):
        schedule.add(rec)
    # At 1.0 the first is due; the horizon is 1.0 + 3 s * EARLY = 1.5: "soon" (due 1.4)
    # rides along, "later" (due 1.6) waits for its own turn.
    assert pytest.approx(1.5) == 1.0 + 3.0 * EARLY
    send, _ = schedule.take(1.0)
    assert send == [first, soon]
    assert schedule.next_wake() == pytest.approx(1.6)


def test_nothing_is_renewed_early_when_nothing_is_due() -> None:
    schedule, rec = Schedule(), held(3000, 0.0)
    schedule.add(rec)
    assert schedule.take(0.9) == ([], [])  # within a sixth of its TTL, but nothing due at 0.9


def test_another_ttls_lease_does_not_ride_along() -> None:
    schedule, short, long_ = Schedule(), held(3000, 0.0, key="a"), held(6000, 0.0, key="b")
    schedule.add(short)
    schedule.add(long_)
    send, _ = schedule.take(1.0)
    assert send == [short]  # the 6 s lease is due at 2.0, in a cohort of its own
    assert schedule.next_wake() == pytest.approx(2.0)


def test_a_confirmed_extend_moves_the_deadline_and_the_next_renewal() -> None:
    schedule, rec = Schedule(), held(3000, 0.0)
    schedule.add(rec)
    (sent,), _ = schedule.take(1.0)
    schedule.applied([sent], [True], 3000, sent=1.0, now=1.002)
    assert rec.lease._deadline == pytest.approx(4.0) and not rec.sending
    assert schedule.next_wake() == pytest.approx(2.0)


def test_a_failed_round_trip_is_tried_again_soon_and_the_deadline_still_tells_the_loss() -> None:
    schedule, rec = Schedule(), held(3000, 0.0)
    schedule.add(rec)
    schedule.take(1.0)
    schedule.applied([rec], None, 3000, sent=1.0, now=1.5)  # Redis unreachable
    assert schedule.next_wake() == pytest.approx(1.5 + 3.0 * RETRY_AFTER)
    for now in (1.8, 2.1, 2.4, 2.7):
        send, tell = schedule.take(now)
        assert tell == []
        schedule.applied(send, None, 3000, sent=now, now=now)
    send, tell = schedule.take(3.0)  # the deadline, before any extend was confirmed
    assert tell == [rec] and rec.told and rec.lease._loss == UNCONFIRMED


def test_an_extend_that_finds_another_token_is_a_loss_told_at_once() -> None:
    schedule, rec = Schedule(), held(3000, 0.0)
    schedule.add(rec)
    schedule.take(1.0)
    schedule.applied([rec], [False], 3000, sent=1.0, now=1.001)
    assert schedule.take(1.001) == ([], [rec])
    assert rec.lease._loss == TAKEN
    assert schedule.take(5.0) == ([], [])  # told once


def test_an_extend_too_few_replicas_confirmed_is_a_loss_told_at_once_with_its_reason() -> None:
    schedule, one, two = Schedule(), held(3000, 0.0, key="a"), held(3000, 0.0, key="b")
    schedule.add(one)
    schedule.add(two)
    assert schedule.take(1.0) == ([one, two], [])
    why = "is lost: extend_many undone: 0 of 1 replicas confirmed it within 100 ms (wait_replicas)"
    schedule.applied([one, two], [False, True], 3000, sent=1.0, now=1.1, why={0: why})
    assert schedule.take(1.1) == ([], [one])
    assert one.lease._loss == why and two.lease._loss is None


def test_a_confirmation_after_the_deadline_does_not_undo_the_loss() -> None:
    schedule, rec = Schedule(), held(3000, 0.0)
    schedule.add(rec)
    schedule.take(1.0)
    _, tell = schedule.take(3.0)
    assert tell == [rec]
    schedule.applied([rec], [True], 3000, sent=1.0, now=3.2)
    assert rec.lease._deadline == pytest.approx(3.0)  # not moved: the work was told


def test_max_hold_caps_the_last_renewal_and_ends_the_lease() -> None:
    schedule, rec = Schedule(), held(3000, 0.0, max_hold_ms=4500)
    schedule.add(rec)
    (sent,), _ = schedule.take(1.0)
    assert rec.capped(3000, 1.0) == 3000
    schedule.applied([sent], [True], 3000, sent=1.0, now=1.0)
    (sent,), _ = schedule.take(2.0)
    # Only what is left of max_hold is asked, so the key expires by itself at 4.5.
    assert rec.capped(3000, 2.0) == 2500
    schedule.applied([sent], [True], 2500, sent=2.0, now=2.0)
    assert rec.capped_out
    assert schedule.take(4.49) == ([], [])  # capped out: nothing more to renew
    _, tell = schedule.take(4.5)
    assert tell == [rec] and "max_hold" in (rec.lease._loss or "")


def test_a_released_lease_is_dropped_not_renewed() -> None:
    schedule, rec = Schedule(), held(3000, 0.0)
    schedule.add(rec)
    rec.lease._token = b""  # unlock() ran
    assert schedule.take(1.0) == ([], [])
    assert rec.gone and schedule.next_wake() is None


def test_a_lease_extended_by_hand_with_another_ttl_moves_to_that_cohort() -> None:
    schedule, rec = Schedule(), held(3000, 0.0)
    schedule.add(rec)
    rec.lease._extended(True, 9000, 0.5)  # extend(9) by hand at 0.5
    schedule.touch(rec, 0.5)
    assert schedule.next_wake() == pytest.approx(0.5 + 9.0 * RENEW_AFTER)
    assert schedule.take(1.0) == ([], [])
    assert schedule.take(3.5)[0] == [rec]
