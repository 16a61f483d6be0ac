"""Metrics (docs/metrics.md): connect(metrics=listener) on every backend, sync
and async, and hotlock.metrics.PrometheusMetrics scraped from a real registry after real
lock traffic against the test redis-server.
"""

from __future__ import annotations

import logging
import time
from typing import Any

import pytest
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

import hotlock
import hotlock.aio
from hotlock import CacheError, LockLost, LockNotAcquired
from hotlock._fastpath import NativeCache
from hotlock.metrics import BaseListener, PrometheusMetrics, error_kind, first_segment

from .conftest import RedisServer, open_cache, start_redis
from .test_aio import BACKENDS as AIO_BACKENDS
from .test_aio import LOOPS, Aio, _require


def scrape(registry: CollectorRegistry) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """Every sample of the registry's text exposition, parsed back: (name, labels) -> value."""
    text = generate_latest(registry).decode()
    out = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            out[(sample.name, tuple(sorted(sample.labels.items())))] = sample.value
    return out


def value(samples: dict[Any, float], name: str, **labels: str) -> float:
    return samples.get((name, tuple(sorted(labels.items()))), 0.0)


class Recorder(BaseListener):
    """Every event, in order."""

    def __init__(self) -> None:
        self.events: list[tuple[Any, ...]] = []

    def acquired(self, key: str | bytes, wait_s: float, attempts: int | None) -> None:
        self.events.append(("acquired", key, attempts))
        assert wait_s >= 0

    def not_acquired(self, key: str | bytes, outcome: str, wait_s: float) -> None:  # type: ignore[override]
        self.events.append(("not_acquired", key, outcome))

    def released(self, key: str | bytes, held_s: float) -> None:
        self.events.append(("released", key))
        assert held_s >= 0

    def extended(self, key: str | bytes, ok: bool) -> None:
        self.events.append(("extended", key, ok))

    def lost(self, key: str | bytes, held_s: float) -> None:
        self.events.append(("lost", key))

    def error(self, key: str | bytes, op: str, error: CacheError) -> None:  # type: ignore[override]
        self.events.append(("error", key, op, error_kind(error)))


def traffic(cache: hotlock.Cache) -> None:
    """A known mix: 6 acquired (1 after waiting), 2 held, 1 timeout; 4 extends ok, 1 lost;
    1 lease found lost (twice: counted once); 5 released."""
    a = cache.lock("settle:a", ttl=5)  # acquired 1
    for _ in range(2):
        with pytest.raises(LockNotAcquired):
            cache.lock("settle:a", ttl=5)  # held x2
    with pytest.raises(LockNotAcquired):
        cache.lock_wait("settle:a", ttl=5, wait=0.05)  # timeout
    a.extend(5)  # extend ok 1
    time.sleep(0.02)
    assert a.unlock()  # released 1 (held >= 20 ms)
    b = cache.lock_wait("settle:b", ttl=0.05, wait=1)  # acquired 2 (after no wait)
    time.sleep(0.12)  # b expires
    with pytest.raises(LockLost):
        b.extend(5)  # extend lost 1, lost 1
    assert b.unlock() is False  # the same lease found lost again: not counted again
    many = cache.lock_many(["sync:a", "sync:b", "sync:c"], ttl=5)  # acquired 3, 4, 5
    assert cache.extend_many([*many, None], ttl=5) == [True, True, True, False]  # extend ok 2, 3, 4
    assert cache.unlock_many(many) == [True, True, True]  # released 2, 3, 4
    assert cache.with_lock("export:1", 5, lambda: 7) == 7  # acquired 6, released 5


