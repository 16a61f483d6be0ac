"""The three wait loops held to the wait state machine (hotlock._waiting.Waiting), whose
own tests are tests/unit/test_waiting.py.

A lock_wait runs on each of the three loops (the native backend's in C, the sync pure-Python driver on
redis-py, the async driver) against a real server, records what each sends through a
MONITOR connection, and checks that all three take the steps the machine predicts for the
replies they got: the same plain attempts, marking from then on, the join after the first
marking attempt, and the acquisition right after the release. Timing decides how many
attempts a wait makes, so that count is read from the server, never assumed.
"""

from __future__ import annotations

import asyncio
import re
import socket
import threading
import time
import uuid
from dataclasses import dataclass

import redis

import hotlock
import hotlock.aio
from hotlock._keys import wake_channel
from hotlock._scripts import ACQUIRE, ACQUIRE_CHAIN, ACQUIRE_WAIT, RELEASE
from hotlock._waiting import POLL_FIRST

from .conftest import lock_name, native_for_module
from .unit.test_waiting import HELD, NAMES, Entry, walk

# -- the three loops against a server ----------------------------------------------------


class Monitor:
    """The commands the server runs, in its order, read from a MONITOR connection."""

    def __init__(self, url: str) -> None:
        client = redis.Redis.from_url(url)
        kwargs = client.connection_pool.connection_kwargs
        self._sock = socket.create_connection((kwargs["host"], kwargs["port"]), timeout=30)
        self._sock.sendall(b"MONITOR\r\n")
        self._stop = f"stop-{uuid.uuid4().hex}"
        self._buf = b""
        assert self._line() == "+OK"
        self.commands: list[list[str]] = []
        self._thread = threading.Thread(target=self._read, daemon=True)
        self._thread.start()
        self._client = client

    def _line(self) -> str:
        while b"\r\n" not in self._buf:
            data = self._sock.recv(65536)
            if not data:
                raise ConnectionError("MONITOR connection closed")
            self._buf += data
        line, self._buf = self._buf.split(b"\r\n", 1)
        return line.decode("latin-1")

    def _read(self) -> None:
        while True:
            line = self._line()
            args = [m.group(1) for m in re.finditer(r'"((?:[^"\\]|\\.)*)"', line.partition("]")[2])]
            if args[:2] == ["ECHO", self._stop]:
                return
            self.commands.append(args)

    def stop(self) -> list[list[str]]:
        self._client.echo(self._stop)
        self._thread.join(30)
        assert not self._thread.is_alive(), "MONITOR never saw its stop"
        self._sock.close()
        self._client.close()
        return self.commands


@dataclass
class Shape:
    attempts: list[str]  # the scripts of the waiter's attempts, in order
    join_after: int  # attempts the server ran before the channel's SUBSCRIBE
    after_release: int  # attempts the server ran after the release


def shape_of(commands: list[list[str]], key: bytes) -> Shape:
    name, channel = key.decode(), wake_channel(key).decode()
    attempts: list[str] = []
    join_after = after_release = -1
    for args in commands:
        if args[0] in ("SUBSCRIBE", "SSUBSCRIBE") and channel in args[1:] and join_after < 0:
            join_after = len(attempts)
        if args[0] == "EVALSHA" and len(args) > 3 and args[3] == name:
            sha = args[1].encode()
            if sha in NAMES:
                attempts.append(NAMES[sha])
                if after_release >= 0:
                    after_release += 1
            elif sha == RELEASE.sha and after_release < 0:  # the holder's; the waiter's own unlock comes later
                after_release = 0
    return Shape(attempts, join_after, after_release)


def predicted(attempts: int) -> list[str]:
    """The machine's scripts for a lone waiter whose ``attempts``-th attempt acquires."""
    seen = walk([HELD] * (attempts - 1) + [7], joined=Entry())
    return [t for t in seen.trace if t.isupper()]


def hold_then_release(url: str, key: str, wait_for: object, hold_s: float) -> Shape:
    """Hold ``key``, run ``wait_for(key)`` (a lock_wait on one loop) in a thread, release
    after ``hold_s``; the shape of what the waiter sent."""
    side = redis.Redis.from_url(url)
    for script in (ACQUIRE, ACQUIRE_WAIT, ACQUIRE_CHAIN, RELEASE):
        side.script_load(script.source)  # no NOSCRIPT resends to tell apart
    side.close()
    holder = hotlock.connect(url, backend="redis-py", wakeups=False)
    held = holder.lock(key, ttl=30)
    monitor = Monitor(url)
    outcome: list[object] = []

    def run() -> None:
        try:
            outcome.append(wait_for(key))  # type: ignore[operator]
        except BaseException as exc:  # reported by the main thread
            outcome.append(exc)

    waiter = threading.Thread(target=run)
    waiter.start()
    time.sleep(hold_s)
    assert held.unlock()
    waiter.join(30)
    commands = monitor.stop()
    holder.close()
    assert outcome and outcome[0] is True, outcome
    return shape_of(commands, lock_name(key))


def sync_loop(backend: str) -> object:
    """The sync lock_wait on ``backend``: the C loop on "native", the Python driver on "redis-py"."""

    def factory(url: str) -> object:
        def run(key: str) -> bool:
            cache = hotlock.connect(url, backend=backend)
            try:
                cache.lock_wait(key, ttl=5, wait=20).unlock()
                return True
            finally:
                cache.close()

        return run

    return factory


def native_async(url: str) -> object:
    def run(key: str) -> bool:
        async def main() -> bool:
            cache = await hotlock.aio.connect(url, backend="native")
            try:
                lock = await cache.lock_wait(key, ttl=5, wait=20)
                await lock.unlock()
                return True
            finally:
                await cache.close()

        return asyncio.run(main())

    return run


def test_the_three_loops_take_the_steps_the_machine_predicts(redis_url: str) -> None:
    native_for_module()  # the C loop is one of the three: a failure where make test requires it
    loops = {"native": sync_loop("native"), "redis-py": sync_loop("redis-py"), "async": native_async}
    shapes = {}
    for name, make in loops.items():
        shapes[name] = hold_then_release(redis_url, f"diff-{name}", make(redis_url), 0.3)
    for name, shape in shapes.items():
        n = len(shape.attempts)
        # A 0.3 s hold outlasts the plain attempts and the first marking one on any load.
        assert n >= POLL_FIRST + 2, (name, shape)
        assert shape.attempts == predicted(n), (name, shape)
        # Joined (its SUBSCRIBE ran) only after the first marking attempt failed.
        assert shape.join_after >= POLL_FIRST + 1, (name, shape)
        # The release is followed by exactly one attempt: the one that acquires.
        assert shape.after_release == 1, (name, shape)
    # And the three agree with each other, as far as timing lets them.
    plain = {name: s.attempts.index("WAIT") for name, s in shapes.items()}
    assert set(plain.values()) == {POLL_FIRST}, plain
