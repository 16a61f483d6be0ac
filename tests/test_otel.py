"""hotlock.otel: spans from the metrics listener, read back from the SDK's in-memory exporter,
on the real backends and servers (and beside the Prometheus listener on the same cache)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator

import pytest

pytest.importorskip("opentelemetry.sdk")

from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import StatusCode
from prometheus_client import CollectorRegistry

import hotlock
import hotlock.aio
from hotlock.metrics import PrometheusMetrics
from hotlock.otel import OtelListener

from .conftest import free_port, open_cache


@pytest.fixture
def traced() -> Iterator[tuple[TracerProvider, InMemorySpanExporter]]:
    provider = TracerProvider()
    exporter = InMemorySpanExporter()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    yield provider, exporter
    provider.shutdown()


def named(spans: tuple[ReadableSpan, ...], name: str) -> list[ReadableSpan]:
    return [s for s in spans if s.name == name]


def no_token_anywhere(spans: tuple[ReadableSpan, ...], tokens: list[bytes]) -> None:
    for span in spans:
        text = repr(dict(span.attributes or {})) + repr(span.status.description) + repr(span.events)
        for token in tokens:
            assert token.hex() not in text and repr(token) not in text


def test_spans_for_acquire_wait_hold_and_conflict(
    backend: str, server_url: str, traced: tuple[TracerProvider, InMemorySpanExporter]
) -> None:
    provider, exporter = traced
    prometheus = PrometheusMetrics(registry=CollectorRegistry())
    cache = open_cache(backend, server_url, metrics=[OtelListener(provider), prometheus])
    tracer = provider.get_tracer("test")
    try:
        with tracer.start_as_current_span("request") as request:
            first = cache.lock("otel:a", ttl=5)
            with pytest.raises(hotlock.LockNotAcquired):
                cache.lock("otel:a", ttl=5)
            with pytest.raises(hotlock.LockNotAcquired):
                cache.lock_wait("otel:a", ttl=5, wait=0.1)
            time.sleep(0.05)
            tokens = [first._token]
            first.unlock()
            cache.lock_wait("otel:a", ttl=5, wait=1).unlock()
        spans = exporter.get_finished_spans()
        # Every lock span is a child of the request span that was current.
        request_id = request.get_span_context().span_id
        ours = [s for s in spans if s.name.startswith("hotlock.")]
        assert ours and all(s.parent is not None and s.parent.span_id == request_id for s in ours)
        assert [(s.name, s.attributes["hotlock.lock.outcome"]) for s in ours] == [
            ("hotlock.acquire", "acquired"),
            ("hotlock.acquire", "held"),
            ("hotlock.wait", "timeout"),
            ("hotlock.hold", "released"),
            ("hotlock.wait", "acquired"),
            ("hotlock.hold", "released"),
        ]
        assert all(s.attributes["hotlock.lock.key"] == "otel:a" for s in ours)
        acquire, held, timeout, hold, waited = ours[0], ours[1], ours[2], ours[3], ours[4]
        assert acquire.attributes["hotlock.lock.attempts"] == 1
        assert waited.attributes["hotlock.lock.attempts"] == 1  # the key was free: got at once
        assert timeout.attributes["hotlock.lock.attempts"] >= 1
        assert held.status.status_code is StatusCode.UNSET  # a conflict is no error
        # The wait's span lasts its wait; the hold's its hold (from the acquire to the release).
        assert 0.09 <= (timeout.end_time - timeout.start_time) / 1e9 < 1.0
        assert timeout.attributes["hotlock.lock.wait_s"] >= 0.09
        assert 0.14 <= (hold.end_time - hold.start_time) / 1e9 < 2.0
        # The hold's span is placed back from its end by the lock's monotonic hold time, so
        # the two clocks' drift (microseconds) may put its start just after the acquire's end.
        assert hold.start_time <= acquire.end_time + 1_000_000
        no_token_anywhere(spans, tokens)
        # The other listener on the same cache heard the same events.
        samples = {
            (m.name, s.labels.get("outcome")): s.value
            for m in prometheus.collect()
            for s in m.samples
            if "outcome" in s.labels
        }
        assert samples[("hotlock_acquisitions", "acquired")] == 2
        assert samples[("hotlock_acquisitions", "held")] == 1
        assert samples[("hotlock_acquisitions", "timeout")] == 1
    finally:
        cache.close()


def test_a_wait_span_counts_its_attempts(
    backend: str, server_url: str, traced: tuple[TracerProvider, InMemorySpanExporter]
) -> None:
    provider, exporter = traced
    cache = open_cache(backend, server_url, metrics=OtelListener(provider))
    try:
        cache.lock("otel:busy", ttl=0.3)  # a holder whose lease runs out
        cache.lock_wait("otel:busy", ttl=5, wait=5).unlock()
    finally:
        cache.close()
    (wait,) = named(exporter.get_finished_spans(), "hotlock.wait")
    assert wait.attributes is not None
    assert wait.attributes["hotlock.lock.outcome"] == "acquired"
    # The first attempt found the key held; tests/test_metrics.py holds the count to the
    # scripts the server ran.
    assert wait.attributes["hotlock.lock.attempts"] >= 2
    assert 0.2 <= wait.attributes["hotlock.lock.wait_s"] < 3.0


def test_a_lost_lease_is_an_error_span(
    redis_backend: str, server_url: str, traced: tuple[TracerProvider, InMemorySpanExporter]
) -> None:
    provider, exporter = traced
    cache = open_cache(redis_backend, server_url, metrics=OtelListener(provider))
    try:
        lock = cache.lock("otel:lost", ttl=0.1)
        time.sleep(0.2)
        cache.lock("otel:lost", ttl=5)  # taken over
        with pytest.raises(hotlock.LockLost):
            lock.extend(5)
        spans = exporter.get_finished_spans()
        extend = named(spans, "hotlock.extend")
        assert len(extend) == 1 and extend[0].status.status_code is StatusCode.ERROR
        lost = [s for s in named(spans, "hotlock.hold") if s.attributes["hotlock.lock.outcome"] == "lost"]
        assert len(lost) == 1
        assert lost[0].status.status_code is StatusCode.ERROR
        assert [e.name for e in lost[0].events] == ["lost"]
        assert lost[0].attributes["hotlock.lock.held_s"] >= 0.2
    finally:
        cache.close()


def test_an_outage_is_an_error_span(traced: tuple[TracerProvider, InMemorySpanExporter]) -> None:
    provider, exporter = traced
    cache = hotlock.connect(
        f"redis://127.0.0.1:{free_port()}/0",
        lazy=True,
        timeout=0.5,
        connect_timeout=0.5,
        metrics=OtelListener(provider),
    )
    try:
        with pytest.raises(hotlock.CacheError):
            cache.lock("otel:down")
    finally:
        cache.close()
    (span,) = exporter.get_finished_spans()
    assert span.name == "hotlock.acquire"
    assert span.status.status_code is StatusCode.ERROR
    assert span.attributes["error.type"] == "connection"
    assert span.attributes["hotlock.lock.outcome"] == "error"


def test_async_spans(redis_url: str, traced: tuple[TracerProvider, InMemorySpanExporter]) -> None:
    provider, exporter = traced
    tracer = provider.get_tracer("test")

    async def main() -> int:
        cache = await hotlock.aio.connect(redis_url, metrics=OtelListener(provider))
        try:
            with tracer.start_as_current_span("task") as task:
                async with cache.lock("otel:aio", ttl=5):
                    with pytest.raises(hotlock.LockNotAcquired):
                        await cache.lock("otel:aio", ttl=5)
                await cache.lock("otel:aio2", ttl=0.2)  # runs out
                await (await cache.lock_wait("otel:aio2", ttl=5, wait=5)).unlock()
            return task.get_span_context().span_id
        finally:
            await cache.close()

    parent = asyncio.run(main())
    ours = [s for s in exporter.get_finished_spans() if s.name.startswith("hotlock.")]
    assert [(s.name, s.attributes["hotlock.lock.outcome"]) for s in ours] == [
        ("hotlock.acquire", "acquired"),
        ("hotlock.acquire", "held"),
        ("hotlock.hold", "released"),
        ("hotlock.acquire", "acquired"),
        ("hotlock.wait", "acquired"),
        ("hotlock.hold", "released"),
    ]
    assert all(s.parent is not None and s.parent.span_id == parent for s in ours)
    assert ours[4].attributes["hotlock.lock.attempts"] >= 2
