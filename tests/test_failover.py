"""The failover harness's short form (the long one is ``make failover``, tests/failover/).

Each test builds its own network namespaces (a primary, two replicas, three sentinels,
clients on both sides of a link it can cut), runs the seeded workload through one fault
with trimmed phases, and checks the histories. Linux and root (``ip netns``) are needed:
without them these tests fail, saying so; CI has both.
"""

from __future__ import annotations

import os

import pytest

from .failover.cells import Cell, Run, run_cell
from .failover.topology import PREFIX, cleanup_stale, ip, netns_available

SEED = 7


@pytest.fixture(scope="module", autouse=True)
def netns() -> None:
    why = netns_available()
    if why is not None:
        pytest.fail(f"the failover tests need Linux network namespaces (ip netns, as root): {why}")
    cleanup_stale()


def run(cell: Cell) -> Run:
    r = run_cell(cell, SEED, short=True)
    # Whatever the run did, it leaves no namespace (nor, so, any process inside one) behind.
    mine = f"{PREFIX}{os.getpid()}-"
    assert not [n for n in ip("netns", "list").stdout.split() if n.startswith(mine)]
    return r


def describe(run: Run) -> str:
    return f"{run.cell.label}: {run.result.as_dict()} {run.notes}"


def test_no_fault_no_overlap() -> None:
    """With nothing injected the lock holds: no double grant, no lost update or lock, no
    write refused. (Sentinel's 5 s detection: a loaded machine must not fail over.)"""
    r = run(Cell("none", "defaults", detect_s=5))
    res = r.result
    assert res.grants > 20, describe(r)
    assert res.double_grants == 0 and res.overlap_s == 0, describe(r)
    assert res.stale_refused == res.stale_accepted == 0, describe(r)
    assert res.lost_fenced == res.lost_unfenced == res.lost_locks == 0, describe(r)
    assert res.two_primaries_s == 0, describe(r)


def test_checker_sees_a_broken_lock() -> None:
    """The control: the same workload with the lock skipped. The checker must report the
    overlaps and the lost unfenced updates, or its zeros elsewhere mean nothing."""
    r = run(Cell("none", nolock=True))
    assert r.result.double_grants > 0, describe(r)
    assert r.result.lost_unfenced > 0, describe(r)


@pytest.mark.parametrize(
    "fault",
    ["cut-primary", "cut-primary+replica", "kill-9", "sigstop", "restart", "restart-aof"],
)
def test_fenced_store_accepts_no_stale_write(fault: str) -> None:
    """Whatever the fault does to the lock, the store that refuses a lower fence accepts
    no write of a holder after a later holder's write."""
    r = run(Cell(fault, "defaults"))
    assert r.result.grants > 10, describe(r)
    assert r.result.stale_accepted == 0, describe(r)


def test_wait_replicas_confirms_renewals() -> None:
    """The primary cut off with a lease held beside it: its renewals must be confirmed by
    a replica too, or the holder keeps a lease the promoted replica has handed on."""
    r = run(Cell("cut-primary", "wait_replicas=1", probe=True))
    assert any("failover after" in n for n in r.notes), describe(r)
    assert "no hold before the cut" not in r.notes, describe(r)
    assert r.result.double_grants == 0, describe(r)
