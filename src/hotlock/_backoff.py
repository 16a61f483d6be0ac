"""The lock_wait backoff schedule, defined once.

Full jitter (a uniform draw below an exponentially growing ceiling, from 1 ms up to a
cap), never sleeping past the caller's deadline nor past the holder's remaining TTL,
which the acquire script returns on a conflict. The native extension runs the same
schedule in C; tests/test_native.py checks it against ``delay_ms`` here.
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable

__all__ = ["BASE_MS", "CAP_MS", "Backoff", "ceiling_ms", "delay_ms", "poll"]

BASE_MS = 1.0
CAP_MS = 50.0


def ceiling_ms(attempt: int, cap_ms: float = CAP_MS) -> float:
    """The upper bound of the attempt-th sleep (attempt counts from 0)."""
    # min() on the exponent keeps 2**attempt from growing without bound in long waits.
    return min(cap_ms, BASE_MS * 2.0 ** min(attempt, 32))


def delay_ms(attempt: int, u: float, remaining_ms: float, holder_ttl_ms: int, cap_ms: float = CAP_MS) -> float:
    """The sleep after a failed attempt, for a uniform draw ``u`` in [0, 1).

    ``holder_ttl_ms`` is the holder's PTTL (> 0) as the acquire script returned it (its
    result negated), or <= 0 when it is unknown. Waking when the holder's key expires is the earliest useful moment.
    """
    d = u * ceiling_ms(attempt, cap_ms)
    if holder_ttl_ms > 0:
        d = min(d, float(holder_ttl_ms))
    return max(0.0, min(d, remaining_ms))


class Backoff:
    """One lock_wait's schedule: call ``next_sleep`` after each failed attempt."""

    __slots__ = ("_attempt", "_cap_ms", "deadline")

    def __init__(self, wait_ms: int, cap_ms: float = CAP_MS) -> None:
        self.deadline = time.monotonic() + wait_ms / 1000.0
        self._attempt = 0
        self._cap_ms = cap_ms

    def next_sleep(self, holder_ttl_ms: int) -> float | None:
        """Seconds to sleep before the next attempt, or None when the deadline has passed.

        ``holder_ttl_ms`` as in delay_ms: the failed acquire's result negated."""
        remaining_ms = (self.deadline - time.monotonic()) * 1000.0
        if remaining_ms <= 0:
            return None
        d = delay_ms(self._attempt, random.random(), remaining_ms, holder_ttl_ms, self._cap_ms)
        self._attempt += 1
        return d / 1000.0


def poll(acquire: Callable[[], int], wait_ms: int) -> tuple[int, float]:
    """Run ``acquire`` on the schedule until it returns a fence (> 0) or the deadline passes.

    Returns the last result and the time.monotonic() at which that attempt was sent.
    This is the loop of the pure-Python backends; the native one runs it in C.
    """
    backoff = Backoff(wait_ms)
    while True:
        sent = time.monotonic()
        result = acquire()
        if result > 0:
            return result, sent
        sleep = backoff.next_sleep(-result)
        if sleep is None:
            return result, sent
        time.sleep(sleep)