@pytest.mark.parametrize("labelled", [False, True], ids=["plain", "key_space"])
def test_prometheus_counts_real_traffic(backend: str, redis_url: str, labelled: bool) -> None:
    registry = CollectorRegistry()
    metrics = PrometheusMetrics(registry, key_space=first_segment if labelled else None)
    with open_cache(backend, redis_url, metrics=metrics) as cache:
        traffic(cache)
    s = scrape(registry)

    def total(name: str, **labels: str) -> float:
        if not labelled:
            return value(s, name, **labels)
        return sum(v for (n, lab), v in s.items() if n == name and set(labels.items()) <= set(lab))

    assert total("hotlock_acquisitions_total", outcome="acquired") == 6
    assert total("hotlock_acquisitions_total", outcome="held") == 2
    assert total("hotlock_acquisitions_total", outcome="timeout") == 1
    assert total("hotlock_acquisitions_total", outcome="error") == 0
    assert total("hotlock_acquire_wait_seconds_count") == 6
    assert total("hotlock_hold_seconds_count") == 5
    assert total("hotlock_hold_seconds_sum") >= 0.02
    assert total("hotlock_extensions_total", outcome="ok") == 4
    assert total("hotlock_extensions_total", outcome="lost") == 1
    assert total("hotlock_lost_total") == 1
    if labelled:
        # By key space, never by key: "settle", "sync" and "export", not "settle:a".
        spaces = {dict(lab).get("key_space") for (n, lab) in s if n == "hotlock_acquisitions_total"}
        assert spaces == {"settle", "sync", "export"}
        assert value(s, "hotlock_acquisitions_total", key_space="sync", outcome="acquired") == 3
    else:
        assert not any("key_space" in dict(lab) for _, lab in s)


def test_no_label_carries_a_key(redis_url: str) -> None:
    registry = CollectorRegistry()
    with hotlock.connect(redis_url, metrics=PrometheusMetrics(registry)) as cache:
        traffic(cache)
    text = generate_latest(registry).decode()
    for key in ("settle:a", "settle:b", "sync:a", "export:1"):
        assert key not in text


def test_events_in_order(backend: str, redis_url: str) -> None:
    rec = Recorder()
    with open_cache(backend, redis_url, metrics=rec) as cache:
        with cache.lock("k", ttl=5) as lock:
            with pytest.raises(LockNotAcquired):
                cache.lock("k")
            lock.extend()
        assert lock.unlock() is False  # already released: nothing sent, nothing reported
        cache.lock_wait("w", ttl=5, wait=0.5).unlock()
        cache.set_nx("once", "1", ttl=5)  # not a lock: no event
        cache.incr("n")
    assert rec.events == [
        ("acquired", "k", 1),
        ("not_acquired", "k", "held"),
        ("extended", "k", True),
        ("released", "k"),
        ("acquired", "w", 1),  # a lock_wait that got the key at its first attempt
        ("released", "w"),
    ]


class WaitRecorder(Recorder):
    """A Recorder with the optional waited(): a lock_wait's outcome comes there."""

    def waited(self, key: str | bytes, outcome: str, wait_s: float, attempts: int) -> None:  # type: ignore[override]
        self.events.append(("waited", key, outcome, attempts))
        assert wait_s >= 0


_SCRIPT_COMMANDS = {f"cmdstat_{c}" for c in ("eval", "evalsha", "eval_ro", "evalsha_ro", "fcall", "fcall_ro")}


def script_runs(server: RedisServer | None) -> int | None:
    """The scripts the server has run (None for the in-process backend): every acquire
    attempt is one (a NOSCRIPT refusal, which the backend follows with the script's text,
    is a failed call, not counted)."""
    if server is None:
        return None
    stats = server.client().info("commandstats")
    return sum(int(v["calls"]) - int(v.get("failed_calls", 0)) for k, v in stats.items() if k in _SCRIPT_COMMANDS)


def ran_since(server: RedisServer | None, before: int | None) -> int | None:
    now = script_runs(server)
    return None if now is None or before is None else now - before


def contended_waits(cache: hotlock.Cache, server: RedisServer | None) -> tuple[int | None, int | None]:
    """An uncontended lock_wait; then, behind a holder whose lease runs out (0.3 s; no
    release is sent, so the server runs no script but the waiter's attempts), one that
    times out (0.1 s) and one that waits it out. Returns the scripts the server ran during
    each of the two (None on the in-process backend)."""
    cache.lock_wait("w", ttl=5, wait=0.5).unlock()  # uncontended: one attempt
    cache.lock("w", ttl=0.3)
    before = script_runs(server)
    with pytest.raises(LockNotAcquired):
        cache.lock_wait("w", ttl=5, wait=0.1)
    timed_out = ran_since(server, before)
    before = script_runs(server)
    lock = cache.lock_wait("w", ttl=5, wait=5)
    waited = ran_since(server, before)
    lock.unlock()
    return timed_out, waited


