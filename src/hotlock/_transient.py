"""The resend rules, defined once for every path (native and redis-py, sync and async,
cluster and Sentinel): how long a call may be resent, and the transient replies, the error
replies that say the command did not run and that the same command may succeed in a moment.

A call whose reply was lost (a timeout, a dropped connection) is resent once, with the same
token, and a call that met a transient reply until its budget ends: ``resend_until``. The
extension keeps a copy of that one line in C (NativeBackend._rule), which
tests/unit/test_transient.py holds to this one.

A failover behind one endpoint (a DNS name or a proxy that now points at the promoted
replica), a server loading its data set, a long script, a cluster electing a primary or
migrating a slot: each answers for a few hundred milliseconds with one of

- ``READONLY``: the endpoint reaches a replica now (a demoted primary); every pooled
  connection of the cache to that server is dropped, not only the caller's;
- ``LOADING``: the server is loading its data set;
- ``BUSY``: a script or function is running past the busy threshold;
- ``MASTERDOWN``: a replica that lost its primary and serves no stale data;
- ``TRYAGAIN``: a multi-key command during a slot migration (a cluster);
- ``CLUSTERDOWN``: the cluster lost a shard or is electing a primary.

None of them means the command ran, so resending it is always safe, whatever it is (an
``INCRBY`` and a ``SET NX`` included), and an acquire resent with its own token is still
one lock. The caller resends on a fresh connection (the host resolved again), after a
jittered backoff, until the call's own timeout would pass; only then is the reply raised
as a ``CacheError`` that names it and says it was retried. A reply that is not one of
these (``NOSCRIPT`` aside, which each path recovers by loading the scripts) is raised at
once: the rule never resends what may have run.
"""

from __future__ import annotations

import random

__all__ = ["CAP_S", "FIRST_S", "TRANSIENT", "Retrying", "code", "pause_s", "resend_until", "tried"]

TRANSIENT = frozenset({"READONLY", "LOADING", "BUSY", "MASTERDOWN", "TRYAGAIN", "CLUSTERDOWN"})

# The first pause, doubled after each transient reply up to CAP_S. A failover behind an
# endpoint, a SCRIPT KILL or a cluster election ends within a few hundred milliseconds:
# 5 ms first catches the short ones, and the cap keeps 16 threads from hammering a
# loading server while still trying about ten times a second.
FIRST_S = 0.005
CAP_S = 0.1


def resend_until(start: float, wait_s: float, timeout: float) -> float:
    """Until when a call begun at ``start`` (on the caller's clock) may be resent: a call
    that may wait ``wait_s`` (lock_wait) ends within max(wait, one reply timeout) plus one
    reply timeout, lost reply or not."""
    return start + max(wait_s, timeout) + timeout


def code(text: str | bytes) -> str | None:
    """The transient reply's code (its first word: ``BUSYKEY`` is no ``BUSY``), else None."""
    if isinstance(text, bytes):
        text = text.decode("ascii", "replace")
    word = text.split(" ", 1)[0]
    return word if word in TRANSIENT else None


def pause_s(attempt: int, left_s: float, u: float | None = None) -> float | None:
    """The sleep before the ``attempt``-th resend (counting from 0), for a call that may
    pause ``left_s`` more seconds; None when that leaves no time for another try.

    Equal jitter: a draw ``u`` in [0, 1) (random by default) spreads the threads that met
    the same reply over the upper half of a ceiling that doubles from FIRST_S to CAP_S, so
    they neither resend in step nor all come back at the first instant. Never past
    ``left_s``: the last try comes at the end of the budget, not after it."""
    if left_s < 0.001:
        return None
    ceiling = min(CAP_S, FIRST_S * 2.0 ** min(attempt, 32))
    draw = random.random() if u is None else u
    return min(ceiling * (0.5 + 0.5 * draw), left_s)


class Retrying:
    """One call's transient-reply retries: how many so far, and the words for its error."""

    __slots__ = ("attempts",)

    def __init__(self) -> None:
        self.attempts = 0

    def pause(self, left_s: float) -> float | None:
        """The sleep before the next resend (counted), or None: raise the reply now."""
        pause = pause_s(self.attempts, left_s)
        if pause is not None:
            self.attempts += 1
        return pause

    def tried(self, what: str) -> str:
        """``what`` as the error names it: says the reply was retried, when it was."""
        if not self.attempts:
            return what
        times = "once" if self.attempts == 1 else f"{self.attempts} times"
        return f"{what} (retried {times} within the call's timeout)"


def tried(what: str, lost: bool, transient: Retrying) -> str:
    """``what`` as a failed call's error names it: says what was retried (the one retry
    after a lost reply, resends after transient replies)."""
    return transient.tried(f"{what} (retried after a lost reply)" if lost else what)
