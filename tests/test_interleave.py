"""Deterministic interleavings: a call whose reply the fake server holds back on cue, the
cache closed from another thread (async: another task) meanwhile, then the reply let go as
a good reply, NOSCRIPT, an error, READONLY, a WAIT shortfall, nothing at all (the timeout)
or EOF. Whatever the order, the call ends in a result or the library's own error within its
bound: no signal, no hang, no stray exception. Also: a list handed to a backend's batch
call, emptied or filled with non-bytes by another thread while the reply is held back; and
a forked child closing an async connection it inherited.
"""

from __future__ import annotations

import asyncio
import functools
import os
import signal
import threading
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import pytest

import hotlock
import hotlock.aio
from hotlock._scripts import ACQUIRE, EXTEND, RELEASE
from hotlock.errors import HotlockError

from .conftest import BACKENDS as ALL_BACKENDS
from .conftest import lock_name
from .fakeserver import FakeRedis, fence_of

TIMEOUT = 0.2
BOUND = 10 * 3 * TIMEOUT  # a retry after a lost reply, lock_wait's polling: 10x the worst case
BACKENDS = [b for b in ALL_BACKENDS if b != "memory"]

# How the held-back reply is let go, once close() has run.
RELEASES: dict[str, dict[str, Any]] = {
    "good": {"reply": None},
    "noscript": {"reply": b"-NOSCRIPT No matching script. Please use EVAL.\r\n"},
    "error": {"reply": b"-ERR hostile\r\n"},
    "readonly": {"reply": b"-READONLY You can't write against a read only replica.\r\n"},
    "wait-shortfall": {"reply": b":0\r\n"},  # on the WAIT behind the acquire (wait_replicas=1)
    "timeout": {"reply": b""},
    "eof": {"cut": True},
}


@dataclass
class Op:
    match: tuple[bytes, ...]
    call: Callable[[Any, Any], Any]
    setup: Callable[[Any], Any] = lambda cache: None
    kwargs: dict[str, Any] = field(default_factory=dict)
    # Held back in the acquire's transaction (hotlock._acquire): skipped on a backend that
    # takes a free key by script.
    transaction: bool = False


# The acquire's script: where a backend sends it for every acquire.
BY_SCRIPT = {"scripts": "always"}

OPS: dict[str, Op] = {
    "lock": Op((b"EVALSHA", ACQUIRE.sha), lambda c, _: c.lock("k"), kwargs=BY_SCRIPT),
    "lock_many": Op((b"EVALSHA", ACQUIRE.sha), lambda c, _: c.lock_many(["m1", "m2"]), kwargs=BY_SCRIPT),
    "lock_wait": Op((b"EVALSHA", ACQUIRE.sha), lambda c, _: c.lock_wait("k", wait=0.3), kwargs=BY_SCRIPT),
    # The transaction's SET held back (let go "good": OK, as if run outside the transaction).
    "lock-transaction": Op((b"SET", lock_name("k")), lambda c, _: c.lock("k"), transaction=True),
    "lock_many-transaction": Op((b"SET", lock_name("m2")), lambda c, _: c.lock_many(["m1", "m2"]), transaction=True),
    "extend": Op((b"EVALSHA", EXTEND.sha), lambda _, lock: lock.extend(5), setup=lambda c: c.lock("k")),
    "unlock": Op((b"EVALSHA", RELEASE.sha), lambda _, lock: lock.unlock(), setup=lambda c: c.lock("k")),
    "unlock_many": Op(
        (b"EVALSHA", RELEASE.sha), lambda c, locks: c.unlock_many(locks), setup=lambda c: c.lock_many(["m1", "m2"])
    ),
    "lock-wait_replicas": Op((b"WAIT",), lambda c, _: c.lock("k"), kwargs={"wait_replicas": 1}),
}


