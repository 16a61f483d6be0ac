"""hotlock.celery with real Celery: a prefork worker (two pool processes) on a Redis the test
starts, its tasks locked where they run; crashed and time-limited holders; redelivery."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from celery import Celery

import hotlock
import hotlock.celery

from .celery_app import app
from .conftest import RedisServer, start_redis
from .overlap import FileOverlapLog

ROOT = Path(__file__).resolve().parent.parent


class Worker:
    """``celery worker -P prefork -c 2`` in a process group of its own."""

    def __init__(self, url: str, out: Path, **env: str) -> None:
        self.out = out
        out.mkdir(parents=True, exist_ok=True)
        self.log = open(out / "worker.log", "wb")  # noqa: SIM115 (closed in stop)
        environ = {
            **os.environ,
            "HOTLOCK_TEST_BROKER": url,
            "HOTLOCK_TEST_OUT": str(out),
            "PYTHONPATH": str(ROOT),
            **env,
        }
        cmd = [
            sys.executable,
            "-m",
            "celery",
            "-A",
            "tests.celery_app",
            "worker",
            "-P",
            "prefork",
            "-c",
            "2",
            "--without-gossip",
            "--without-mingle",
            "--without-heartbeat",
            "-l",
            "info",
        ]
        self.proc = subprocess.Popen(
            cmd, cwd=ROOT, env=environ, stdout=self.log, stderr=subprocess.STDOUT, start_new_session=True
        )
        deadline = time.monotonic() + 30
        while not any(p.name.startswith("ready-") for p in out.iterdir()):
            assert self.proc.poll() is None, self.text()
            assert time.monotonic() < deadline, "the worker did not become ready in 30 s:\n" + self.text()
            time.sleep(0.1)

    def text(self) -> str:
        return (self.out / "worker.log").read_text(errors="replace")[-4000:]

    def stop(self) -> None:
        # The whole group: the pool processes too (a task may sleep for a minute).
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait(10)
        self.log.close()


@pytest.fixture(scope="module")
def broker() -> Iterator[RedisServer]:
    server = start_redis()
    app.conf.update(broker_url=server.url, result_backend=server.url)
    yield server
    server.stop()


def wait_for(path: Path, timeout: float = 30) -> str:
    deadline = time.monotonic() + timeout
    while not path.exists() or not path.read_text():
        assert time.monotonic() < deadline, f"{path.name} never appeared"
        time.sleep(0.02)
    return path.read_text()


def lines(path: Path) -> int:
    return len(path.read_text().split()) if path.exists() else 0


def free_after(cache: hotlock.Cache, key: str, timeout: float) -> float:
    """Seconds until ``key`` can be locked (polled every 20 ms)."""
    start = time.monotonic()
    while True:
        try:
            cache.lock(key, ttl=1).unlock()
            return time.monotonic() - start
        except hotlock.LockNotAcquired:
            assert time.monotonic() - start < timeout, f"{key} still held after {timeout} s"
            time.sleep(0.02)


@pytest.fixture
def worker(broker: RedisServer, tmp_path: Path) -> Iterator[Worker]:
    """A worker per test, so xdist never runs two at once for this module's checks."""
    w = Worker(broker.url, tmp_path)
    yield w
    w.stop()


def no_overlap_per_key_in_two_pool_processes(worker: Worker) -> None:
    # 16 tasks on 2 keys, each 0.15 s inside; a conflict retries after ~50 ms.
    results = [app.signature("tests.celery_app.hold", (n % 2, 0.15)).delay() for n in range(16)]
    pids = {r.get(timeout=60) for r in results}
    overlaps, most, sections = FileOverlapLog(str(worker.out / "sections")).count()
    assert (overlaps, most, sections) == (0, 1, 16)
    assert len(pids) == 2, "both pool processes ran tasks"


def the_checker_catches_a_broken_lock(worker: Worker) -> None:
    # The same sections with no lock: the two pool processes are inside one key at once.
    results = [app.signature("tests.celery_app.unlocked_hold", (0, 0.5)).delay() for _ in range(4)]
    for r in results:
        r.get(timeout=30)
    overlaps, most, sections = FileOverlapLog(str(worker.out / "unlocked")).count()
    assert sections == 4
    assert overlaps >= 1 and most == 2


