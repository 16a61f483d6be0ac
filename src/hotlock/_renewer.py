"""The renewer: one per cache, keeping its auto-extended leases alive, telling them when lost.

Every lease taken with ``auto_extend=True`` is handed to its cache's renewer, which sends
the extends of all leases due in one ``extend_many`` round trip per TTL (in chunks of
BATCH), about every ttl/3, and records what it learns on the lease: a new deadline, or a
loss. A lease is lost when an extend finds another token or none (at once), when its
deadline passes before an extend is confirmed (Redis unreachable: the renewer wakes at
that deadline, not at the next failed call), or when max_hold passes while it is held.
A loss is told once: the ``on_lost`` callbacks (and, async, the cancellation of the
``async with`` block), with no renewer lock held.

``Schedule`` decides, with no clock and no I/O of its own, so the sync renewer here (a
thread that keeps time and a thread that does the round trips, so a blackholed reply
never keeps it from a deadline) and the async one (hotlock.aio._renewer, tasks on the
loop) make the same decisions.
"""

from __future__ import annotations

import heapq
import itertools
import logging
import os
import threading
import time
import weakref
from collections.abc import Callable, Iterator, Sequence
from typing import TYPE_CHECKING, Protocol

from . import _ident
from ._lock import TAKEN, shown
from .errors import CacheError

if TYPE_CHECKING:
    from ._backend import Backend
    from ._lock import Lease

__all__ = ["BATCH", "RENEW_AFTER", "Held", "Renewer", "Schedule"]

log = logging.getLogger("hotlock")

# A lease is renewed once a third of its TTL has run: two thirds are left for the extend
# and for one retry after a lost reply.
RENEW_AFTER = 1 / 3
# ...and up to a sixth of its TTL earlier, when other leases of its TTL are renewed then:
# a newly taken lease joins the round trip of those already held instead of making its
# own, so N leases of one TTL settle into one batch per period.
EARLY = 1 / 6
# Extends per round trip: 10,000 leases cost 2 round trips (sent one after the other, so
# on a starved client fewer is safer), and Redis (single-threaded) is busy with one
# batch for about 10 ms.
BATCH = 5000
# After a failed round trip (Redis unreachable), try again after this share of the TTL.
RETRY_AFTER = 1 / 10


class Renewing(Protocol):
    """What a Held asks of the renewer holding it (the sync Renewer, hotlock.aio's AsyncRenewer)."""

    def _forget(self, rec: Held) -> None: ...
    def _touch(self, rec: Held) -> None: ...
    def _on_lost(self, rec: Held, callback: Callable[[Lease], object]) -> None: ...


class Held:
    """The renewer's record of one auto-extended lease; the lease keeps it as ``_auto``.

    The lease records only what it is told (its deadline, its loss); when to renew, what
    is in flight and who is waiting for the loss live here.
    """

    __slots__ = ("callbacks", "gen", "gone", "hold_until", "lease", "max_hold", "renewer", "sending", "told", "warned")

    def __init__(self, renewer: Renewing, lease: Lease, max_hold_ms: int | None) -> None:
        self.renewer = renewer
        self.lease = lease
        self.max_hold = None if max_hold_ms is None else max_hold_ms / 1000.0
        # max_hold runs from when the acquire was sent, as the TTL does.
        self.hold_until = None if self.max_hold is None else lease._since + self.max_hold
        self.gen = 0  # the renewal entry that counts (older ones in the heap are stale)
        self.sending = False  # queued for, or in, a round trip
        self.gone = False  # released: never extended again, its replies ignored
        self.told = False  # its loss was told (or is being told): nothing more to do
        self.warned = False  # a renewer error was logged for it
        self.callbacks: list[Callable[[Lease], object]] = []

    @property
    def done(self) -> bool:
        return self.gone or self.told

    # The Watch protocol of hotlock._lock, for the lease.
    def forget(self) -> None:
        self.renewer._forget(self)

    def touch(self) -> None:
        self.renewer._touch(self)

    def on_lost(self, callback: Callable[[Lease], object]) -> None:
        self.renewer._on_lost(self, callback)


