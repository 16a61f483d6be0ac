"""hotlock.otel under a real Celery worker: a prefork worker (two pool processes, as in
tests/test_celery.py) traced by the OpenTelemetry SDK and opentelemetry-instrumentation-celery,
which wraps each task's run in a span; the hotlock.celery lock's spans must be its children.

The worker's spans cross no process boundary in memory: each pool process writes them as
JSON lines (tests/celery_app.py, HOTLOCK_TEST_OTEL=1), read back here. The test sends the
tasks under a span of its own, its W3C trace context in the message headers, so the worker's
spans join the test's trace.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from datetime import datetime
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("opentelemetry.sdk")
pytest.importorskip("opentelemetry.instrumentation.celery")

from celery import Celery
from opentelemetry.propagate import inject
from opentelemetry.sdk.trace import TracerProvider

from .conftest import RedisServer, start_redis
from .test_celery import Worker

Span = dict[str, Any]


@pytest.fixture(scope="module")
def broker() -> Iterator[RedisServer]:
    server = start_redis()
    yield server
    server.stop()


def worker_spans(out: Path) -> list[Span]:
    return [json.loads(line) for f in sorted(out.glob("spans-*.jsonl")) for line in f.read_text().splitlines()]


def when(stamp: str) -> float:
    return datetime.fromisoformat(stamp.replace("Z", "+00:00")).timestamp()


def test_lock_spans_are_children_of_the_celery_task_span(broker: RedisServer, tmp_path: Path) -> None:
    sender = Celery("hotlock_otel_sender", broker=broker.url, backend=broker.url)
    tracer = TracerProvider().get_tracer("test")
    side = broker.client()
    worker = Worker(broker.url, tmp_path, HOTLOCK_TEST_OTEL="1")
    values: set[bytes] = set()  # every lock value seen in Redis: the token is its first 16 bytes

    def held(key: str) -> list[bytes]:
        found = [side.get(k) for k in side.scan_iter(match=f"*lock:{{{key}}}")]  # a lock's Redis key
        return [v for v in found if v is not None]

    try:
        with tracer.start_as_current_span("enqueue") as root:

            def send(name: str, *args: object) -> Any:
                headers: dict[str, str] = {}
                inject(headers)  # the W3C traceparent of the current span: "enqueue"
                return sender.send_task(f"tests.celery_app.{name}", args, headers=headers)

            results = [send("traced_once", "a", 0.3), send("traced_wait", "b", 1.0)]
            deadline = time.monotonic() + 30
            while not held("otel:wait:b"):  # the first wait task holds its key...
                assert time.monotonic() < deadline, "the first traced_wait never took its key:\n" + worker.text()
                values.update(held("otel:*"))
                time.sleep(0.01)
            results.append(send("traced_wait", "b", 0.3))  # ...so this one waits for it
            while not all(r.ready() for r in results):
                assert time.monotonic() < deadline, "the tasks did not finish:\n" + worker.text()
                values.update(held("otel:*"))
                time.sleep(0.01)
        pids = {r.get(timeout=10) for r in results}
        # The run span ends at task_postrun, after the result is stored: wait for all three.
        while len(runs := [s for s in worker_spans(tmp_path) if s["name"].startswith("run/")]) < 3:
            assert time.monotonic() < deadline, "the task spans never came:\n" + worker.text()
            time.sleep(0.05)
        spans = worker_spans(tmp_path)
    finally:
        worker.stop()
        sender.close()

    trace_id = f"0x{root.get_span_context().trace_id:032x}"
    assert len(pids) == 2, "both pool processes ran tasks"
    assert sorted(s["name"] for s in runs) == [
        "run/tests.celery_app.traced_once",
        "run/tests.celery_app.traced_wait",
        "run/tests.celery_app.traced_wait",
    ]
    # The tasks' spans continue the sender's trace, under its span.
    for run in runs:
        assert run["context"]["trace_id"] == trace_id
        assert run["parent_id"] == f"0x{root.get_span_context().span_id:016x}"
    ours = [s for s in spans if s["name"].startswith("hotlock.")]
    by_run = {run["context"]["span_id"]: run for run in runs}
    # Every lock span is a child of a task's run span, in its trace, within its time.
    for span in ours:
        run = by_run.get(span["parent_id"])
        assert run is not None, f"{span['name']} is not under a task span: parent {span['parent_id']}"
        assert span["context"]["trace_id"] == trace_id
        assert when(run["start_time"]) - 0.05 <= when(span["start_time"]) <= when(span["end_time"])
        assert when(span["end_time"]) <= when(run["end_time"]) + 0.05

    def children(run: Span) -> list[tuple[str, str, str]]:
        kids = [s for s in ours if s["parent_id"] == run["context"]["span_id"]]
        return sorted(
            (s["name"], s["attributes"]["hotlock.lock.key"], s["attributes"]["hotlock.lock.outcome"]) for s in kids
        )

    once = next(r for r in runs if r["name"].endswith("traced_once"))
    assert children(once) == [
        ("hotlock.acquire", "otel:once:a", "acquired"),
        ("hotlock.hold", "otel:once:a", "released"),
    ]
    waits = [r for r in runs if r["name"].endswith("traced_wait")]
    for run in waits:
        assert children(run) == [
            ("hotlock.hold", "otel:wait:b", "released"),
            ("hotlock.wait", "otel:wait:b", "acquired"),
        ]
    # One wait task got the key at once; the other waited for the first to finish.
    attempts = sorted(
        (s["attributes"]["hotlock.lock.attempts"], s["attributes"]["hotlock.lock.wait_s"])
        for s in ours
        if s["name"] == "hotlock.wait"
    )
    assert attempts[0][0] == 1
    assert attempts[1][0] >= 2 and attempts[1][1] >= 0.2
    # The tokens (seen in Redis while held) appear nowhere in what the worker exported.
    tokens = {v[:16] for v in values}
    assert len(tokens) >= 2, "the test saw too few tokens to check"
    text = "\n".join(f.read_text() for f in tmp_path.glob("spans-*.jsonl"))
    for token in tokens:
        for shown in (token.hex(), repr(token)[2:-1], token.decode("utf-8", "backslashreplace")):
            assert shown not in text
    print(
        f"\n{len(ours)} lock spans under {len(runs)} task spans in {len(pids)} pool processes; "
        f"the waiting task's hotlock.wait: {attempts[1][0]} attempts over {attempts[1][1]:.2f} s"
    )
