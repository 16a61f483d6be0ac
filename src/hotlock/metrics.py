"""Metrics: what hotlock tells a listener about its locks, and a Prometheus adapter.

    import hotlock, hotlock.metrics

    cache = hotlock.connect(url, metrics=hotlock.metrics.PrometheusMetrics())
    cache = await hotlock.aio.connect(url, metrics=listener)     # the async twin, same listener

A listener is any object with the six methods of :class:`Listener` (subclass
:class:`BaseListener` to implement only some). hotlock calls them synchronously, on the
thread (or in the task) that did the operation, after the operation's outcome is known and
before it is returned or raised. A listener must be quick and must not block: it runs on the
lock's hot path. One that raises is logged once as a WARNING and never changes what the
lock call returns or raises (a metrics bug must not strand a lock).

A cache made without ``metrics`` pays nothing: its locks carry no listener and test a single
``is None`` on release and extend.
"""

from __future__ import annotations

import math
import re
from bisect import bisect_left
from collections.abc import Callable, Sequence
from functools import partial
from typing import TYPE_CHECKING, Any, Literal, Protocol

from ._lock import shown

if TYPE_CHECKING:
    from .errors import CacheError

__all__ = [
    "HOLD_BUCKETS",
    "WAIT_BUCKETS",
    "BaseListener",
    "Listener",
    "NotAcquired",
    "Op",
    "PrometheusMetrics",
    "error_kind",
    "first_segment",
]

# The lock operations an error is reported for.
Op = Literal["acquire", "extend", "release"]
# Why an acquisition did not happen: "held" (try-once found another holder: lock(),
# lock_many(), with_lock()) or "timeout" (lock_wait()'s deadline passed).
NotAcquired = Literal["held", "timeout"]


class Listener(Protocol):
    """The events hotlock reports, one method each. ``key`` is the key as the caller gave it
    (str or bytes, without the prefix). Times are seconds on the monotonic clock."""

    def acquired(self, key: str | bytes, wait_s: float, attempts: int | None) -> None:
        """A lock was acquired. ``wait_s``: from the call until the acquire succeeded (for a
        try-once lock, one round trip). ``attempts``: 1 for lock(), lock_many() and
        with_lock(); None for lock_wait(), whose polling loop runs inside the backend (in C
        on the native one) and does not count its tries."""

    def not_acquired(self, key: str | bytes, outcome: NotAcquired, wait_s: float) -> None:
        """An acquisition found the key held elsewhere ("held") or waited its whole
        ``wait`` in vain ("timeout"). Not an error: somebody else is doing the work."""

    def released(self, key: str | bytes, held_s: float) -> None:
        """unlock() (or leaving a ``with`` block, or unlock_many()) released a lock that
        had been held for ``held_s``, counted from when its acquire was sent."""

    def extended(self, key: str | bytes, ok: bool) -> None:
        """extend() or extend_many() set a new TTL (``ok``), or found the lock lost."""

    def lost(self, key: str | bytes, held_s: float) -> None:
        """The lease was found lost (expired, taken over, or deleted by an operator):
        an extend raised LockLost, or the release found another token or none. ``held_s``
        is the time from the acquire to that discovery. Work done under the lock since it
        expired was not protected."""

    def error(self, key: str | bytes, op: Op, error: CacheError) -> None:
        """A CacheError (Redis unreachable, timed out, or an error reply) ended ``op``.
        :func:`error_kind` names its kind for a label."""


class BaseListener:
    """A Listener whose methods do nothing: subclass it and override what you count."""

    def acquired(self, key: str | bytes, wait_s: float, attempts: int | None) -> None:
        pass

    def not_acquired(self, key: str | bytes, outcome: NotAcquired, wait_s: float) -> None:
        pass

    def released(self, key: str | bytes, held_s: float) -> None:
        pass

    def extended(self, key: str | bytes, ok: bool) -> None:
        pass

    def lost(self, key: str | bytes, held_s: float) -> None:
        pass

    def error(self, key: str | bytes, op: Op, error: CacheError) -> None:
        pass


LISTENER_METHODS = ("acquired", "not_acquired", "released", "extended", "lost", "error")

# The error codes a server puts first in an error reply that an operator acts on
# differently; anything else is "reply".
_CODES = {"OOM": "oom", "READONLY": "readonly", "NOPERM": "noperm", "NOSCRIPT": "noscript", "WRONGTYPE": "wrongtype"}
_REPLIED = re.compile(r"replied:? -?([A-Z]+)\b")


