"""The renewer: one per cache, keeping its auto-extended leases alive, telling them when lost.

Every lease taken with ``auto_extend=True`` is handed to its cache's renewer, which sends
the extends of all leases due in one ``extend_many`` round trip per TTL (in chunks of
BATCH), about every ttl/3, and records what it learns on the lease: a new deadline, or a
loss. A lease is lost when an extend finds another token or none (at once), when its
deadline passes before an extend is confirmed (Redis unreachable: the renewer wakes at
that deadline, not at the next failed call), or when max_hold passes while it is held.
Under max_hold the last renewal asks only for the time left, so the key expires by itself
when the loss is told. A loss is told once: the ``on_lost`` callbacks (and, async, the
cancellation of the ``async with`` block), with no renewer lock held. A block left with
its lease lost hands the release to the renewer, which sends it in the background.

``Schedule`` decides, with no clock and no I/O of its own, so the sync renewer here (a
thread that keeps time and a thread that does the round trips, so a blackholed reply
never keeps it from a deadline) and the async one (hotlock.aio._renewer, tasks on the
loop) make the same decisions.
"""

from __future__ import annotations

import heapq
import itertools
import logging
import math
import os
import threading
import time
import weakref
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import TYPE_CHECKING, Protocol

from . import _ident
from ._lock import TAKEN, UNCONFIRMED, past_max_hold, shown
from .errors import CacheError, Unreplicated

if TYPE_CHECKING:
    from ._lock import Lease
    from .backends import Backend

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
# A lease whose deadline is this close to its max_hold end was renewed up to max_hold (the
# last renewal's TTL is whole ms, and runs from when it was sent).
CAPPED_S = 0.002


class Renewing(Protocol):
    """What a Held asks of the renewer holding it (the sync Renewer, hotlock.aio's AsyncRenewer)."""

    def _forget(self, rec: Held) -> None: ...
    def _let_go(self, rec: Held, token: bytes) -> None: ...
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

    @property
    def capped_out(self) -> bool:
        """Renewed up to max_hold: its key expires then by itself, with nothing more to renew."""
        return self.hold_until is not None and self.lease._deadline >= self.hold_until - CAPPED_S

    # The Watch protocol of hotlock._lock, for the lease.
    def forget(self) -> None:
        self.renewer._forget(self)

    def let_go(self, token: bytes) -> None:
        self.renewer._let_go(self, token)

    def touch(self) -> None:
        self.renewer._touch(self)

    def on_lost(self, callback: Callable[[Lease], object]) -> None:
        self.renewer._on_lost(self, callback)

    def capped(self, ms: int, now: float) -> int:
        """The TTL in ms an extend sent at ``now`` may ask: ``ms``, or what is left of
        max_hold, so the key expires by itself when the loss is told; 0 when less than
        1 ms is left, and then nothing is sent."""
        if self.hold_until is None:
            return ms
        left = self.hold_until - now
        # Rounded up: the key outlives max_hold by less than a ms (and a one-way trip).
        return 0 if left < 0.001 else min(ms, math.ceil(left * 1000))

    def expired(self) -> str:
        # The deadline of a lease renewed up to max_hold is max_hold's end (to the ms).
        return past_max_hold(self.max_hold) if self.capped_out else UNCONFIRMED


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
        lease = rec.lease
        if rec.capped_out:
            self._watch_at(rec, lease._deadline)  # (at max_hold's end) the loss is told as the key expires
            return
        self._renew_at(rec, lease._deadline - lease.ttl * (1 - RENEW_AFTER))

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
            lease._loss = past_max_hold(rec.max_hold)
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
                elif rec.gone:
                    continue  # released (or inherited across a fork) before its forget() came
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

    def applied(
        self,
        recs: Sequence[Held],
        results: Sequence[bool] | None,
        ms: int,
        sent: float,
        now: float,
        why: Mapping[int, str] | None = None,
    ) -> None:
        """Record one extend_many's outcome (``results`` None: it failed, Redis unreachable;
        ``why``: the loss of each extend too few replicas confirmed, by index)."""
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
                lease._extended(False, ms, sent, TAKEN if why is None else why.get(i, TAKEN))
                self._watch_at(rec, now)

    def clear(self) -> None:
        self._cohorts.clear()
        self._watch.clear()


def sendable(recs: list[Held]) -> Iterator[list[Held]]:
    """The leases to put in round trips, in chunks of at most BATCH of one TTL."""
    groups: dict[int, list[Held]] = {}
    for rec in recs:
        groups.setdefault(rec.lease._ttl_ms, []).append(rec)
    for group in groups.values():
        for i in range(0, len(group), BATCH):
            yield group[i : i + BATCH]


Send = tuple[int, list[Held], list[bytes], list[bytes]]  # one extend_many: ttl_ms, leases, keys, tokens


def split_live(chunk: list[Held], now: float) -> list[Send]:
    """The extend_many calls to send now for a chunk: its leases still worth extending,
    with their keys and tokens (read now, so a lease released since it was queued is not
    sent), by the TTL each may ask (a lease near its max_hold asks only what is left, in
    a call of its own; one with less than 1 ms left is not sent)."""
    calls: dict[int, Send] = {}
    for rec in chunk:
        lease = rec.lease
        ms = rec.capped(lease._ttl_ms, now)
        if rec.done or not lease._sendable() or ms == 0:
            rec.sending = False
            continue
        call = calls.get(ms)
        if call is None:
            call = calls[ms] = (ms, [], [], [])
        call[1].append(rec)
        call[2].append(lease._name)
        call[3].append(lease._token)
    return list(calls.values())