def test_lock_wait_reports_its_attempts(backend: str, redis_server: RedisServer, redis_url: str) -> None:
    plain, waits = Recorder(), WaitRecorder()
    with open_cache(backend, redis_url, metrics=[plain, waits]) as cache:
        ran = contended_waits(cache, None if backend == "memory" else redis_server)
    # A listener without waited() hears a lock_wait's outcome as acquired() or
    # not_acquired(); one with it, there instead, attempts and all; the try-once lock()
    # is acquired() for both.
    assert [e for e in plain.events if e[0] != "released"] == [
        ("acquired", "w", 1),
        ("acquired", "w", 1),
        ("not_acquired", "w", "timeout"),
        ("acquired", "w", plain.events[-2][2]),
    ]
    outcomes = [e for e in waits.events if e[0] != "released"]
    assert [e[:3] for e in outcomes] == [
        ("waited", "w", "acquired"),
        ("acquired", "w", 1),
        ("waited", "w", "timeout"),
        ("waited", "w", "acquired"),
    ]
    assert outcomes[0][3] == 1
    timed_out, waited = outcomes[2][3], outcomes[3][3]
    assert waited == plain.events[-2][2]
    assert timed_out >= 1 and waited >= 2  # each one's first attempt found the key held
    if ran != (None, None):
        assert (timed_out, waited) == ran  # exactly what the server ran, on every Redis backend


def test_errors_by_kind() -> None:
    server = start_redis()
    registry = CollectorRegistry()
    prom = PrometheusMetrics(registry)

    class Both(Recorder):
        def acquired(self, key: str | bytes, wait_s: float, attempts: int | None) -> None:
            super().acquired(key, wait_s, attempts)
            prom.acquired(key, wait_s, attempts)

        def error(self, key: str | bytes, op: str, error: CacheError) -> None:  # type: ignore[override]
            super().error(key, op, error)
            prom.error(key, op, error)  # type: ignore[arg-type]

    both = Both()
    try:
        cache = hotlock.connect(server.url, metrics=both, timeout=0.5, connect_timeout=0.5)
        held = cache.lock("held", ttl=30)
        # A full noeviction server refuses new locks with OOM...
        server.client().config_set("maxmemory", "1")
        with pytest.raises(CacheError, match="OOM"):
            cache.lock("new", ttl=5)
        server.client().config_set("maxmemory", "0")
        # ...and a stopped one cannot be reached at all.
        server.stop()
        with pytest.raises(CacheError):
            cache.lock("gone", ttl=5)
        with pytest.raises(CacheError):
            held.extend()
        with pytest.raises(CacheError):
            held.unlock()
        cache.close()
    finally:
        server.stop()
    assert [e for e in both.events if e[0] == "error"] == [
        ("error", "new", "acquire", "oom"),
        ("error", "gone", "acquire", "connection"),
        ("error", "held", "extend", "connection"),
        ("error", "held", "release", "connection"),
    ]
    s = scrape(registry)
    assert value(s, "hotlock_errors_total", op="acquire", kind="oom") == 1
    assert value(s, "hotlock_errors_total", op="acquire", kind="connection") == 1
    assert value(s, "hotlock_errors_total", op="extend", kind="connection") == 1
    assert value(s, "hotlock_acquisitions_total", outcome="error") == 2
    assert value(s, "hotlock_extensions_total", outcome="error") == 1


def test_a_listener_that_raises_never_changes_a_lock_call(
    backend: str, redis_url: str, caplog: pytest.LogCaptureFixture
) -> None:
    class Broken(BaseListener):
        def acquired(self, key: str | bytes, wait_s: float, attempts: int | None) -> None:
            raise RuntimeError("metrics backend down")

        def released(self, key: str | bytes, held_s: float) -> None:
            raise RuntimeError("metrics backend down")

    caplog.set_level(logging.WARNING, logger="hotlock")
    with open_cache(backend, redis_url, metrics=Broken()) as cache:
        for _ in range(3):
            lock = cache.lock("k", ttl=5)  # acquired, not stranded by the listener
            assert lock.unlock() is True
    warnings = [r for r in caplog.records if "metrics listener" in r.getMessage()]
    assert len(warnings) == 1  # said once per cache


def test_no_listener_is_the_plain_cache(redis_url: str) -> None:
    with hotlock.connect(redis_url) as cache:
        # Not metered: the plain Cache, or on the native backend its one-call subclass.
        assert type(cache) in (hotlock.Cache, NativeCache)
        lock = cache.lock("k")
        assert lock._meter is None
        lock.unlock()