def cases() -> list[tuple[str, str]]:
    # The WAIT shortfall only where a WAIT is sent; NOSCRIPT and READONLY everywhere.
    out = []
    for op in OPS:
        for release in RELEASES:
            if (release == "wait-shortfall") == (op == "lock-wait_replicas") or (
                op == "lock-wait_replicas" and release in ("good", "eof", "timeout")
            ):
                out.append((op, release))
    return out


CASES = cases()
IDS = [f"{op}-{release}" for op, release in CASES]


def in_child(fn: Callable[..., None], *args: object) -> None:
    """Run ``fn(*args)`` in a forked child and fail with what it raised, or with the signal
    that ended it: a native call that takes its process down takes only the child down,
    and the test says so instead of ending the whole run."""
    read_end, write_end = os.pipe()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)  # fork with threads (3.12+)
        pid = os.fork()
    if pid == 0:  # pragma: no cover - the child
        code, text = 0, b""
        try:
            signal.alarm(20)  # a hang ends the child with SIGALRM rather than the test run
            fn(*args)
        except BaseException as exc:
            code, text = 1, f"{type(exc).__name__}: {exc}".encode()
        os.write(write_end, text[:50_000])
        os._exit(code)
    os.close(write_end)
    with os.fdopen(read_end, "rb") as pipe:
        text = pipe.read().decode("utf-8", "replace")
    _, status = os.waitpid(pid, 0)
    if os.WIFSIGNALED(status):
        pytest.fail(f"the process died of {signal.Signals(os.WTERMSIG(status)).name}", pytrace=False)
    if os.WEXITSTATUS(status) != 0:
        pytest.fail(text, pytrace=False)


def isolated(backend: str, fn: Callable[..., None], *args: object) -> None:
    """The native sync client in a child process (it can crash), the others here."""
    if backend == "native":
        in_child(fn, *args)
    else:
        fn(*args)


@functools.cache
def sends_transaction(backend: str) -> bool:
    """Whether ``backend`` takes a free key by transaction (MULTI...EXEC), not by script."""
    with FakeRedis() as fake:
        cache = hotlock.connect(fake.url, backend=backend, timeout=TIMEOUT, wakeups=False)
        cache.lock("probe")
        cache.close()
        return any(c[0].upper() == b"MULTI" for c in fake.received)


def _need(backend: str, op: Op) -> None:
    if op.transaction and not sends_transaction(backend):
        pytest.skip("this backend takes a free key by script: no transaction to hold back")


def _allowed(outcome: object) -> bool:
    return not isinstance(outcome, BaseException) or isinstance(outcome, HotlockError)


def _connect_kwargs(backend: str, op: Op) -> dict[str, Any]:
    return {"backend": backend, "timeout": TIMEOUT, "connect_timeout": 1.0, "wakeups": False, **op.kwargs}


def run_sync(backend: str, op: Op, release: dict[str, Any]) -> None:
    with FakeRedis() as fake:
        cache = hotlock.connect(fake.url, **_connect_kwargs(backend, op))
        state = op.setup(cache)
        cue = fake.on(*op.match, stall=True)
        outcome: list[object] = []

        def call() -> None:
            try:
                outcome.append(op.call(cache, state))
            except BaseException as exc:
                outcome.append(exc)

        worker = threading.Thread(target=call, daemon=True)
        worker.start()
        try:
            assert cue.arrived.wait(5), "the call never reached the server"
            cache.close()  # from this thread, while the worker waits for its reply
        finally:
            cue.release(**release)
        worker.join(BOUND)
        assert not worker.is_alive(), f"the call did not end within {BOUND} s of its reply"
        assert _allowed(outcome[0]), f"{outcome[0]!r} escaped, not a library error"
        cache.close()


