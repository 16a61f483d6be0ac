"""The lock_wait backoff schedule, defined once.

Full jitter (a uniform draw below an exponentially growing ceiling, from 1 ms up to a
cap), never sleeping past the caller's deadline nor past the holder's remaining TTL,
which the acquire script returns on a conflict. The native extension runs the same
schedule in C; tests/test_native.py checks it against ``delay_ms`` here.
"""

from __future__ import annotations

__all__ = ["BASE_MS", "CAP_MS", "ceiling_ms", "delay_ms"]

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
