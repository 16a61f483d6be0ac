"""Metrics: what hotlock tells a listener about its locks, and a Prometheus adapter.

    import hotlock, hotlock.metrics

    cache = hotlock.connect(url, metrics=hotlock.metrics.PrometheusMetrics())
    cache = await hotlock.aio.connect(url, metrics=listener)     # the async twin, same listener

A listener is any object with the six methods of ``Listener`` (subclass
``BaseListener`` to implement only some), and optionally a seventh, ``waited`` (see
``BaseListener.waited``): a lock_wait's outcome with the attempts it made. hotlock calls them synchronously, on the
thread (or in the task) that did the operation, after the operation's outcome is known and
before it is returned or raised. A listener must be quick and must not block: it runs on the
lock's hot path. One that raises is logged once as a WARNING and never changes what the
lock call returns or raises (a metrics bug must not strand a lock).

A cache made without ``metrics`` pays nothing: its locks carry no listener and test a single
``is None`` on release and extend.
"""

from __future__ import annotations

import logging
import math
import re
import threading
from bisect import bisect_right
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from itertools import accumulate, repeat, starmap
from math import fsum
from typing import TYPE_CHECKING, Any, Literal, Protocol

from ._lock import shown

if TYPE_CHECKING:
    from .errors import CacheError

__all__ = [
    "HOLD_BUCKETS",
    "WAIT_BUCKETS",
    "BaseListener",
    "Listener",
    "Listeners",
    "NotAcquired",
    "Op",
    "PrometheusMetrics",
    "WaitOutcome",
    "error_kind",
    "first_segment",
]

# The lock operations an error is reported for.
Op = Literal["acquire", "extend", "release"]
# Why an acquisition did not happen: "held" (try-once found another holder: lock(),
# lock_many(), with_lock()) or "timeout" (lock_wait()'s deadline passed).
NotAcquired = Literal["held", "timeout"]
# How a lock_wait ended (BaseListener.waited).
WaitOutcome = Literal["acquired", "timeout"]


class Listener(Protocol):
    """The events hotlock reports, one method each. ``key`` is the key as the caller gave it
    (str or bytes, without the prefix). Times are seconds on the monotonic clock."""

    def acquired(self, key: str | bytes, wait_s: float, attempts: int | None) -> None:
        """A lock was acquired. ``wait_s``: from the call until the acquire succeeded (for a
        try-once lock, one round trip). ``attempts``: 1 for lock(), lock_many() and
        with_lock(); for lock_wait(), the acquire attempts it sent, the one that took the
        lock included (every backend counts them; None never comes from hotlock itself, it
        is kept in the type for listeners written when lock_wait did not count). A listener
        with a ``waited`` method hears a lock_wait's outcome there instead."""

    def not_acquired(self, key: str | bytes, outcome: NotAcquired, wait_s: float) -> None:
        """An acquisition found the key held elsewhere ("held") or waited its whole
        ``wait`` in vain ("timeout"). Not an error: somebody else is doing the work."""

    def released(self, key: str | bytes, held_s: float) -> None:
        """unlock() (or leaving a ``with`` block, or unlock_many()) released a lock that
        had been held for ``held_s``, counted from when its acquire was sent."""

    def extended(self, key: str | bytes, ok: bool) -> None:
        """extend() or extend_many() set a new TTL (``ok``), or found the lock lost."""

    def lost(self, key: str | bytes, held_s: float) -> None:
        """The lease was found lost (expired, taken over, deleted by an operator, or, under
        wait_replicas, an extend too few replicas confirmed): an extend raised LockLost,
        the release found another token or none, or (for
        auto_extend) the renewer told the loss: another token or none, its TTL run out
        unconfirmed, or max_hold passed. Once per lease, however many ways it is found;
        a lease told lost is not also reported released. ``held_s`` is the time from the
        acquire to that discovery. Work done under the lock since it expired was not
        protected."""

    def error(self, key: str | bytes, op: Op, error: CacheError) -> None:
        """A CacheError (Redis unreachable, timed out, or an error reply) ended ``op``.
        ``error_kind()`` names its kind for a label."""