def error_kind(error: BaseException) -> str:
    """A small fixed set of names for a CacheError, for a label: "timeout" (no reply in
    time), "oom", "readonly", "noperm", "noscript", "wrongtype", "reply" (another error
    reply) or "connection" (cannot connect, reset, closed).

    Read from the message every backend writes ("no reply within the timeout", "the server
    replied OOM ..."), so it is as stable as those messages.
    """
    text = str(error)
    if "no reply within the timeout" in text or "timed out" in text:
        return "timeout"
    match = _REPLIED.search(text)
    if match is not None:
        return _CODES.get(match.group(1), "reply")
    for code, kind in _CODES.items():
        if f": {code} " in text:
            return kind
    return "connection"


def first_segment(key: str) -> str:
    """A ``key_space`` mapping for PrometheusMetrics: the key up to its first ``:``
    ("settle:invoice-1" -> "settle"), or "" when it has none.

    Only use it when that part comes from a small fixed set (your code's names), never
    when it holds ids.
    """
    head, sep, _ = key.partition(":")
    return head if sep else ""


# Lock waits run from one round trip (well under a millisecond on a LAN) to the wait budget.
WAIT_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
# Holds run from a few milliseconds of work to an hour-long job (the TTL cap is 7 days).
HOLD_BUCKETS = (0.005, 0.01, 0.05, 0.1, 0.5, 1.0, 5.0, 10.0, 30.0, 60.0, 300.0, 900.0, 3600.0)

_ACQUIRE_OUTCOMES = ("acquired", "held", "timeout", "error")
_EXTEND_OUTCOMES = ("ok", "lost", "error")


def _fast_inc(counter: Any) -> Callable[[], None]:
    """``counter.inc`` for an unlabelled counter (or a bound child), as a call of its value's
    own inc (thread-safe, under the value's lock) without Counter.inc's checks for a
    negative amount, an exemplar and an unbound parent, which cannot apply here. Falls
    back to the public method where prometheus_client's insides are not as expected."""
    add = getattr(getattr(counter, "_value", None), "inc", None)
    if not callable(add):
        return counter.inc  # type: ignore[no-any-return]
    return partial(add, 1)


def _fast_observe(histogram: Any) -> Callable[[float], None]:
    """``histogram.observe`` for an unlabelled histogram: add to its sum and to the one
    bucket the amount falls in (prometheus_client keeps the buckets non-cumulative and sums
    them at collection), found by bisection instead of Histogram.observe's linear scan and
    per-call checks. Falls back to the public method where the insides are not as expected."""
    try:
        bounds = [float(b) for b in histogram._upper_bounds]
        adds = [b.inc for b in histogram._buckets]
        add_sum = histogram._sum.inc
    except (AttributeError, TypeError, ValueError):
        return histogram.observe  # type: ignore[no-any-return]
    if not bounds or len(bounds) != len(adds) or bounds[-1] != math.inf or bounds != sorted(bounds):
        return histogram.observe  # type: ignore[no-any-return]

    def observe(amount: float) -> None:
        add_sum(amount)
        # The first bucket whose upper bound is >= amount (Histogram.observe's own rule).
        adds[bisect_left(bounds, amount)](1)

    return observe