Entry = tuple[float, int, int, Held]  # (when, seq, gen, rec): seq keeps recs from being compared


class Schedule:
    """Which leases are due for renewal and which are lost, on the caller's clock.

    Renewals sit in one heap per TTL (a cohort: they go in the same extend_many), keyed
    by when they are due; deadlines of leases in flight and max_hold ends sit in a watch
    heap. Entries are dropped lazily, so forgetting a lease is O(1).
    """

    def __init__(self) -> None:
        self._cohorts: dict[int, list[Entry]] = {}
        self._watch: list[Entry] = []
        self._seq = itertools.count()

    def __len__(self) -> int:
        return sum(len(h) for h in self._cohorts.values()) + len(self._watch)

    def add(self, rec: Held) -> None:
        self._renew_at(rec, rec.lease._deadline - rec.lease.ttl * (1 - RENEW_AFTER))

    def touch(self, rec: Held, now: float) -> None:
        """The lease was extended (or found lost) by hand: reschedule it, tell a loss now."""
        if rec.done:
            return
        if rec.lease._loss is not None:
            self._watch_at(rec, now)
        elif not rec.sending:
            self.add(rec)

    def _renew_at(self, rec: Held, due: float) -> None:
        rec.gen += 1
        if rec.hold_until is not None:
            due = min(due, rec.hold_until)
        heap = self._cohorts.setdefault(rec.lease._ttl_ms, [])
        heapq.heappush(heap, (due, next(self._seq), rec.gen, rec))

    def _watch_at(self, rec: Held, when: float) -> None:
        if rec.hold_until is not None:
            when = min(when, rec.hold_until)
        heapq.heappush(self._watch, (when, next(self._seq), 0, rec))

    def _lost(self, rec: Held, now: float) -> bool:
        """Whether the lease is lost at ``now``; if so it is marked told (the caller tells it)."""
        lease = rec.lease
        if not lease._token or lease._pid != _ident.pid:
            rec.gone = True  # released (or inherited across a fork): nothing to keep alive
            return False
        if lease._loss is None and rec.hold_until is not None and now >= rec.hold_until:
            lease._loss = f"was held past its max_hold of {rec.max_hold:g} s, so it is no longer extended"
        if lease._loss_at(now) is None:
            return False
        rec.told = True
        return True

    def take(self, now: float) -> tuple[list[Held], list[Held]]:
        """The leases to send an extend for now (marked sending), and the ones lost by now."""
        send: list[Held] = []
        tell: list[Held] = []
        watch = self._watch
        while watch and watch[0][0] <= now:
            rec = heapq.heappop(watch)[3]
            if not rec.done and self._lost(rec, now):
                tell.append(rec)
        for ms, heap in list(self._cohorts.items()):
            # Early only alongside a renewal that is due now: woken for anything else (a
            # round trip landing, say), renewing early would only renew more often.
            horizon = now + ms / 1000.0 * EARLY if heap and heap[0][0] <= now else now
            while heap and heap[0][0] <= horizon:
                _, _, gen, rec = heapq.heappop(heap)
                if gen != rec.gen or rec.done or rec.sending:
                    continue
                if self._lost(rec, now):
                    tell.append(rec)
                elif rec.lease._ttl_ms != ms:
                    self.add(rec)  # extended by hand with another TTL: its own cohort
                else:
                    rec.sending = True
                    send.append(rec)
                    self._watch_at(rec, rec.lease._deadline)
            if not heap:
                del self._cohorts[ms]
        return send, tell

    def next_wake(self) -> float | None:
        """When take() next has something to do (stale entries at the tops are dropped)."""
        wake = None
        watch = self._watch
        while watch and watch[0][3].done:
            heapq.heappop(watch)
        if watch:
            wake = watch[0][0]
        for ms, heap in list(self._cohorts.items()):
            while heap and (heap[0][2] != heap[0][3].gen or heap[0][3].done or heap[0][3].sending):
                heapq.heappop(heap)
            if not heap:
                del self._cohorts[ms]
            elif wake is None or heap[0][0] < wake:
                wake = heap[0][0]
        return wake

    def applied(self, recs: Sequence[Held], results: Sequence[bool] | None, ms: int, sent: float, now: float) -> None:
        """Record one extend_many's outcome (``results`` None: it failed, Redis unreachable)."""
        for i, rec in enumerate(recs):
            rec.sending = False
            if rec.done:
                continue  # released meanwhile (its reply says nothing), or already told
            lease = rec.lease
            if results is None:
                # Its deadline stays watched by the entry pushed when it was sent.
                self._renew_at(rec, now + lease.ttl * RETRY_AFTER)
            elif results[i]:
                if lease._loss_at(now) is None:
                    lease._extended(True, ms, sent)
                    self.add(rec)
                else:
                    # Confirmed too late: the deadline passed first and the loss stands.
                    self._watch_at(rec, now)
            else:
                lease._extended(False, ms, sent)
                self._watch_at(rec, now)

    def clear(self) -> None:
        self._cohorts.clear()
        self._watch.clear()