class BaseListener:
    """A Listener whose methods do nothing: subclass it and override what you count."""

    def acquired(self, key: str | bytes, wait_s: float, attempts: int | None) -> None:
        pass

    def waited(self, key: str | bytes, outcome: WaitOutcome, wait_s: float, attempts: int) -> None:
        """Optional (hotlock looks it up once, at connect): a lock_wait() ended, "acquired"
        or at its deadline ("timeout"), ``wait_s`` after the call, having sent ``attempts``
        acquire attempts. For a listener that tells a wait from a try-once acquire, or
        counts a timed-out wait's attempts (OtelListener does both). Without it, and by
        default here, the event is ``acquired(key, wait_s, attempts)`` or
        ``not_acquired(key, "timeout", wait_s)``."""
        if outcome == "acquired":
            self.acquired(key, wait_s, attempts)
        else:
            self.not_acquired(key, "timeout", wait_s)

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


class Listeners:
    """Several listeners as one: each event goes to each, in order. ``connect(metrics=[a, b])``
    makes one; so does ``Listeners(a, b)``.

    One that raises is logged once (a WARNING naming it) and skipped for that event; the
    others still hear it, so a broken exporter does not silence the Prometheus counters.
    """

    __slots__ = ("_warned", "listeners")

    def __init__(self, *listeners: Listener) -> None:
        self.listeners: tuple[Listener, ...] = listeners
        self._warned: set[int] = set()

    def _each(self, method: str, *args: Any) -> None:
        for listener in self.listeners:
            self._one(listener, method, *args)

    def _one(self, listener: Listener, method: str, *args: Any) -> None:
        try:
            getattr(listener, method)(*args)
        except Exception:
            if id(listener) not in self._warned:
                self._warned.add(id(listener))
                logging.getLogger("hotlock").warning(
                    "metrics listener %r raised; its events are dropped", listener, exc_info=True
                )

    def acquired(self, key: str | bytes, wait_s: float, attempts: int | None) -> None:
        self._each("acquired", key, wait_s, attempts)

    def waited(self, key: str | bytes, outcome: WaitOutcome, wait_s: float, attempts: int) -> None:
        for listener in self.listeners:
            # Each as a Meter would call it alone: its own waited, or else what it stands for.
            if callable(getattr(listener, "waited", None)):
                self._one(listener, "waited", key, outcome, wait_s, attempts)
            elif outcome == "acquired":
                self._one(listener, "acquired", key, wait_s, attempts)
            else:
                self._one(listener, "not_acquired", key, "timeout", wait_s)

    def not_acquired(self, key: str | bytes, outcome: NotAcquired, wait_s: float) -> None:
        self._each("not_acquired", key, outcome, wait_s)

    def released(self, key: str | bytes, held_s: float) -> None:
        self._each("released", key, held_s)

    def extended(self, key: str | bytes, ok: bool) -> None:
        self._each("extended", key, ok)

    def lost(self, key: str | bytes, held_s: float) -> None:
        self._each("lost", key, held_s)

    def error(self, key: str | bytes, op: Op, error: CacheError) -> None:
        self._each("error", key, op, error)

    def __repr__(self) -> str:
        return f"<hotlock.metrics.Listeners {list(self.listeners)!r}>"


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


def _bounds(buckets: Sequence[float]) -> list[float]:
    """Histogram upper bounds as prometheus_client's Histogram takes them: sorted, with
    +Inf added when missing."""
    bounds = [float(b) for b in buckets]
    if bounds != sorted(bounds):
        raise ValueError(f"histogram buckets must be in increasing order, not {tuple(buckets)!r}")
    if not bounds or bounds[-1] != math.inf:
        bounds.append(math.inf)
    return bounds


# How many observations a histogram keeps unbinned at most: the observation that finds
# this many bins them all (a scrape bins them too), so memory stays small without a scrape.
_BIN_AT = 256


class _Histogram:
    """One histogram's numbers. An observation is appended to ``pending`` without a lock
    (deque appends and pops are thread-safe) and binned later, under the adapter's lock,
    in a batch: a lock cycle's two observations then cost an append each."""

    __slots__ = ("bounds", "counts", "pending", "sum")

    def __init__(self, bounds: list[float]) -> None:
        self.bounds = bounds
        self.counts = [0] * len(bounds)  # per bucket, not cumulative
        self.sum = 0.0
        self.pending: deque[float] = deque()

    def bin(self) -> None:
        """Move the pending observations into the buckets (the caller holds the lock; what
        other threads append meanwhile stays pending). In C but for one step per bucket:
        the values popped by starmap, sorted, and each bucket's count read off by bisection
        (an observation is counted in the first bucket whose upper bound is >= it, as
        prometheus_client's Histogram.observe counts it)."""
        values = sorted(starmap(self.pending.popleft, repeat((), len(self.pending))))
        if not values:
            return
        below = 0
        for i, bound in enumerate(self.bounds):
            upto = bisect_right(values, bound)
            self.counts[i] += upto - below
            below = upto
        self.sum += fsum(values)

    def copy(self) -> _Histogram:
        other = _Histogram(self.bounds)
        other.counts, other.sum = list(self.counts), self.sum
        return other