def a_conflict_skips_without_failing(worker: Worker) -> None:
    first = app.signature("tests.celery_app.skip_hold", (1, 1.5)).delay()
    time.sleep(0.5)
    second = app.signature("tests.celery_app.skip_hold", (1, 0)).delay()
    assert second.get(timeout=30) is None
    assert second.state == "SUCCESS"
    assert first.get(timeout=30) == "ran"
    # Once free, the key runs again.
    assert app.signature("tests.celery_app.skip_hold", (1, 0)).delay().get(timeout=30) == "ran"


def a_conflict_raises_when_asked(worker: Worker) -> None:
    first = app.signature("tests.celery_app.raise_hold", (1, 1.5)).delay()
    time.sleep(0.5)
    second = app.signature("tests.celery_app.raise_hold", (1, 0)).delay()
    second.get(timeout=30, propagate=False)
    assert second.state == "FAILURE"
    assert "LockNotAcquired" in (second.traceback or "")
    assert first.get(timeout=30) == "ran"


def a_sigkilled_task_frees_its_key_within_the_ttl(worker: Worker, broker: RedisServer) -> None:
    app.signature("tests.celery_app.long_hold", (3,)).delay()
    pid = int(wait_for(worker.out / "pid-3"))
    with hotlock.connect(broker.url) as cache:
        time.sleep(2.5)  # past one TTL: held because it is extended, not by its first TTL
        with pytest.raises(hotlock.LockNotAcquired):
            cache.lock("long:3", ttl=1)
        os.kill(pid, signal.SIGKILL)
        took = free_after(cache, "long:3", timeout=10)
    print(f"\nSIGKILLed pool process: key free after {took:.2f} s (ttl 2 s)")
    assert took <= 2.0 + 0.5


def a_time_limited_task_frees_its_key_within_the_ttl(worker: Worker, broker: RedisServer) -> None:
    result = app.signature("tests.celery_app.limited_hold", (4,)).delay()
    started = float(wait_for(worker.out / "started-4"))
    with hotlock.connect(broker.url) as cache:
        with pytest.raises(hotlock.LockNotAcquired):
            cache.lock("limited:4", ttl=1)
        free_after(cache, "limited:4", timeout=15)
    took = time.time() - started
    result.get(timeout=30, propagate=False)
    assert result.state == "FAILURE"  # TimeLimitExceeded: the pool killed the process
    print(f"\ntime-limited task (limit 1 s): key free {took:.2f} s after it started (ttl 2 s)")
    assert took <= 1.0 + 2.0 + 1.0


def test_exclusion_and_conflicts_in_a_prefork_worker(worker: Worker) -> None:
    no_overlap_per_key_in_two_pool_processes(worker)
    the_checker_catches_a_broken_lock(worker)
    a_conflict_skips_without_failing(worker)
    a_conflict_raises_when_asked(worker)


def test_killed_holders_free_their_key_within_the_ttl(worker: Worker, broker: RedisServer) -> None:
    a_sigkilled_task_frees_its_key_within_the_ttl(worker, broker)
    a_time_limited_task_frees_its_key_within_the_ttl(worker, broker)


def test_a_redelivered_task_charges_once(broker: RedisServer, tmp_path: Path) -> None:
    # A broker visibility timeout of 2 s and tasks of 4 s with acks_late: Redis hands each
    # message to a worker again while its first run is still going (kombu's redelivery).
    url = broker.url.rsplit("/", 1)[0] + "/1"  # a db of its own: the sweep sees only these
    worker = Worker(url, tmp_path, HOTLOCK_TEST_VISIBILITY="2")
    sender = Celery("sender", broker=url, backend=url)
    try:
        marked = sender.send_task("tests.celery_app.charge", (1, 4.0))
        unmarked = sender.send_task("tests.celery_app.charge_unmarked", (2, 4.0))
        delivered = tmp_path / "delivered-charge"
        deadline = time.monotonic() + 40
        # Until the marked charge was delivered twice and the unmarked one charged twice.
        while lines(delivered) < 2 or lines(tmp_path / "charges-unmarked") < 2:
            assert time.monotonic() < deadline, worker.text()
            time.sleep(0.1)
        assert marked.get(timeout=30) in ("charged", None)
        time.sleep(0.5)  # the redelivered copy, if it ran, would have charged by now
        charges = (tmp_path / "charges").read_text().split()
        deliveries = delivered.read_text().split()
        print(
            f"\nredelivery: charge delivered {len(deliveries)} times, charged {len(charges)} time(s); "
            f"without the marker: charged {len((tmp_path / 'charges-unmarked').read_text().split())} times"
        )
        assert deliveries.count(marked.id) >= 2
        assert charges == ["1"]
        # The control: the same redelivery without the marker charges twice.
        assert unmarked.id in (tmp_path / "delivered-charge_unmarked").read_text().split()
    finally:
        worker.stop()
        sender.close()