def test_a_bad_listener_is_a_type_error_before_any_io(redis_server: RedisServer) -> None:
    unreachable = "redis://127.0.0.1:1/0"
    with pytest.raises(TypeError, match=r"metrics must be a hotlock\.metrics\.Listener; object lacks acquired"):
        hotlock.connect(unreachable, metrics=object())  # type: ignore[arg-type]

    class Half:
        def acquired(self, key: str, wait_s: float, attempts: int | None) -> None: ...

    with pytest.raises(TypeError, match="lacks not_acquired, released, extended, lost, error"):
        hotlock.connect(unreachable, metrics=Half())  # type: ignore[arg-type]


def test_two_adapters_on_one_registry_collide_loudly() -> None:
    registry = CollectorRegistry()
    PrometheusMetrics(registry)
    with pytest.raises(ValueError, match="Duplicated timeseries"):
        PrometheusMetrics(registry)
    PrometheusMetrics(registry, namespace="billing_locks")  # another namespace is fine


def test_histograms_read_as_prometheus_clients_own() -> None:
    """The adapter is a custom collector: its histograms must expose exactly what a
    prometheus_client Histogram with the same buckets exposes for the same values (bucket
    edges included: a value equal to a bound falls in that bound's bucket)."""
    from prometheus_client import Histogram

    ours, theirs = CollectorRegistry(), CollectorRegistry()
    metrics = PrometheusMetrics(ours, hold_buckets=(0.01, 0.1, 1.0))
    reference = Histogram("hotlock_hold_seconds", "reference", registry=theirs, buckets=(0.01, 0.1, 1.0))
    for held in (0.0, 0.005, 0.01, 0.0100001, 0.1, 0.5, 1.0, 2.0, 1e9):
        metrics.released("k", held)
        reference.observe(held)
    mine = {k: v for k, v in scrape(ours).items() if k[0].startswith("hotlock_hold_seconds")}
    reference_samples = {k: v for k, v in scrape(theirs).items() if not k[0].endswith("_created")}
    # The sum is added in another order (a batch at a time), so it may differ in the last bit.
    total = ("hotlock_hold_seconds_sum", ())
    assert mine.pop(total) == pytest.approx(reference_samples.pop(total), rel=1e-12)
    assert mine == reference_samples
    assert value(mine, "hotlock_hold_seconds_bucket", le="0.01") == 3


def test_counts_are_exact_under_threads() -> None:
    """Events from many threads at once are all counted (each one is an add under a lock)."""
    import threading

    registry = CollectorRegistry()
    metrics = PrometheusMetrics(registry)
    per_thread, threads = 20_000, 8

    def events() -> None:
        for _ in range(per_thread):
            metrics.acquired("k", 0.001, 1)
            metrics.released("k", 0.002)
            metrics.extended("k", True)

    workers = [threading.Thread(target=events) for _ in range(threads)]
    for t in workers:
        t.start()
    for t in workers:
        t.join()
    # Unscraped, the observations waiting to be binned stay few (memory is bounded).
    assert metrics._all is not None and len(metrics._all.wait.pending) < 256
    s = scrape(registry)
    n = per_thread * threads
    assert value(s, "hotlock_acquisitions_total", outcome="acquired") == n
    assert value(s, "hotlock_acquire_wait_seconds_count") == n
    assert value(s, "hotlock_hold_seconds_count") == n
    assert value(s, "hotlock_extensions_total", outcome="ok") == n
    assert value(s, "hotlock_hold_seconds_sum") == pytest.approx(0.002 * n)


def test_unsorted_buckets_are_refused() -> None:
    with pytest.raises(ValueError, match="increasing order"):
        PrometheusMetrics(CollectorRegistry(), wait_buckets=(1.0, 0.5))


def test_error_kind_names() -> None:
    cases = {
        "acquire failed: no reply within the timeout on key 'k' (server s)": "timeout",
        "acquire failed: the server replied OOM command not allowed when used memory > 'maxmemory'.": "oom",
        "extend failed: the server replied READONLY You can't write against a read only replica.": "readonly",
        "release failed: the server replied NOPERM this user has no permissions": "noperm",
        "acquire failed: the server replied ERR something": "reply",
        "acquire failed: cannot connect: Connection refused": "connection",
    }
    for text, kind in cases.items():
        assert error_kind(CacheError(text)) == kind, text


# -- async -------------------------------------------------------------------------------


