"""The failover checker (tests/failover/check.py) on histories written by hand: it must
see a broken lock, and must not see one in a correct handover."""

from __future__ import annotations

from typing import Any

from tests.failover.check import check, double_grants, stale_accepted, two_primaries


def hold(
    hid: str,
    key: str,
    t0: float,
    end: float,
    *,
    ttl: float = 3.0,
    fence: int = 0,
    writes: list[list[Any]] | None = None,
    counter: bool = True,
    release: str = "ok",
    extends: list[list[Any]] | None = None,
) -> dict[str, Any]:
    return {
        "id": hid,
        "key": key,
        "fence": fence or int(t0 * 1e6),
        "t0": t0,
        "t1": t0 + 0.001,
        "valid": t0 + ttl,
        "end": end,
        "lost": None,
        "writes": writes if writes is not None else [[end - 0.01, end - 0.005, True]],
        "counter": end - 0.004 if counter else None,
        "extends": extends or [],
        "release": [end, end + 0.001, release],
    }


def test_a_handover_is_not_a_double_grant() -> None:
    # The second holder's grant comes back after the first sent its release.
    holds = [hold("a:1", "k", 10.0, 10.5), hold("b:1", "k", 10.499, 10.9)]
    assert double_grants(holds) == (0, 0.0)


def test_a_grant_inside_a_valid_lease_is_one_double_grant() -> None:
    # b is granted while a holds; c and d too: one broken lease (a's), counted once,
    # and the time two held it at once.
    holds = [
        hold("a:1", "k", 10.0, 12.0),
        hold("b:1", "k", 11.0, 11.2),
        hold("c:1", "k", 11.3, 11.4),
        hold("other:1", "j", 11.0, 11.5),
    ]
    broken, overlap = double_grants(holds)
    assert broken == 1
    assert abs(overlap - (0.199 + 0.099)) < 1e-6  # from each grant's reply to its release


def test_a_hold_past_its_lease_is_not_overlapped() -> None:
    # a never released (a paused holder) but its lease ran out at 13.0: b at 13.5 is fine.
    holds = [hold("a:1", "k", 10.0, 20.0, ttl=3.0), hold("b:1", "k", 13.5, 13.6)]
    assert double_grants(holds) == (0, 0.0)


def test_stale_accepted_needs_a_later_holders_write_first() -> None:
    a = hold("a:1", "k", 10.0, 12.0)
    b = hold("b:1", "k", 11.0, 11.2)
    # b (granted after a) wrote first; a's write afterwards was accepted: stale.
    log = [(1, "k", "b:1", b["fence"], 1, 11.1), (2, "k", "a:1", a["fence"], 1, 11.9)]
    assert stale_accepted([a, b], log) == 1
    # Refused, it is not accepted; and a write of the earlier holder first is in order.
    assert stale_accepted([a, b], [(1, "k", "b:1", 0, 1, 11.1), (2, "k", "a:1", 0, 0, 11.9)]) == 0
    assert stale_accepted([a, b], [(1, "k", "a:1", 0, 1, 10.5), (2, "k", "b:1", 0, 1, 11.1)]) == 0


def test_two_primaries_is_the_time_both_say_master() -> None:
    roles = {
        "p": [[0.0, "master"], [5.0, "slave"], [9.0, "end"]],
        "r1": [[0.0, "slave"], [3.0, "master"], [9.0, "end"]],
        "r2": [[0.0, "slave"], [9.0, "end"]],
    }
    assert two_primaries(roles) == 2.0


def test_check_counts_lost_updates_lost_locks_and_errors() -> None:
    # Two overlapping holders both read 0 and wrote 1: one update lost on each store.
    a = hold("a:1", "k", 10.0, 10.5)
    b = hold("b:1", "k", 10.2, 10.6)
    # A lease found gone by a reply that came back while it was valid: a lost lock.
    c = hold("c:1", "j", 20.0, 20.5, release="gone", writes=[], counter=False)
    workers = [
        {"name": "a", "holds": [a, c], "errors": [{"op": "acquire", "t": 1.0, "msg": "CacheError"}]},
        {"name": "b", "holds": [b], "errors": []},
    ]
    log = [(1, "k", "a:1", a["fence"], 1, 10.49), (2, "k", "b:1", b["fence"], 1, 10.59)]
    r = check(workers, {"k": (1, 1), "j": (0, 0)}, log, {}, (0.0, 30.0))
    assert r.grants == 3
    assert r.double_grants == 1
    assert r.lost_fenced == 1 and r.lost_unfenced == 1
    assert r.lost_locks == 1
    assert r.errors == 1
    assert r.stale_accepted == 0 and r.stale_refused == 0
    assert abs(r.max_no_grant_s - 10.001) < 1e-6  # from the window's start to the first grant
