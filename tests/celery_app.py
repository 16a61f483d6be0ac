"""The Celery app of tests/test_celery.py, run by its worker processes (``celery -A tests.celery_app``).

Configured from the environment the test gives the worker: HOTLOCK_TEST_BROKER (a Redis
the test started: broker, result backend and locks), HOTLOCK_TEST_OUT (a directory for the
files the tasks write), HOTLOCK_TEST_VISIBILITY (the broker's visibility timeout, s),
HOTLOCK_TEST_OTEL=1 (tests/test_otel_celery.py: trace each pool process's tasks with the
OpenTelemetry SDK and its Celery instrumentation, the spans written as JSON lines to
spans-<pid>.jsonl in HOTLOCK_TEST_OUT).
"""

from __future__ import annotations

import os
import time
from typing import Any

from celery import Celery, Task
from celery.signals import task_prerun, worker_process_init, worker_ready

import hotlock
from hotlock.celery import LockedTask, locked_task

from .overlap import FileOverlapLog

BROKER = os.environ.get("HOTLOCK_TEST_BROKER", "redis://127.0.0.1:1/0")
OUT = os.environ.get("HOTLOCK_TEST_OUT", "/nonexistent")
VISIBILITY = float(os.environ.get("HOTLOCK_TEST_VISIBILITY", "3600"))
OTEL = os.environ.get("HOTLOCK_TEST_OTEL") == "1"

app = Celery("hotlock_test", broker=BROKER, backend=BROKER)
app.conf.update(
    worker_prefetch_multiplier=1,
    broker_connection_retry_on_startup=True,
    result_expires=600,
    broker_transport_options={
        "visibility_timeout": VISIBILITY,
        # Sweep for messages past their visibility timeout every second, not every 100 s.
        "unacked_restore_interval": 1,
        "unacked_restore_throttle": 1,
    },
)


def cache() -> hotlock.Cache:
    return hotlock.connect(BROKER)


def out(name: str) -> str:
    return os.path.join(OUT, name)


@worker_ready.connect
def _ready(**_: Any) -> None:
    with open(out(f"ready-{os.getpid()}"), "w"):
        pass


@worker_process_init.connect(weak=False)
def _tracing(**_: Any) -> None:
    # In each pool process, after the fork, as the instrumentation's docs say: a span
    # processor's state must not be shared with the parent. The SDK's in-memory exporter
    # cannot cross processes, so each pool process appends its spans to a file of its own.
    if not OTEL:
        return
    from opentelemetry import trace
    from opentelemetry.instrumentation.celery import CeleryInstrumentor
    from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
    from opentelemetry.sdk.trace.export import ConsoleSpanExporter, SimpleSpanProcessor

    def line(span: ReadableSpan) -> str:
        return span.to_json(indent=None) + "\n"

    spans = open(out(f"spans-{os.getpid()}.jsonl"), "a", buffering=1)  # noqa: SIM115 (the process's life)
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(ConsoleSpanExporter(out=spans, formatter=line)))
    trace.set_tracer_provider(provider)
    CeleryInstrumentor().instrument(tracer_provider=provider)


def traced_cache() -> hotlock.Cache:
    from hotlock.otel import OtelListener

    # The global tracer provider, set by _tracing in this pool process.
    return hotlock.connect(BROKER, metrics=OtelListener())


@task_prerun.connect
def _delivered(task_id: str, task: Task, **_: Any) -> None:
    # One line per delivery that reached the pool: redeliveries show here.
    with open(out(f"delivered-{task.name.rsplit('.', 1)[-1]}"), "a") as f:
        f.write(f"{task_id}\n")


def _section(log: str, slot: int, seconds: float) -> None:
    checker = FileOverlapLog(out(log))
    checker.enter(slot)
    time.sleep(seconds)
    checker.exit(slot)


@app.task(
    base=LockedTask,
    hotlock_cache=cache,
    lock_key="slot:{slot}",
    on_conflict="retry",
    conflict_countdown=0.05,
    max_retries=None,
)
def hold(slot: int, seconds: float) -> int:
    _section("sections", slot, seconds)
    return os.getpid()


@app.task
def unlocked_hold(slot: int, seconds: float) -> int:
    # The broken lock: the same sections with no lock at all.
    _section("unlocked", slot, seconds)
    return os.getpid()


@locked_task(app, "skip:{slot}", cache=cache, ttl=5, on_conflict="skip", max_retries=0)
def skip_hold(slot: int, seconds: float) -> str:
    time.sleep(seconds)
    return "ran"


@locked_task(app, "raise:{slot}", cache=cache, ttl=5, on_conflict="raise")
def raise_hold(slot: int, seconds: float) -> str:
    time.sleep(seconds)
    return "ran"


@locked_task(app, "long:{slot}", cache=cache, ttl=2)
def long_hold(slot: int) -> None:
    with open(out(f"pid-{slot}"), "w") as f:
        f.write(str(os.getpid()))
    time.sleep(60)


@locked_task(app, "limited:{slot}", cache=cache, ttl=2, time_limit=1)
def limited_hold(slot: int) -> None:
    with open(out(f"started-{slot}"), "w") as f:
        f.write(str(time.time()))
    time.sleep(60)


def _charge(name: str, invoice: int, seconds: float) -> str:
    with open(out(name), "a") as f:
        f.write(f"{invoice}\n")
    time.sleep(seconds)
    return "charged"


@locked_task(
    app,
    "invoice:{invoice}",
    cache=cache,
    ttl=5,
    on_conflict="retry",
    conflict_countdown=0.5,
    done_ttl=600,
    acks_late=True,
)
def charge(invoice: int, seconds: float) -> str:
    return _charge("charges", invoice, seconds)


@locked_task(app, "invoice:{invoice}", cache=cache, ttl=5, on_conflict="retry", conflict_countdown=0.5, acks_late=True)
def charge_unmarked(invoice: int, seconds: float) -> str:
    # The control: the same task without the done-marker.
    return _charge("charges-unmarked", invoice, seconds)


@locked_task(app, "otel:once:{name}", cache=traced_cache, ttl=5, on_conflict="raise")
def traced_once(name: str, seconds: float) -> int:
    time.sleep(seconds)
    return os.getpid()


@locked_task(app, "otel:wait:{name}", cache=traced_cache, ttl=5, wait=10)
def traced_wait(name: str, seconds: float) -> int:
    time.sleep(seconds)
    return os.getpid()