class _Series:
    """The numbers of one key_space (of every key when there is none). The counters are
    added to under the adapter's lock. "acquired" is not counted apart: it is the wait
    histogram's count."""

    __slots__ = ("acquisitions", "errors", "extensions", "hold", "lost", "wait")

    def __init__(self, wait: _Histogram, hold: _Histogram) -> None:
        self.acquisitions = dict.fromkeys(_ACQUIRE_OUTCOMES[1:], 0)
        self.wait = wait
        self.hold = hold
        self.extensions = dict.fromkeys(_EXTEND_OUTCOMES, 0)
        self.lost = 0
        self.errors: dict[tuple[str, str], int] = {}

    def copy(self) -> _Series:
        """A binned copy (the caller holds the lock)."""
        self.wait.bin()
        self.hold.bin()
        other = _Series(self.wait.copy(), self.hold.copy())
        other.acquisitions = dict(self.acquisitions)
        other.extensions = dict(self.extensions)
        other.lost = self.lost
        other.errors = dict(self.errors)
        return other


class PrometheusMetrics(BaseListener):
    """A Listener that a prometheus_client registry collects (``pip install hotlock[prometheus]``):

    ================================================  ===========================================
    ``<ns>_acquisitions_total{outcome}``               acquired, held, timeout, error
    ``<ns>_acquire_wait_seconds``                      histogram: wait of each acquired lock
    ``<ns>_hold_seconds``                              histogram: hold time of each released lock
    ``<ns>_extensions_total{outcome}``                 ok, lost, error
    ``<ns>_lost_total``                                leases lost (taken over, expired, past max_hold), once each
    ``<ns>_errors_total{op, kind}``                    op: acquire, extend, release; kind: error_kind()
    ================================================  ===========================================

    ``registry``: where to register (default: prometheus_client's global REGISTRY).
    ``key_space``: a function from the key (str) to a label value, e.g. ``first_segment``;
    when given, every metric above also carries a ``key_space`` label.

    Never labelled by the key itself, by default or by option: every distinct label value is
    a time series kept forever by the client and the server, and lock keys carry ids
    (invoice, tenant, account), so one series per key grows without bound and takes the
    monitoring down with it. ``key_space`` must map keys to a small fixed set.

    It is a custom collector (prometheus_client's documented ``collect()`` interface), not a
    set of Counter and Histogram objects: those take a lock per value per update and check
    their arguments each time, three times per lock cycle, which would cost more than the
    cycle's own Python. Here an event is one add under one lock; the exposition, built at
    scrape time with prometheus_client's metric families, is the same.
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
        self._key_space = key_space
        self._prefix = f"{namespace}_" if namespace else ""
        self._wait_bounds = _bounds(wait_buckets)
        self._hold_bounds = _bounds(hold_buckets)
        # The bounds as the exposition's ``le`` labels, formatted as prometheus_client's own
        # Histogram does ("0.005", "+Inf").
        from prometheus_client.utils import floatToGoString

        float_to_go: Callable[[float], str] = floatToGoString
        self._wait_le = [float_to_go(b) for b in self._wait_bounds]
        self._hold_le = [float_to_go(b) for b in self._hold_bounds]
        self._lock = threading.Lock()
        # Without key_space every event adds to the one series (no lookup); with it, to
        # the series of the key's space, made on its first event.
        self._all = None if key_space is not None else self._new_series()
        self._spaces: dict[str, _Series] = {}
        (prom.REGISTRY if registry is None else registry).register(self)

    def _new_series(self) -> _Series:
        return _Series(_Histogram(self._wait_bounds), _Histogram(self._hold_bounds))

    def _bin(self, histogram: _Histogram) -> None:
        with self._lock:
            histogram.bin()

    def _of(self, key: str | bytes) -> _Series:
        """The series of ``key``'s space (with key_space only)."""
        assert self._key_space is not None
        space = str(self._key_space(shown(key)))
        series = self._spaces.get(space)
        if series is None:
            with self._lock:
                series = self._spaces.setdefault(space, self._new_series())
        return series

    # -- the listener: each event is one add under the lock ----------------------------

    def acquired(self, key: str | bytes, wait_s: float, attempts: int | None) -> None:
        histogram = (self._all or self._of(key)).wait
        pending = histogram.pending
        pending.append(wait_s)
        if len(pending) >= _BIN_AT:
            self._bin(histogram)

    def not_acquired(self, key: str | bytes, outcome: NotAcquired, wait_s: float) -> None:
        series = self._all or self._of(key)
        with self._lock:
            series.acquisitions[outcome] += 1

    def released(self, key: str | bytes, held_s: float) -> None:
        histogram = (self._all or self._of(key)).hold
        pending = histogram.pending
        pending.append(held_s)
        if len(pending) >= _BIN_AT:
            self._bin(histogram)

    def extended(self, key: str | bytes, ok: bool) -> None:
        series = self._all or self._of(key)
        with self._lock:
            series.extensions["ok" if ok else "lost"] += 1

    def lost(self, key: str | bytes, held_s: float) -> None:
        series = self._all or self._of(key)
        with self._lock:
            series.lost += 1

    def error(self, key: str | bytes, op: Op, error: CacheError) -> None:
        kind = error_kind(error)
        series = self._all or self._of(key)
        with self._lock:
            series.errors[op, kind] = series.errors.get((op, kind), 0) + 1
            if op == "acquire":
                series.acquisitions["error"] += 1
            elif op == "extend":
                series.extensions["error"] += 1

    # -- the collector ------------------------------------------------------------------

    def collect(self) -> Iterator[Any]:
        """What a scrape reads (prometheus_client calls it): a copy taken under the lock."""
        taken: list[tuple[tuple[str, ...], _Series]]
        with self._lock:
            if self._all is not None:
                taken = [((), self._all.copy())]
            else:
                taken = [((space,), s.copy()) for space, s in sorted(self._spaces.items())]
        return self._families(taken)

    def describe(self) -> Iterator[Any]:
        """The metric names without samples, for the registry's check of duplicate names."""
        return self._families([])

    def _families(self, taken: list[tuple[tuple[str, ...], _Series]]) -> Iterator[Any]:
        from prometheus_client.core import CounterMetricFamily, HistogramMetricFamily

        space = ("key_space",) if self._key_space is not None else ()
        name = self._prefix
        acquisitions = CounterMetricFamily(
            f"{name}acquisitions", "Lock acquisitions by outcome", labels=[*space, "outcome"]
        )
        wait = HistogramMetricFamily(
            f"{name}acquire_wait_seconds", "Time from the acquire call until the lock was acquired", labels=space
        )
        hold = HistogramMetricFamily(
            f"{name}hold_seconds", "Time from the acquire until the release of each released lock", labels=space
        )
        extensions = CounterMetricFamily(f"{name}extensions", "Lock extensions by outcome", labels=[*space, "outcome"])
        lost = CounterMetricFamily(f"{name}lost", "Leases found lost (by extend or release)", labels=space)
        errors = CounterMetricFamily(
            f"{name}errors", "Cache errors by operation and kind", labels=[*space, "op", "kind"]
        )
        for labels, s in taken:
            acquisitions.add_metric([*labels, "acquired"], sum(s.wait.counts))
            for outcome, n in s.acquisitions.items():
                acquisitions.add_metric([*labels, outcome], n)
            wait.add_metric(labels, _cumulative(self._wait_le, s.wait.counts), s.wait.sum)
            hold.add_metric(labels, _cumulative(self._hold_le, s.hold.counts), s.hold.sum)
            for outcome, n in s.extensions.items():
                extensions.add_metric([*labels, outcome], n)
            lost.add_metric(labels, s.lost)
            for (op, kind), n in sorted(s.errors.items()):
                errors.add_metric([*labels, op, kind], n)
        return iter((acquisitions, wait, hold, extensions, lost, errors))

    def __repr__(self) -> str:
        return f"<hotlock.metrics.PrometheusMetrics key_space={self._key_space!r}>"


def _cumulative(le: list[str], counts: list[int]) -> list[tuple[str, float]]:
    """Per-bucket counts as the exposition's cumulative ``le`` buckets."""
    return list(zip(le, map(float, accumulate(counts)), strict=True))