def outcome(error: Exception) -> tuple[list[bool] | None, dict[int, str] | None, Exception | None]:
    """A failed extend_many's (results, why, failure) for Schedule.applied and metered: an
    Unreplicated batch (wait_replicas) has results, its unconfirmed extends lost; any
    other error is a round trip that failed (retried until the leases' deadlines)."""
    if isinstance(error, Unreplicated):
        return error.results, error.why, None
    return None, None, error


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


def warn_unreleased(names: list[bytes], error: BaseException) -> None:
    """A background release failed: the keys are left to their TTL."""
    shown_names = ", ".join(repr(shown(n)) for n in names[:3]) + (", ..." if len(names) > 3 else "")
    log.warning("background release of %s failed; it expires by its TTL: %s", shown_names, error)


def tell(lease: Lease, callbacks: list[Callable[[Lease], object]]) -> None:
    """Say that ``lease`` is lost: a log line, the metrics' count, then each callback (its
    error logged, never raised)."""
    why = lease._loss or TAKEN
    log.warning("lock %r %s (server %s)", shown(lease.key), why, lease._backend.server)
    if lease._meter is not None:  # metrics hook
        lease._meter.lost(lease)
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
    keeps one per thread), and the releases of leases whose block ended lost.
    """

    def __init__(self, backend: Backend, reply_timeout: float) -> None:
        self._backend = backend
        # close() waits this long for the round-trip thread (and the releases it has).
        self._reply_timeout = reply_timeout
        self._reset()
        _renewers.add(self)

    def _reset(self) -> None:
        self._mutex = threading.Lock()
        self._wake = threading.Condition(self._mutex)  # the timekeeper: something changed
        self._io_wake = threading.Condition(self._mutex)  # the round-trip thread: work queued
        self._schedule = Schedule()
        self._outbox: list[Held] = []
        self._releases: list[tuple[bytes, bytes]] = []  # (key, token) to release in the background
        self._threads: list[threading.Thread] = []
        # The threads' generation: a round-trip thread that close() stopped waiting for
        # ends when it sees a newer one (a lease watched after close() starts new threads).
        self._generation = 0
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
        self._generation += 1
        self._threads = [
            threading.Thread(target=self._keep_time, args=(self._generation,), name="hotlock-renewer", daemon=True),
            threading.Thread(target=self._send, args=(self._generation,), name="hotlock-renewer-io", daemon=True),
        ]
        for thread in self._threads:
            thread.start()

    def _forget(self, rec: Held) -> None:
        with self._mutex:
            rec.gone = True

    def _let_go(self, rec: Held, token: bytes) -> None:
        with self._mutex:
            rec.gone = True
            if token and self._threads:  # (after close(), the key is left to its TTL)
                self._releases.append((rec.lease._name, token))
                self._io_wake.notify()

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

    def _stopped(self, generation: int) -> bool:
        return self._closed or generation != self._generation

    def _keep_time(self, generation: int) -> None:
        while True:
            with self._mutex:
                while True:
                    if self._stopped(generation):
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

    def _send(self, generation: int) -> None:
        while True:
            with self._mutex:
                while not self._outbox and not self._releases and not self._stopped(generation):
                    self._io_wake.wait()
                closed = self._stopped(generation)
                releases, self._releases = self._releases, []
                batch: list[Held] = []
                if not closed:
                    batch, self._outbox = self._outbox, []
            if releases:
                names = [name for name, _ in releases]
                try:
                    self._backend.release_many(names, [token for _, token in releases])
                except Exception as error:
                    warn_unreleased(names, error)
            if closed:
                return
            for chunk in sendable(batch):
                with self._mutex:
                    calls = split_live(chunk, time.monotonic())
                for ms, live, names, tokens in calls:
                    sent = time.monotonic()
                    results: list[bool] | None
                    why: dict[int, str] | None = None
                    failure: Exception | None = None
                    try:
                        results = self._backend.extend_many(names, tokens, ms)
                    except Exception as error:
                        results, why, failure = outcome(error)
                        if failure is not None:
                            warn_failed(live, failure)
                    with self._mutex:
                        self._schedule.applied(live, results, ms, sent, time.monotonic(), why)
                        self._wake.notify()
                    metered(live, results, failure)

    def close(self) -> None:
        """Stop renewing: the leases still held then expire by their TTL. The background
        releases get one reply timeout to land; what is still unsent then is left to the
        keys' TTL."""
        with self._mutex:
            self._closed = True
            self._schedule.clear()
            self._outbox.clear()
            threads, self._threads = self._threads, []
            self._wake.notify_all()
            self._io_wake.notify_all()
        give_up = time.monotonic() + self._reply_timeout
        for thread in threads:
            # close() may be called from a callback, on the timekeeper itself. A round
            # trip still in flight past the wait ends when the backend closes.
            if thread is not threading.current_thread():
                thread.join(max(0.0, give_up - time.monotonic()))

    def _after_fork_in_child(self) -> None:
        # The threads did not survive the fork and the mutex may have been held by one of
        # them: start afresh, holding none of the parent's leases.
        self._reset()


def _after_fork_in_child() -> None:
    for renewer in list(_renewers):
        renewer._after_fork_in_child()


os.register_at_fork(after_in_child=_after_fork_in_child)