def sendable(recs: list[Held]) -> Iterator[tuple[int, list[Held]]]:
    """The leases to put in round trips, as (ttl_ms, chunk of at most BATCH)."""
    groups: dict[int, list[Held]] = {}
    for rec in recs:
        groups.setdefault(rec.lease._ttl_ms, []).append(rec)
    for ms, group in groups.items():
        for i in range(0, len(group), BATCH):
            yield ms, group[i : i + BATCH]


def split_live(chunk: list[Held]) -> tuple[list[Held], list[bytes], list[bytes]]:
    """The leases of a chunk still worth extending, with their keys and tokens (read now,
    so a lease released since it was queued is not sent)."""
    live, names, tokens = [], [], []
    for rec in chunk:
        lease = rec.lease
        if rec.done or not lease._sendable():
            rec.sending = False
            continue
        live.append(rec)
        names.append(lease._name)
        tokens.append(lease._token)
    return live, names, tokens


def warn_failed(recs: list[Held], error: BaseException) -> None:
    """Log a failed round trip once per lease: the leases not yet warned about, in one line."""
    fresh = [rec for rec in recs if not rec.warned]
    for rec in fresh:
        rec.warned = True
    if fresh:
        keys = ", ".join(repr(shown(rec.lease.key)) for rec in fresh[:3])
        more = f" and {len(fresh) - 3} more" if len(fresh) > 3 else ""
        log.warning(
            "renewing lock %s%s failed; retrying until its TTL runs out: %s",
            keys,
            more,
            error,
        )


def metered(recs: list[Held], results: Sequence[bool] | None, error: BaseException | None) -> None:
    """A round trip's outcomes to the leases' metrics hooks (connect(metrics=...)), called
    with no renewer lock held: a renewal counts as an extend, a failed one as an error."""
    for i, rec in enumerate(recs):
        meter = rec.lease._meter
        if meter is None or rec.gone:
            continue
        if results is not None:
            meter.extended(rec.lease, results[i])
        elif isinstance(error, CacheError):
            meter.failed(rec.lease, "extend", error)


def tell(lease: Lease, callbacks: list[Callable[[Lease], object]]) -> None:
    """Say that ``lease`` is lost: a log line, then each callback (its error logged, never raised)."""
    why = lease._loss or TAKEN
    log.warning("lock %r %s (server %s)", shown(lease.key), why, lease._backend.server)
    for callback in callbacks:
        try:
            callback(lease)
        except Exception:
            log.exception("on_lost callback of lock %r failed", shown(lease.key))


_renewers: weakref.WeakSet[Renewer] = weakref.WeakSet()