class PrometheusMetrics(BaseListener):
    """A Listener that keeps prometheus_client counters and histograms
    (``pip install hotlock[prometheus]``):

    ================================================  ===========================================
    ``<ns>_acquisitions_total{outcome}``               acquired, held, timeout, error
    ``<ns>_acquire_wait_seconds``                      histogram: wait of each acquired lock
    ``<ns>_hold_seconds``                              histogram: hold time of each released lock
    ``<ns>_extensions_total{outcome}``                 ok, lost, error
    ``<ns>_lost_total``                                leases found lost (extend or release)
    ``<ns>_errors_total{op, kind}``                    op: acquire, extend, release; kind: error_kind()
    ================================================  ===========================================

    ``registry``: where to register (default: prometheus_client's global REGISTRY).
    ``key_space``: a function from the key (str) to a label value, e.g. :func:`first_segment`;
    when given, every metric above also carries a ``key_space`` label.

    Never labelled by the key itself, by default or by option: every distinct label value is
    a time series kept forever by the client and the server, and lock keys carry ids
    (invoice, tenant, account), so one series per key grows without bound and takes the
    monitoring down with it. ``key_space`` must map keys to a small fixed set.
    """

    def __init__(
        self,
        registry: Any = None,
        namespace: str = "hotlock",
        *,
        key_space: Callable[[str], str] | None = None,
        wait_buckets: Sequence[float] = WAIT_BUCKETS,
        hold_buckets: Sequence[float] = HOLD_BUCKETS,
    ) -> None:
        try:
            import prometheus_client as prom
        except ImportError as exc:
            raise ImportError(
                f"hotlock.metrics.PrometheusMetrics needs prometheus_client: pip install 'hotlock[prometheus]' ({exc})"
            ) from exc
        if key_space is not None and not callable(key_space):
            raise TypeError(f"key_space must be callable or None, not {type(key_space).__name__}")
        if registry is None:
            registry = prom.REGISTRY
        self._key_space = key_space
        space: tuple[str, ...] = () if key_space is None else ("key_space",)
        common: dict[str, Any] = {"namespace": namespace, "registry": registry}
        self.acquisitions = prom.Counter("acquisitions", "Lock acquisitions by outcome", [*space, "outcome"], **common)
        self.acquire_wait = prom.Histogram(
            "acquire_wait_seconds",
            "Time from the acquire call until the lock was acquired",
            space,
            buckets=tuple(wait_buckets),
            **common,
        )
        self.hold = prom.Histogram(
            "hold_seconds",
            "Time from the acquire until the release of each released lock",
            space,
            buckets=tuple(hold_buckets),
            **common,
        )
        self.extensions = prom.Counter("extensions", "Lock extensions by outcome", [*space, "outcome"], **common)
        self.losses = prom.Counter("lost", "Leases found lost (by extend or release)", space, **common)
        self.errors = prom.Counter("errors", "Cache errors by operation and kind", [*space, "op", "kind"], **common)
        if key_space is None:
            # No labels to look up per event: resolve each child once, so an event costs
            # one inc() or observe() (prometheus_client's labels() is a dict lookup under a lock).
            self._acq = {o: self.acquisitions.labels(outcome=o) for o in _ACQUIRE_OUTCOMES}
            self._ext = {o: self.extensions.labels(outcome=o) for o in _EXTEND_OUTCOMES}
            # And the per-cycle events (acquired + released) bound to the values they add
            # to, so a lock cycle costs no lookups and no per-call checks (bench/results.md
            # "Metrics: what the listener costs").
            self._count_acquired = _fast_inc(self._acq["acquired"])
            self._observe_wait = _fast_observe(self.acquire_wait)
            self._observe_hold = _fast_observe(self.hold)

    # Each method has a fast path (no key_space: pre-resolved children) and a labelled one.

    def acquired(self, key: str | bytes, wait_s: float, attempts: int | None) -> None:
        if self._key_space is None:
            self._count_acquired()
            self._observe_wait(wait_s)
        else:
            space = self._space(key)
            self.acquisitions.labels(space, "acquired").inc()
            self.acquire_wait.labels(space).observe(wait_s)

    def not_acquired(self, key: str | bytes, outcome: NotAcquired, wait_s: float) -> None:
        if self._key_space is None:
            self._acq[outcome].inc()
        else:
            self.acquisitions.labels(self._space(key), outcome).inc()

    def released(self, key: str | bytes, held_s: float) -> None:
        if self._key_space is None:
            self._observe_hold(held_s)
        else:
            self.hold.labels(self._space(key)).observe(held_s)

    def extended(self, key: str | bytes, ok: bool) -> None:
        outcome = "ok" if ok else "lost"
        if self._key_space is None:
            self._ext[outcome].inc()
        else:
            self.extensions.labels(self._space(key), outcome).inc()

    def lost(self, key: str | bytes, held_s: float) -> None:
        if self._key_space is None:
            self.losses.inc()
        else:
            self.losses.labels(self._space(key)).inc()

    def error(self, key: str | bytes, op: Op, error: CacheError) -> None:
        kind = error_kind(error)
        if self._key_space is None:
            self.errors.labels(op=op, kind=kind).inc()
            if op == "acquire":
                self._acq["error"].inc()
            elif op == "extend":
                self._ext["error"].inc()
        else:
            space = self._space(key)
            self.errors.labels(space, op, kind).inc()
            if op == "acquire":
                self.acquisitions.labels(space, "error").inc()
            elif op == "extend":
                self.extensions.labels(space, "error").inc()

    def _space(self, key: str | bytes) -> str:
        assert self._key_space is not None
        return str(self._key_space(shown(key)))

    def __repr__(self) -> str:
        return f"<hotlock.metrics.PrometheusMetrics key_space={self._key_space!r}>"