def test_bad_options_fail_at_decoration() -> None:
    from .celery_app import cache

    with pytest.raises(ValueError, match="names 'nope'"):

        @hotlock.celery.locked_task(app, "k:{nope}", cache=cache)
        def f(x: int) -> None: ...

    with pytest.raises(ValueError, match="on_conflict"):
        hotlock.celery.locked_task(app, "k", cache=cache, on_conflict="wait")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="hotlock_cache"):
        hotlock.celery.locked_task(app, "k", cache="redis://x")  # type: ignore[arg-type]
    with pytest.raises(ValueError):
        hotlock.celery.locked_task(app, "k", cache=cache, ttl=0)


# -- in-process (Task.apply), against the shared server: the options' logic, fast --------


def eager_app(url: str, ran: list[object]) -> tuple[Celery, dict[str, object]]:
    eager = Celery("eager", set_as_current=False)

    def cache() -> hotlock.Cache:
        return hotlock.connect(url)

    @hotlock.celery.locked_task(eager, "k:{n}", cache=cache, ttl=5, on_conflict="skip", max_retries=0)
    def skip(n: int) -> str:
        ran.append(("skip", n))
        return "ran"

    @hotlock.celery.locked_task(
        eager, "k:{n}", cache=cache, ttl=5, on_conflict="retry", max_retries=2, conflict_countdown=0.01
    )
    def retry(n: int) -> str:
        ran.append(("retry", n))
        return "ran"

    @hotlock.celery.locked_task(eager, "once:{n}", cache=cache, ttl=5, done_ttl=60)
    def once(n: int) -> str:
        ran.append(("once", n))
        return "ran"

    @hotlock.celery.locked_task(eager, "b:{n}", cache=cache, bind=True)
    def bound(self: object, n: int) -> str:
        ran.append(("bound", type(self).__name__))
        return "ran"

    return eager, {"skip": skip, "retry": retry, "once": once, "bound": bound}


def test_skip_retry_and_done_marker_in_process(redis_url: str) -> None:
    ran: list[object] = []
    _, tasks = eager_app(redis_url, ran)
    skip, retry, once, bound = (tasks[n] for n in ("skip", "retry", "once", "bound"))
    with hotlock.connect(redis_url) as cache:
        with cache.lock("k:1", ttl=5):
            result = skip.apply((1,))  # type: ignore[attr-defined]
            assert (result.state, result.result, ran) == ("SUCCESS", None, [])
            result = retry.apply((1,))  # type: ignore[attr-defined]
            assert result.state == "FAILURE" and isinstance(result.result, hotlock.LockNotAcquired)
            assert ran == []
        assert skip.apply((1,)).result == "ran"  # type: ignore[attr-defined]
        # The same delivery (task id and retries) twice: the body runs once.
        assert once.apply((7,), task_id="t-1").result == "ran"  # type: ignore[attr-defined]
        assert once.apply((7,), task_id="t-1").result is None  # type: ignore[attr-defined]
        assert once.apply((7,), task_id="t-2").result == "ran"  # type: ignore[attr-defined]
        # Called as a function: locked, and no marker (there is no delivery to repeat).
        assert once(7) == "ran" and once(7) == "ran"  # type: ignore[operator]
        assert ran == [("skip", 1), ("once", 7), ("once", 7), ("once", 7), ("once", 7)]
        ran.clear()
        with cache.lock("b:3", ttl=5):
            assert bound.apply((3,)).result is None  # type: ignore[attr-defined]
        assert bound.apply((3,)).result == "ran" and len(ran) == 1  # type: ignore[attr-defined]