class Renewer:
    """The sync cache's renewer: a timekeeper thread and a round-trip thread, started by
    the first auto-extended lease and stopped by close().

    The timekeeper never does I/O, so a blackholed round trip (one reply timeout) never
    keeps it from a lease's deadline; it tells losses and runs the callbacks. The
    round-trip thread sends the due leases, on its own connection (the native backend
    keeps one per thread).
    """

    def __init__(self, backend: Backend) -> None:
        self._backend = backend
        self._reset()
        _renewers.add(self)

    def _reset(self) -> None:
        self._mutex = threading.Lock()
        self._wake = threading.Condition(self._mutex)  # the timekeeper: something changed
        self._io_wake = threading.Condition(self._mutex)  # the round-trip thread: work queued
        self._schedule = Schedule()
        self._outbox: list[Held] = []
        self._threads: list[threading.Thread] = []
        self._closed = False

    def watch(self, lease: Lease, max_hold_ms: int | None) -> None:
        """Keep ``lease`` alive from now on (until released, lost, max_hold or close())."""
        rec = Held(self, lease, max_hold_ms)
        lease._auto = rec
        with self._mutex:
            self._closed = False
            if not self._threads:
                self._start()
            self._schedule.add(rec)
            self._wake.notify()

    def watch_many(self, leases: list[Lease], max_hold_ms: int | None) -> None:
        recs = []
        for lease in leases:
            rec = Held(self, lease, max_hold_ms)
            lease._auto = rec
            recs.append(rec)
        with self._mutex:
            self._closed = False
            if not self._threads:
                self._start()
            for rec in recs:
                self._schedule.add(rec)
            self._wake.notify()

    def _start(self) -> None:
        self._threads = [
            threading.Thread(target=self._keep_time, name="hotlock-renewer", daemon=True),
            threading.Thread(target=self._send, name="hotlock-renewer-io", daemon=True),
        ]
        for thread in self._threads:
            thread.start()

    def _forget(self, rec: Held) -> None:
        with self._mutex:
            rec.gone = True

    def _touch(self, rec: Held) -> None:
        with self._mutex:
            self._schedule.touch(rec, time.monotonic())
            self._wake.notify()

    def _on_lost(self, rec: Held, callback: Callable[[Lease], object]) -> None:
        with self._mutex:
            if not rec.told:
                rec.callbacks.append(callback)
                return
        tell(rec.lease, [callback])  # already told: at once, in the caller's thread

    def _keep_time(self) -> None:
        while True:
            with self._mutex:
                while True:
                    if self._closed:
                        return
                    now = time.monotonic()
                    send, lost = self._schedule.take(now)
                    if send:
                        self._outbox.extend(send)
                        self._io_wake.notify()
                    if lost:
                        break
                    wake = self._schedule.next_wake()
                    self._wake.wait(None if wake is None else max(0.0, wake - now))
                calls = [(rec.lease, rec.callbacks) for rec in lost]
            # No renewer lock held: a callback may unlock, lock or close.
            for lease, callbacks in calls:
                tell(lease, callbacks)

    def _send(self) -> None:
        while True:
            with self._mutex:
                while not self._outbox and not self._closed:
                    self._io_wake.wait()
                if self._closed:
                    return
                batch, self._outbox = self._outbox, []
            for ms, chunk in sendable(batch):
                with self._mutex:
                    live, names, tokens = split_live(chunk)
                if not live:
                    continue
                sent = time.monotonic()
                results: list[bool] | None
                failure: Exception | None = None
                try:
                    results = self._backend.extend_many(names, tokens, ms)
                except Exception as error:
                    results, failure = None, error
                    warn_failed(live, error)
                with self._mutex:
                    self._schedule.applied(live, results, ms, sent, time.monotonic())
                    self._wake.notify()
                metered(live, results, failure)

    def close(self) -> None:
        """Stop renewing: the leases still held then expire by their TTL."""
        with self._mutex:
            self._closed = True
            self._schedule.clear()
            self._outbox.clear()
            threads, self._threads = self._threads, []
            self._wake.notify_all()
            self._io_wake.notify_all()
        for thread in threads:
            # The round-trip thread ends within one reply timeout; close() may be called
            # from a callback, on the timekeeper itself.
            if thread is not threading.current_thread():
                thread.join()

    def _after_fork_in_child(self) -> None:
        # The threads did not survive the fork and the mutex may have been held by one of
        # them: start afresh, holding none of the parent's leases.
        self._reset()


def _after_fork_in_child() -> None:
    for renewer in list(_renewers):
        renewer._after_fork_in_child()


os.register_at_fork(after_in_child=_after_fork_in_child)
