"""The acquire of a free key without Lua: one transaction, and what its reply says.

    MULTI
    SET <key> <token> NX PX <ms>
    TIME
    EXEC

EXEC replies ``[OK, [seconds, microseconds]]`` when the key was free: it now holds the
token with the TTL, and the fence is TIME's clock in microseconds, read in the same atomic
step as the SET (a transaction runs whole, nothing between its commands), exactly as the
ACQUIRE script reads it. That is the common acquire, and it costs the server what a bare
``SET NX PX`` and a ``TIME`` cost: no script (a script costs about 3 us before it runs
anything; see docs/performance.md, "The server's cost per lock").

Every other outcome is left to the ACQUIRE script (hotlock._scripts), sent next, which
decides it with the returns the caller knows: the key held by another (-its TTL), held by
this token (a resend after a lost reply: the TTL refreshed and a later fence), held as
permits, or a hash of permits none of which is live. So a conflict costs a second round
trip, and the uncontended acquire one without Lua. The waiting forms (ACQUIRE_WAIT,
ACQUIRE_CHAIN) and permits (a limit) always go by script: they are the contended path.

Under connect(fences=False) the acquire of a free key is ``SET <key> <token> NX PX <ms>``
alone: no clock is read, the lock's fence is 0, and its one reply, OK or nil, says the same
(``TAKEN``, or SCRIPT: the key exists). No MULTI is sent, so none can be refused.

A transport sends ``commands`` in one write and hands their replies to ``read``: the
fence, or ``SCRIPT`` (send the ACQUIRE script instead), or the one reply that is an error,
which the transport treats as it treats a script's error reply (NOAUTH, a transient reply,
MOVED, OOM...). A MULTI refused alone (an ACL without it, a proxy that has no transactions)
leaves SET and TIME to run on their own, outside any transaction: the SET may have taken
the key, so that call goes by script too (which finds its own token there), and so does
every later acquire on that server (``refused_multi``). The extension reads
the replies in C (ext/_sync.pxi, ext/_aio.pxi) by these same rules;
tests/unit/test_acquire.py holds the two to the same answers.
"""

from __future__ import annotations

import logging
from typing import Final

from ._credentials import is_auth_refusal

__all__ = ["SCRIPT", "TAKEN", "commands", "fence_of", "read", "refused_multi", "warn_refused"]

log = logging.getLogger("hotlock")

# read()'s answer when the ACQUIRE script is to decide this call.
SCRIPT: Final = 0
# read()'s answer when SET NX PX alone took the key (fences off): > 0 as a fence is, so a
# caller tells "taken" as it does from a fence; the lock's fence is 0 (Lease).
TAKEN: Final = 1


def commands(key: bytes, token: bytes, ttl_ms: int, fenced: bool = True) -> tuple[tuple[bytes, ...], ...]:
    """The transaction, as four commands written together; SET NX PX alone when not ``fenced``."""
    take = (b"SET", key, token, b"NX", b"PX", b"%d" % ttl_ms)
    return ((b"MULTI",), take, (b"TIME",), (b"EXEC",)) if fenced else (take,)


def _clock_part(part: object) -> int | None:
    """One of TIME's two numbers: up to 18 ASCII digits (or an integer reply), as the C
    reader takes them; None otherwise."""
    if type(part) is int:
        return part
    if isinstance(part, str):
        part = part.encode()
    if isinstance(part, bytes) and 0 < len(part) <= 18 and part.isdigit():
        return int(part)
    return None


def fence_of(time_reply: object) -> int | None:
    """TIME's reply, [seconds, microseconds] as bytes (or ints), as the fence: the clock in
    microseconds; None when it is not that shape."""
    if not isinstance(time_reply, (list, tuple)) or len(time_reply) != 2:
        return None
    seconds, micros = _clock_part(time_reply[0]), _clock_part(time_reply[1])
    if seconds is None or micros is None or not 0 < seconds <= 9_000_000_000_000 or not 0 <= micros < 1_000_000:
        return None
    return seconds * 1_000_000 + micros


def read(replies: list[object], error: type[BaseException]) -> int | BaseException:
    """The replies to ``commands`` (error replies as instances of ``error``): the fence
    (> 0) when the key was taken (TAKEN for SET alone), SCRIPT when the ACQUIRE script is
    to decide, or the error reply the call failed with, to be treated as a script's (the
    first one of SET, TIME, EXEC: a queued command refused makes EXEC refuse the whole,
    EXECABORT, so SET's own error names why). A MULTI refused NOAUTH or WRONGPASS is that error, whatever
    came after it: this connection is not authenticated, never a server without
    transactions."""
    if len(replies) == 1:  # SET NX PX alone
        (taken,) = replies
        if isinstance(taken, error):
            return taken
        return TAKEN if taken in (b"OK", "OK", True) else SCRIPT
    if isinstance(replies[0], error) and is_auth_refusal(str(replies[0])):
        return replies[0]
    if refused_multi(replies, error):
        return SCRIPT
    for reply in replies[1:]:
        if isinstance(reply, error):
            return reply
    exec_reply = replies[3]
    if isinstance(exec_reply, (list, tuple)) and len(exec_reply) == 2:
        taken, clock = exec_reply
        if taken is None:
            return SCRIPT  # the key exists: held, ours after a lost reply, or permits
        if taken in (b"OK", "OK", True):
            fence = fence_of(clock)
            if fence is not None:
                return fence
    return SCRIPT  # a shape no server sends: the script asks again, and its reply is checked


def warn_refused(where: str, reply: object) -> None:
    """The one WARNING a backend (or a cluster, per node) gives when MULTI is first
    refused alone: ``where`` the server, ``reply`` what it replied."""
    log.warning("%s refused MULTI (%s): its acquires go by the ACQUIRE script from now on", where, reply)


def refused_multi(replies: list[object], error: type[BaseException]) -> bool:
    """Whether MULTI alone was refused and SET then ran on its own (it replied, no error):
    this server, or what stands before it, has no transactions for us (an ACL without
    MULTI, a proxy), and the acquire goes by script from now on. A MULTI refused with
    the SET (a server loading), or refused NOAUTH/WRONGPASS, is that error, not this."""
    return (
        len(replies) == 4
        and isinstance(replies[0], error)
        and not isinstance(replies[1], error)
        and not is_auth_refusal(str(replies[0]))
    )
