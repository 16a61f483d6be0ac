"""The unit suite: the sans-IO cores (Route, Schedule, Waiting) driven by scripted replies
and a fake clock. Nothing here starts a server or opens a socket (``make test-unit``)."""

from __future__ import annotations

import socket
import types
from collections.abc import Iterator

import pytest


class FakeClock:
    """time.monotonic() that moves only when the test says so."""

    def __init__(self, now: float = 1000.0) -> None:
        self.now = now

    def monotonic(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.now += seconds


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()


def patch_clock(monkeypatch: pytest.MonkeyPatch, module: types.ModuleType, clock: FakeClock) -> None:
    """``module``'s ``time`` (the module it imported) replaced by the fake clock."""
    monkeypatch.setattr(module, "time", types.SimpleNamespace(monotonic=clock.monotonic, sleep=clock.sleep))


@pytest.fixture(autouse=True)
def no_network(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """A unit test that reaches for a socket is not a unit test: it fails."""

    def refuse(*args: object, **kwargs: object) -> None:
        raise AssertionError("a unit test opened a socket")

    monkeypatch.setattr(socket.socket, "connect", refuse)
    monkeypatch.setattr(socket, "create_connection", refuse)
    yield
