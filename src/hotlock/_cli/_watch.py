"""`hotlock watch`: the held locks and the lock traffic, refreshed every second.

The traffic comes from INFO commandstats, which counts the commands a script calls under
their own names. So, of hotlock's calls: every failed acquire (a waiter's poll, a try-once
conflict) ends in the script's PTTL, every extend PEXPIRE, every release DEL
(DELIFEQ/DELEX on the Lua-free path). They are the server's counters, so another client's
PTTL or DEL on the same server counts too; watch's own PTTLs are subtracted. The
acquisitions are the releases plus the change in held locks: a free key is taken by a
transaction whose commands are the same whether it took the key or found it held, so no
counter tells them apart (a lock that expires unreleased is not counted).
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from typing import Any, TextIO

import redis

from ._locks import HeldLock, scan_locks
from ._target import CliError, Target, shown_key

__all__ = ["watch"]

# rate name -> the commandstats entries it sums ("acquired": see the module docstring)
RATES: dict[str, tuple[str, ...]] = {
    "acquired": (),
    "failed_attempts": ("pttl",),
    "extended": ("pexpire",),
    "released": ("del", "delifeq", "delex"),
    "scripts": ("evalsha", "eval", "evalsha_ro", "eval_ro"),
}
LABELS = {
    "acquired": ("acquisitions/s", "releases + the change in held locks"),
    "failed_attempts": ("waits/s", "PTTL: each acquire that found the lock held (a waiter's poll or a conflict)"),
    "extended": ("extends/s", "PEXPIRE"),
    "released": ("releases/s", "DEL"),
    "scripts": ("scripts/s", "EVALSHA + EVAL"),
}


@dataclass
class Sample:
    at: float  # monotonic
    wall: float
    locks: list[HeldLock]
    calls: dict[str, int]
    own_pttl: int
    rates: dict[str, float | None] = field(default_factory=dict)


def _calls(target: Target) -> dict[str, int]:
    """commandstats calls per command, summed over every primary."""
    total: dict[str, int] = {}
    for node in target.nodes:
        try:
            stats = node.client.info("commandstats")
        except redis.ResponseError as exc:
            raise CliError(f"INFO commandstats refused by {node.address}: {exc}") from None
        for name, entry in stats.items():
            command = name.removeprefix("cmdstat_").lower()
            if isinstance(entry, dict):
                total[command] = total.get(command, 0) + int(entry.get("calls", 0))
    return total


def sample(target: Target, previous: Sample | None) -> Sample:
    before = _calls(target)
    locks, own = scan_locks(target)
    now = Sample(time.monotonic(), time.time(), locks, before, own)
    if previous is None:
        now.rates = dict.fromkeys(RATES)
        return now
    elapsed = max(now.at - previous.at, 1e-6)
    for rate, commands in RATES.items():
        delta = sum(before.get(c, 0) - previous.calls.get(c, 0) for c in commands)
        if rate == "failed_attempts":
            delta -= previous.own_pttl  # our own scan's PTTLs, counted since the last sample
        now.rates[rate] = max(delta, 0) / elapsed
    released = now.rates["released"] or 0.0
    now.rates["acquired"] = max(released * elapsed + len(locks) - len(previous.locks), 0) / elapsed
    return now


def longest(locks: list[HeldLock]) -> HeldLock | None:
    """The lock held longest (by its fence), else the one with the most TTL left."""
    aged = [lk for lk in locks if lk.held is not None]
    if aged:
        return max(aged, key=lambda lk: lk.held or 0.0)
    timed = [lk for lk in locks if lk.ttl is not None]
    return max(timed, key=lambda lk: lk.ttl or 0.0) if timed else (locks[0] if locks else None)


def as_json(s: Sample) -> dict[str, Any]:
    top = longest(s.locks)
    return {
        "time": round(s.wall, 3),
        "held": len(s.locks),
        "longest": None if top is None else top.as_json(),
        "rates": {k: None if v is None else round(v, 1) for k, v in s.rates.items()},
    }


def _rate(value: float | None) -> str:
    return "-" if value is None else f"{value:.1f}"


def frame(target: Target, s: Sample) -> str:
    from ._output import duration

    top = longest(s.locks)
    if top is None:
        top_line = "-"
    else:
        parts = [shown_key(top.key)]
        if top.held is not None:
            parts.append(f"held {duration(top.held)}")
        parts.append("no TTL" if top.ttl is None else f"{duration(top.ttl)} left")
        top_line = ", ".join(parts)
    stamp = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(s.wall))
    lines = [
        f"hotlock watch  {target.display}  prefix {target.prefix.decode('utf-8', 'backslashreplace')!r}  {stamp}",
        "",
        f"{'held locks':<16}{len(s.locks)}",
        f"{'longest held':<16}{top_line}",
        "",
    ]
    for rate, (label, why) in LABELS.items():
        lines.append(f"{label:<16}{_rate(s.rates[rate]):>10}   {why}")
    lines += ["", "Ctrl-C to quit"]
    return "\n".join(lines)


def line(s: Sample) -> str:
    """One line per refresh, for a pipe or a log."""
    top = longest(s.locks)
    stamp = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(s.wall))
    fields = [stamp, f"held={len(s.locks)}"]
    if top is not None:
        fields.append(f"longest={shown_key(top.key)!r}")
    fields += [f"{LABELS[k][0]}={_rate(v)}" for k, v in s.rates.items()]
    return " ".join(fields)


def watch(target: Target, *, interval: float, count: int | None, as_json_lines: bool, out: TextIO) -> int:
    """Refresh until Ctrl-C (or ``count`` refreshes). On a terminal, a full-screen view on
    the alternate screen, restored on exit; otherwise one line (or JSON object) per refresh."""
    screen = out.isatty() and not as_json_lines
    previous: Sample | None = None
    shown = 0
    try:
        if screen:
            out.write("\x1b[?1049h\x1b[?25l")  # alternate screen, cursor hidden
        while count is None or shown < count:
            previous = sample(target, previous)
            if as_json_lines:
                out.write(json.dumps(as_json(previous)) + "\n")
            elif screen:
                out.write("\x1b[H\x1b[J" + frame(target, previous) + "\n")
            else:
                out.write(line(previous) + "\n")
            out.flush()
            shown += 1
            if count is None or shown < count:
                time.sleep(interval)
    except KeyboardInterrupt:
        pass
    finally:
        if screen:
            out.write("\x1b[?25h\x1b[?1049l")  # cursor shown, the terminal as it was
            out.flush()
    if screen and previous is not None:
        # The alternate screen is gone: leave the last view's one-line summary behind
        # (over the "^C" the terminal echoed, if it did).
        out.write("\r\x1b[K" + line(previous) + "\n")
        out.flush()
    return 0