async def run_async(backend: str, op: Op, release: dict[str, Any]) -> None:
    with FakeRedis() as fake:
        cache = await hotlock.aio.connect(fake.url, **_connect_kwargs(backend, op))
        state = op.setup(cache)
        if asyncio.iscoroutine(state) or hasattr(state, "__await__"):
            state = await state
        cue = fake.on(*op.match, stall=True)

        async def call() -> object:
            return await op.call(cache, state)

        task = asyncio.ensure_future(call())
        loop = asyncio.get_running_loop()
        try:
            assert await loop.run_in_executor(None, cue.arrived.wait, 5), "the call never reached the server"
            # Another task closes the cache while the call's reply is held back.
            await asyncio.wait_for(asyncio.ensure_future(cache.close()), BOUND)
        finally:
            cue.release(**release)
        try:
            outcome: object = await asyncio.wait_for(task, BOUND)
        except asyncio.TimeoutError:
            raise AssertionError(f"the call did not end within {BOUND} s of its reply") from None
        except BaseException as exc:
            outcome = exc
        assert _allowed(outcome), f"{outcome!r} escaped, not a library error"
        await cache.close()


@pytest.mark.timeout(30)
@pytest.mark.parametrize(("op", "release"), CASES, ids=IDS)
@pytest.mark.parametrize("backend", BACKENDS)
def test_close_while_reply_pending_sync(backend: str, op: str, release: str) -> None:
    _need(backend, OPS[op])
    isolated(backend, run_sync, backend, OPS[op], RELEASES[release])


@pytest.mark.timeout(30)
@pytest.mark.parametrize(("op", "release"), CASES, ids=IDS)
@pytest.mark.parametrize("backend", BACKENDS)
def test_close_while_reply_pending_async(backend: str, op: str, release: str) -> None:
    _need(backend, OPS[op])
    asyncio.run(run_async(backend, OPS[op], RELEASES[release]))


# -- a caller's list mutated while the reply is held back --------------------------------

MUTATIONS: dict[str, Callable[[list[Any]], None]] = {
    "emptied": lambda items: items.clear(),
    "non-bytes": lambda items: items.__setitem__(slice(None), [None] * len(items)),
    "grown": lambda items: items.extend([b"x"] * 1000),
}
BATCHES = {
    "acquire_many": (ACQUIRE.sha, lambda b, keys, tokens: b.acquire_many(keys, tokens, 5000)),
    "release_many": (RELEASE.sha, lambda b, keys, tokens: b.release_many(keys, tokens)),
}


def _batch_args() -> tuple[list[bytes], list[bytes]]:
    keys = [lock_name(f"m{i}") for i in range(3)]
    tokens = [os.urandom(16) + b"%d" % i for i in range(3)]
    return keys, tokens


def _check_batch_outcome(outcome: object, keys: list[bytes], what: str) -> None:
    assert _allowed(outcome), f"{outcome!r} escaped, not a library error"
    if what == "acquire_many" and isinstance(outcome, list):
        # The replies answer the keys as they were when sent, in order.
        assert outcome == [fence_of(k) for k in keys], outcome


@pytest.mark.timeout(30)
@pytest.mark.parametrize("then", ["good", "noscript"])
@pytest.mark.parametrize("mutation", list(MUTATIONS))
@pytest.mark.parametrize("batch", list(BATCHES))
@pytest.mark.parametrize("backend", BACKENDS)
def test_batch_list_mutated_while_reply_pending_sync(backend: str, batch: str, mutation: str, then: str) -> None:
    isolated(backend, batch_mutated_sync, backend, batch, mutation, then)


def batch_mutated_sync(backend: str, batch: str, mutation: str, then: str) -> None:
    sha, run = BATCHES[batch]
    with FakeRedis() as fake:
        cache = hotlock.connect(fake.url, backend=backend, timeout=TIMEOUT, wakeups=False)
        backend_obj = cache._backend
        keys, tokens = _batch_args()
        sent = list(keys)
        cue = fake.on(b"EVALSHA", sha, stall=True)
        outcome: list[object] = []

        def call() -> None:
            try:
                outcome.append(run(backend_obj, keys, tokens))
            except BaseException as exc:
                outcome.append(exc)

        worker = threading.Thread(target=call, daemon=True)
        worker.start()
        try:
            assert cue.arrived.wait(5), "the batch never reached the server"
            MUTATIONS[mutation](keys)
            MUTATIONS[mutation](tokens)
        finally:
            cue.release(RELEASES[then]["reply"])
        worker.join(BOUND)
        assert not worker.is_alive(), f"the batch did not end within {BOUND} s of its reply"
        _check_batch_outcome(outcome[0], sent, batch)
        check_probe(cache)
        cache.close()


