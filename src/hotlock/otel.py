"""hotlock.otel: OpenTelemetry spans for locks, from the metrics listener interface.

    import hotlock, hotlock.metrics
    from hotlock.otel import OtelListener

    cache = hotlock.connect(url, metrics=[OtelListener(), hotlock.metrics.PrometheusMetrics()])

Each event becomes a span, a child of whatever span is current where the lock call ran (the
request, the Celery task), with the times the event carries:

    hotlock.acquire   a try-once acquire (lock(), lock_many(), with_lock()): one round trip
    hotlock.wait      a lock_wait(): from the call until acquired or the deadline
                      (``hotlock.lock.wait_s``; ``hotlock.lock.attempts``: the attempts
                      it sent, the one that took the lock included)
    hotlock.hold      from the acquire until the release (``hotlock.lock.held_s``), or
                      until the lease was found lost: then status ERROR and a "lost" event
    hotlock.extend    an extend that found the lock lost (successful extends are not spans:
                      an auto-extended lease renews every ttl/3, and they would drown the rest)
    hotlock.<op>      status ERROR: the cache was unreachable or refused (``error.type``)

Every span carries the key (``hotlock.lock.key``, as the caller gave it, without the prefix)
and ``hotlock.lock.outcome``. Never the token: the listener is never given it. A conflict
("held", "timeout") is not an error: its span's status stays unset.

The listener creates spans after the fact, with explicit start times, so it adds no round
trip and no context switch to the lock's hot path; it runs on the thread (or in the task)
of the lock call, as every listener does.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

from opentelemetry import trace
from opentelemetry.trace import SpanKind, Status, StatusCode

from .metrics import BaseListener, NotAcquired, Op, WaitOutcome, error_kind

if TYPE_CHECKING:
    from opentelemetry.trace import TracerProvider

    from .errors import CacheError

__all__ = ["OtelListener"]

_NS = 1_000_000_000


def _key(key: str | bytes) -> str:
    return key if isinstance(key, str) else key.decode("utf-8", "backslashreplace")


class OtelListener(BaseListener):
    """A hotlock.metrics listener that records OpenTelemetry spans (see the module).

    ``tracer_provider``: the provider to take the tracer from (default: the global one, as
    set by the OpenTelemetry SDK or its auto-instrumentation).
    """

    def __init__(self, tracer_provider: TracerProvider | None = None) -> None:
        self._tracer = trace.get_tracer("hotlock", tracer_provider=tracer_provider)

    def _span(
        self,
        name: str,
        key: str | bytes,
        seconds: float,
        outcome: str,
        attributes: dict[str, str | int | float] | None = None,
        error: str | None = None,
    ) -> None:
        end = time.time_ns()
        span = self._tracer.start_span(
            name,
            kind=SpanKind.INTERNAL,
            start_time=end - int(max(seconds, 0.0) * _NS),
            attributes={"hotlock.lock.key": _key(key), "hotlock.lock.outcome": outcome, **(attributes or {})},
        )
        if error is not None:
            span.set_status(Status(StatusCode.ERROR, error))
        span.end(end_time=end)

    def acquired(self, key: str | bytes, wait_s: float, attempts: int | None) -> None:
        attributes: dict[str, str | int | float] = {"hotlock.lock.wait_s": wait_s}
        if attempts is not None:
            attributes["hotlock.lock.attempts"] = attempts
        self._span("hotlock.acquire", key, wait_s, "acquired", attributes)

    def waited(self, key: str | bytes, outcome: WaitOutcome, wait_s: float, attempts: int) -> None:
        self._span(
            "hotlock.wait", key, wait_s, outcome, {"hotlock.lock.wait_s": wait_s, "hotlock.lock.attempts": attempts}
        )

    def not_acquired(self, key: str | bytes, outcome: NotAcquired, wait_s: float) -> None:
        name = "hotlock.wait" if outcome == "timeout" else "hotlock.acquire"
        self._span(name, key, wait_s, outcome, {"hotlock.lock.wait_s": wait_s})

    def released(self, key: str | bytes, held_s: float) -> None:
        self._span("hotlock.hold", key, held_s, "released", {"hotlock.lock.held_s": held_s})

    def extended(self, key: str | bytes, ok: bool) -> None:
        if not ok:
            self._span("hotlock.extend", key, 0.0, "lost", error="the lock was lost: another token or none")

    def lost(self, key: str | bytes, held_s: float) -> None:
        end = time.time_ns()
        span = self._tracer.start_span(
            "hotlock.hold",
            kind=SpanKind.INTERNAL,
            start_time=end - int(max(held_s, 0.0) * _NS),
            attributes={"hotlock.lock.key": _key(key), "hotlock.lock.outcome": "lost", "hotlock.lock.held_s": held_s},
        )
        # The work since the lease ran out was not protected: an error of the hold itself.
        span.add_event("lost", timestamp=end)
        span.set_status(Status(StatusCode.ERROR, "lease lost while held"))
        span.end(end_time=end)

    def error(self, key: str | bytes, op: Op, error: CacheError) -> None:
        kind = error_kind(error)
        self._span(f"hotlock.{op}", key, 0.0, "error", {"error.type": kind}, error=str(error))

    def __repr__(self) -> str:
        return "<hotlock.otel.OtelListener>"
