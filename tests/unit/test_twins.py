"""The sync and async APIs' twins that must stay two keep one signature.

What both APIs spell alike as plain methods is written once (hotlock._core: lock_wait,
locked, and every call's checks). What must stay two, a ``def`` and an ``async def``, or
the sync lock()'s hot path and the async one, is held here to one signature: a parameter
added, renamed, reordered or given another default on one side only fails, and so does a
method one API has and the other lacks.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

import pytest

import hotlock
import hotlock.aio

# The only annotations the twins may differ in, written as the sync side writes them.
ASYNC_SPELLINGS = (("AsyncCache", "Cache"), ("AsyncLock", "Lock"), ("Awaitable[R]", "R"))

TWINS = [
    (hotlock.connect, hotlock.aio.connect),
    (hotlock.with_lock, hotlock.aio.with_lock),
    *[
        (getattr(hotlock.Cache, name), getattr(hotlock.aio.AsyncCache, name))
        for name in ("lock", "with_lock", "lock_many", "extend_many", "unlock_many", "set_nx", "incr", "close")
    ],
    *[(getattr(hotlock.Lock, name), getattr(hotlock.aio.AsyncLock, name)) for name in ("extend", "unlock")],
]


def parameters(fn: Callable[..., Any]) -> list[tuple[str, object, object, str]]:
    """Each parameter's name, kind, default and annotation (the async spelling undone)."""
    out = []
    for p in inspect.signature(fn).parameters.values():
        annotation = str(p.annotation)
        for spelt, sync in ASYNC_SPELLINGS:
            annotation = annotation.replace(spelt, sync)
        out.append((p.name, p.kind, p.default, annotation))
    return out


@pytest.mark.parametrize(("sync", "aio"), TWINS, ids=lambda fn: fn.__qualname__)
def test_the_async_twin_takes_what_the_sync_one_takes(sync: Callable[..., Any], aio: Callable[..., Any]) -> None:
    assert parameters(aio) == parameters(sync)


@pytest.mark.parametrize(("sync", "aio"), TWINS, ids=lambda fn: fn.__qualname__)
def test_what_does_io_is_awaited(sync: Callable[..., Any], aio: Callable[..., Any]) -> None:
    # lock() returns an Acquiring (awaitable, and an async context manager) without I/O.
    assert inspect.iscoroutinefunction(aio) == (aio is not hotlock.aio.AsyncCache.lock)
    assert not inspect.iscoroutinefunction(sync)


def public(cls: type) -> set[str]:
    return {name for name in dir(cls) if not name.startswith("_")}


@pytest.mark.parametrize(
    ("sync", "aio"), [(hotlock.Cache, hotlock.aio.AsyncCache), (hotlock.Lock, hotlock.aio.AsyncLock)]
)
def test_both_apis_have_the_same_names(sync: type, aio: type) -> None:
    assert public(aio) == public(sync)


def test_both_packages_export_the_same_calls() -> None:
    # hotlock.aio.Acquiring is what its lock() returns; the errors are hotlock's own.
    assert {n for n in hotlock.aio.__all__ if n != "Acquiring"} == {
        n.replace("Cache", "AsyncCache").replace("Lock", "AsyncLock") if n in ("Cache", "Lock") else n
        for n in hotlock.__all__
        if "Error" not in n and n not in ("LockLost", "LockNotAcquired")
    }
    assert hotlock.lock_wait is hotlock.aio.lock_wait  # one function: it returns what the cache's lock_wait does
