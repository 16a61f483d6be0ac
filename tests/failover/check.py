"""The checker: what a failover run's histories say happened.

Input: each worker's holds and errors (tests/failover/worker.py), the store's final rows
and its write log, and each data node's ROLE changes. All times are one monotonic clock.

A hold is believed from the grant's reply (``t1``) until the holder stops (``end``: its
release sent, or the moment it gave the lease up), and is *valid* only until its lease
can have run out: the acquire's send time plus the TTL, moved to each confirmed extend's
send time plus the TTL. The server set the key's expiry after those send times, so on
one primary two holds of a key never overlap inside these windows; a hold whose window another
holder's grant falls inside is a double grant.
"""

from __future__ import annotations

import itertools
from collections import defaultdict
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass
from typing import Any


@dataclass
class Result:
    grants: int = 0
    double_grants: int = 0  # holds another holder's grant of the key fell inside (while valid)
    overlap_s: float = 0.0  # seconds two holders of one key were both within their leases
    stale_refused: int = 0  # fenced writes the store refused (a higher fence had written)
    stale_accepted: int = 0  # accepted after a write of a hold granted later in real time
    lost_fenced: int = 0  # accepted fenced writes that the final value does not count
    lost_unfenced: int = 0  # counter writes that the final counter does not count
    lost_locks: int = 0  # the key was gone (extend lost, release found nothing) while valid
    errors: int = 0  # CacheError (or any error) a client saw
    max_no_grant_s: float = 0.0  # longest time without any grant, within the window
    two_primaries_s: float = 0.0  # time two data nodes both answered ROLE master

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def hold_window(h: Mapping[str, Any]) -> tuple[float, float]:
    end = h["end"] if h["end"] is not None else h["valid"]
    return h["t1"], min(end, h["valid"])


def double_grants(holds: Sequence[Mapping[str, Any]]) -> tuple[int, float]:
    """(holds whose valid window another holder's grant of the same key fell inside,
    the seconds during which two or more holders of one key were both inside theirs).

    A hold counts once however many grants fell inside it: an isolated primary renewing
    one lease while the new one hands the key out fifty times is one broken lease."""
    by_key: dict[str, list[Mapping[str, Any]]] = defaultdict(list)
    for h in holds:
        by_key[h["key"]].append(h)
    broken = 0
    overlap = 0.0
    for hs in by_key.values():
        windows = sorted(hold_window(h) for h in hs)
        for i, (a0, a1) in enumerate(windows):
            if any(a0 <= b0 < a1 for b0, _b1 in windows[i + 1 :]):
                broken += 1
        events = sorted([(a, 1) for a, b in windows if b > a] + [(b, -1) for a, b in windows if b > a])
        level = 0
        since = 0.0
        for t, d in events:
            if level >= 2:
                overlap += t - since
            level += d
            since = t
    return broken, overlap


def stale_accepted(holds: Sequence[Mapping[str, Any]], log: Iterable[Sequence[Any]]) -> int:
    """Accepted fenced writes that came after (in the store's order) an accepted write by
    a hold granted strictly later in real time: a stale holder the fence did not stop.

    ``log`` rows are (seq, key, hold id, fence, accepted, t) in commit order."""
    by_id = {h["id"]: h for h in holds}
    latest_req: dict[str, float] = {}  # per key: the latest grant request time written so far
    count = 0
    for _seq, key, hid, _fence, accepted, _t in sorted(log, key=lambda r: r[0]):
        if not accepted or hid not in by_id:
            continue
        h = by_id[hid]
        if latest_req.get(key, float("-inf")) > h["t1"]:
            count += 1
        latest_req[key] = max(latest_req.get(key, float("-inf")), h["t0"])
    return count


def two_primaries(roles: Mapping[str, Sequence[Sequence[Any]]]) -> float:
    """Seconds during which two or more nodes answered ROLE ``master`` (from each node's
    list of (time, role) changes, the last one "end")."""
    events = []
    for changes in roles.values():
        for (t, role), nxt in itertools.pairwise(changes):
            if role == "master":
                events.append((t, 1))
                events.append((nxt[0], -1))
    events.sort()
    total = 0.0
    level = 0
    since = 0.0
    for t, d in events:
        if level >= 2:
            total += t - since
        level += d
        since = t
    return total


def check(
    workers: Sequence[Mapping[str, Any]],
    final: Mapping[str, tuple[int, int]],
    log: Sequence[Sequence[Any]],
    roles: Mapping[str, Sequence[Sequence[Any]]],
    window: tuple[float, float],
) -> Result:
    """``final``: key -> (fenced value, counter value) at the end. ``window``: the span
    (from the fault's start) over which the longest time without a grant is measured."""
    holds = [h for w in workers for h in w["holds"]]
    r = Result(grants=len(holds))
    r.double_grants, r.overlap_s = double_grants(holds)
    r.stale_refused = sum(1 for h in holds for w in h["writes"] if not w[2])
    r.stale_accepted = stale_accepted(holds, log)
    accepted: dict[str, int] = defaultdict(int)
    counted: dict[str, int] = defaultdict(int)
    for h in holds:
        accepted[h["key"]] += sum(1 for w in h["writes"] if w[2])
        if h["counter"] is not None:
            counted[h["key"]] += 1
    r.lost_fenced = sum(accepted[k] - final[k][0] for k in final)
    r.lost_unfenced = sum(counted[k] - final[k][1] for k in final)
    for h in holds:
        # By the reply's time: a call can leave well after it was made (a client that
        # cannot reach the sentinels asks them first), and a key found gone by a reply
        # that came back while the lease was still valid was certainly lost early.
        gone = [e[1] for e in h["extends"] if e[2] == "lost"]
        if h["release"] is not None and h["release"][2] == "gone":
            gone.append(h["release"][1])
        if any(t < h["valid"] for t in gone):
            r.lost_locks += 1
    r.errors = sum(len(w["errors"]) for w in workers)
    start, stop = window
    times = sorted([start, *(h["t1"] for h in holds if start <= h["t1"] <= stop), stop])
    r.max_no_grant_s = max((b - a for a, b in itertools.pairwise(times)), default=0.0)
    r.two_primaries_s = two_primaries(roles)
    return r