@pytest.fixture(params=[(b, lp) for b in AIO_BACKENDS for lp in LOOPS], ids=lambda p: f"{p[0]}-{p[1]}")
def aio(request: pytest.FixtureRequest, redis_server: RedisServer, redis_url: str) -> Aio:
    backend, loop = request.param
    _require(backend)
    return Aio(backend, loop, redis_url, redis_server)


def test_async_prometheus_counts_real_traffic(aio: Aio) -> None:
    registry = CollectorRegistry()

    async def main() -> None:
        cache = await aio.connect(metrics=PrometheusMetrics(registry))
        try:
            async with cache.lock("a", ttl=5) as lock:
                with pytest.raises(LockNotAcquired):
                    await cache.lock("a")
                with pytest.raises(LockNotAcquired):
                    await cache.lock_wait("a", wait=0.05)
                await lock.extend(5)
            short = await cache.lock("b", ttl=0.05)
            import asyncio

            await asyncio.sleep(0.12)
            with pytest.raises(LockLost):
                await short.extend()
            many = await cache.lock_many(["x", "y"], ttl=5)
            assert await cache.extend_many(many, 5) == [True, True]
            assert await cache.unlock_many(many) == [True, True]
        finally:
            await cache.close()

    aio.run(main())
    s = scrape(registry)
    assert value(s, "hotlock_acquisitions_total", outcome="acquired") == 4
    assert value(s, "hotlock_acquisitions_total", outcome="held") == 1
    assert value(s, "hotlock_acquisitions_total", outcome="timeout") == 1
    assert value(s, "hotlock_extensions_total", outcome="ok") == 3
    assert value(s, "hotlock_extensions_total", outcome="lost") == 1
    assert value(s, "hotlock_lost_total") == 1
    assert value(s, "hotlock_hold_seconds_count") == 3


def test_async_lock_wait_reports_its_attempts(aio: Aio) -> None:
    waits = WaitRecorder()
    server = None if aio.backend == "memory" else aio.server

    async def main() -> tuple[int | None, int | None]:
        cache = await aio.connect(metrics=waits)
        try:
            await (await cache.lock_wait("w", ttl=5, wait=0.5)).unlock()  # uncontended
            await cache.lock("w", ttl=0.3)  # runs out: no release sent
            before = script_runs(server)
            with pytest.raises(LockNotAcquired):
                await cache.lock_wait("w", ttl=5, wait=0.1)
            timed_out = ran_since(server, before)
            before = script_runs(server)
            lock = await cache.lock_wait("w", ttl=5, wait=5)
            waited = ran_since(server, before)
            await lock.unlock()
            return timed_out, waited
        finally:
            await cache.close()

    ran = aio.run(main())
    outcomes = [e for e in waits.events if e[0] != "released"]
    assert outcomes[:3] == [
        ("waited", "w", "acquired", 1),
        ("acquired", "w", 1),
        ("waited", "w", "timeout", outcomes[2][3]),
    ]
    assert len(outcomes) == 4 and outcomes[3][:3] == ("waited", "w", "acquired")
    timed_out, waited = outcomes[2][3], outcomes[3][3]
    assert timed_out >= 1 and waited >= 2
    if ran != (None, None):
        assert (timed_out, waited) == ran


def test_async_no_listener_is_the_plain_cache(aio: Aio) -> None:
    async def main() -> None:
        cache = await aio.connect()
        try:
            assert type(cache) is hotlock.aio.AsyncCache
            lock = await cache.lock("k")
            assert lock._meter is None
            await lock.unlock()
        finally:
            await cache.close()

    aio.run(main())


def test_bad_arguments_read_the_same_with_metrics(backend: str, redis_url: str) -> None:
    with open_cache(backend, redis_url) as plain, open_cache(backend, redis_url, metrics=Recorder()) as metered:
        for call in (
            lambda c: c.lock(""),
            lambda c: c.lock(5),
            lambda c: c.lock("k", ttl=0),
            lambda c: c.lock_wait("k", wait=-1),
            lambda c: c.lock_many(5),
            lambda c: c.lock_many("abc"),
            lambda c: c.extend_many(5, 1),
            lambda c: c.unlock_many("abc"),
            lambda c: c.unlock_many([object()]),
        ):
            with pytest.raises((TypeError, ValueError)) as plain_error:
                call(plain)
            with pytest.raises((TypeError, ValueError)) as metered_error:
                call(metered)
            assert type(metered_error.value) is type(plain_error.value)
            assert str(metered_error.value) == str(plain_error.value)