@pytest.mark.timeout(30)
@pytest.mark.parametrize("then", ["good", "noscript"])
@pytest.mark.parametrize("mutation", list(MUTATIONS))
@pytest.mark.parametrize("batch", list(BATCHES))
@pytest.mark.parametrize("backend", BACKENDS)
def test_batch_list_mutated_while_reply_pending_async(backend: str, batch: str, mutation: str, then: str) -> None:
    sha, run = BATCHES[batch]

    async def main() -> None:
        with FakeRedis() as fake:
            cache = await hotlock.aio.connect(fake.url, backend=backend, timeout=TIMEOUT, wakeups=False)
            keys, tokens = _batch_args()
            sent = list(keys)
            cue = fake.on(b"EVALSHA", sha, stall=True)
            task = asyncio.ensure_future(run(cache._backend, keys, tokens))
            try:
                assert await asyncio.get_running_loop().run_in_executor(None, cue.arrived.wait, 5)
                MUTATIONS[mutation](keys)  # another task's doing, while this one awaits the reply
                MUTATIONS[mutation](tokens)
            finally:
                cue.release(RELEASES[then]["reply"])
            try:
                outcome: object = await asyncio.wait_for(task, BOUND)
            except BaseException as exc:
                outcome = exc
            _check_batch_outcome(outcome, sent, batch)
            check_probe(None, (await cache.lock("probe")).fence)
            await cache.close()

    asyncio.run(main())


def check_probe(cache: hotlock.Cache | None, fence: int | None = None) -> None:
    """The next call gets its own reply."""
    if cache is not None:
        fence = cache.lock("probe").fence
    assert fence == fence_of(lock_name("probe")), "a reply was handed to the wrong caller"


# -- fork ----------------------------------------------------------------------------------


@pytest.mark.timeout(30)
@pytest.mark.parametrize("how", ["close", "abort"])
def test_async_close_in_forked_child_writes_nothing_to_the_parents_socket(how: str) -> None:
    """A child forked while the parent's async connection has a command queued (formatted,
    not yet flushed) closes (or drops) the connection: the command must not go out on the
    parent's socket, the child's waiter fails at once, and the parent's connection goes on
    answering the parent."""
    if "native" not in BACKENDS:
        pytest.skip("the native extension is not live")

    async def main() -> None:
        with FakeRedis() as fake:
            cache = await hotlock.aio.connect(fake.url, backend="native", timeout=1.0, wakeups=False)
            assert (await cache.lock("before")).fence == fence_of(lock_name("before"))
            proto = cache._backend._proto
            # Queued for the next loop iteration's write, which the child never runs.
            queued = proto.execute(b"PING")
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", DeprecationWarning)  # fork with the server's threads
                pid = os.fork()
            if pid == 0:
                code = 0
                try:
                    getattr(proto, how)()
                    code = 0 if queued.done() else 3
                except BaseException:
                    code = 2
                os._exit(code)
            _, status = os.waitpid(pid, 0)
            assert os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0, status
            # The parent's own flush sends its PING once; the child sent nothing.
            assert await queued == b"PONG"
            deadline = time.monotonic() + 0.2
            while time.monotonic() < deadline:
                await asyncio.sleep(0.02)
            assert fake.count(b"PING") == 1, f"PING arrived {fake.count(b'PING')} times: the child wrote it too"
            assert (await cache.lock("after")).fence == fence_of(lock_name("after"))
            await cache.close()

    asyncio.run(main())
