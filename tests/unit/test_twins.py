"""The sync and async APIs' twins that must stay two keep one signature.

What both APIs spell alike as plain methods is written once (hotlock._core: lock_wait,
locked, and every call's checks). What must stay two, a ``def`` and an ``async def``, or
the sync lock()'s hot path and the async one, keeps one parameter list: connect(), lock()
and lock_many() are written once, on the sync side, and hotlock._twin gives the async twin
that list (as does hotlock.lock_wait, CacheBase.lock_wait's). The checks here hold every
twin to one signature, both as inspect reports it and as Python binds a call (the code's
parameters and defaults, which a ``__signature__`` could belie): a parameter added,
renamed, reordered or given another default on one side only fails, and so does a method
one API has and the other lacks.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

import pytest

import hotlock
import hotlock.aio
from hotlock._twin import takes, takes_method

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


def bound(fn: Callable[..., Any]) -> tuple[tuple[str, ...], tuple[object, ...]]:
    """What Python binds a call by, read from the function itself: the parameters' names,
    then their kinds (the code's) and defaults."""
    code = fn.__code__
    flags = code.co_flags & (inspect.CO_VARARGS | inspect.CO_VARKEYWORDS)
    count = code.co_argcount + code.co_kwonlyargcount + bin(flags).count("1")
    kinds = (code.co_posonlyargcount, code.co_argcount, code.co_kwonlyargcount, flags)
    return code.co_varnames[:count], (*kinds, fn.__defaults__, fn.__kwdefaults__)


@pytest.mark.parametrize(("sync", "aio"), TWINS, ids=lambda fn: fn.__qualname__)
def test_the_async_twin_takes_what_the_sync_one_takes(sync: Callable[..., Any], aio: Callable[..., Any]) -> None:
    assert parameters(aio) == parameters(sync)
    assert bound(aio) == bound(sync)


def test_the_module_lock_wait_takes_what_the_method_takes() -> None:
    # Its first parameter is the cache, where the method has self.
    assert parameters(hotlock.lock_wait)[0][0] == "cache"
    assert parameters(hotlock.lock_wait)[1:] == parameters(hotlock.Cache.lock_wait)[1:]
    names, rest = bound(hotlock.lock_wait)
    method_names, method_rest = bound(hotlock.Cache.lock_wait)
    assert (names[1:], rest) == (method_names[1:], method_rest)


def model(self: object, key: str, ttl: float = 30, *, limit: int = 1) -> str:
    """The model."""
    return "sync"


def test_a_drifted_default_fails_the_checks() -> None:
    # What the checks above would see of a twin spelt by hand whose default has drifted.
    def drifted(self: object, key: str, ttl: float = 30, *, limit: int = 2) -> str:
        return "async"

    assert parameters(drifted) != parameters(model)
    assert bound(drifted) != bound(model)


def test_a_twin_made_from_the_model_binds_as_the_model_does() -> None:
    @takes_method(model)
    def twin(self: object, *, key: str, ttl: float, limit: int) -> tuple[object, ...]:
        """The twin's own."""
        return self, key, ttl, limit

    assert parameters(twin)[1:] == parameters(model)[1:]
    assert bound(twin) == bound(model)
    assert twin.__doc__ == "The twin's own." and inspect.signature(twin).return_annotation == "tuple[object, ...]"
    assert twin(0, "k") == (0, "k", 30, 1)
    assert twin(0, key="k", ttl=5, limit=3) == (0, "k", 5, 3)
    with pytest.raises(TypeError, match=r"twin\(\) takes from 2 to 3 positional arguments but 4 were given"):
        twin(0, "k", 5, 3)  # type: ignore[call-arg]


def test_a_body_that_lacks_an_argument_fails_at_import() -> None:
    def short(self: object, *, key: str, limit: int) -> None: ...

    with pytest.raises(TypeError, match="'ttl'"):
        takes_method(model)(short)


def test_an_async_body_makes_a_coroutine_function() -> None:
    async def twin(*, self: object, key: str, ttl: float, limit: int) -> str:
        return "async"

    made = takes(model)(twin)
    assert inspect.iscoroutinefunction(made)
    assert bound(made) == bound(model)


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
