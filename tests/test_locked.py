"""cache.locked(template): the decorator, sync on every backend and async on every backend
on asyncio and uvloop. Each call's key is checked from inside the call, by trying to take
it again (LockNotAcquired), and after it (free)."""

# The async fixtures come from tests/test_aio.py; pytest's usual re-use of a name as a
# test argument is what ruff calls a redefinition.
# ruff: noqa: F811

from __future__ import annotations

import asyncio
import functools
import inspect
import threading
import time
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import dataclass
from typing import Any

import pytest

from hotlock import Cache, LockLost, LockNotAcquired
from hotlock.aio import AsyncCache

from .conftest import RedisServer
from .test_aio import Aio, aio, loop_kind  # noqa: F401  (fixtures)
from .test_aio_autoextend import delete_key as adelete_key
from .test_autoextend import delete_key


@dataclass
class Tenant:
    id: int


def held(cache: Cache, key: str) -> bool:
    """Whether ``key`` is held elsewhere now (taking it, when free, and letting it go)."""
    try:
        cache.lock(key, ttl=5).unlock()
    except LockNotAcquired:
        return True
    return False


async def aheld(cache: AsyncCache, key: str) -> bool:
    try:
        await (await cache.lock(key, ttl=5)).unlock()
    except LockNotAcquired:
        return True
    return False


# -- the key ---------------------------------------------------------------------------------


def test_the_key_is_the_template_filled_from_the_bound_arguments(cache: Cache) -> None:
    seen: list[tuple[str, bool]] = []

    @cache.locked("export:{tenant}:{kind}", ttl=5)
    def export(tenant: str, kind: str = "full") -> str:
        key = f"export:{tenant}:{kind}"
        seen.append((key, held(cache, key)))
        return tenant

    assert export("t1") == "t1"  # the default fills {kind}
    assert export("t2", "delta") == "t2"
    assert export(kind="delta", tenant="t3") == "t3"
    assert seen == [("export:t1:full", True), ("export:t2:delta", True), ("export:t3:delta", True)]
    assert not any(held(cache, key) for key, _ in seen)


def test_attribute_and_index_fields(cache: Cache) -> None:
    calls: list[bool] = []

    @cache.locked("job:{tenant.id}:{ids[0]}:{opts[mode]}:{n:03d}")
    def run(tenant: Tenant, ids: list[int], opts: dict[str, str], n: int = 7) -> None:
        calls.append(held(cache, "job:42:5:fast:007"))

    run(Tenant(42), [5, 6], {"mode": "fast"})
    assert calls == [True]
    assert not held(cache, "job:42:5:fast:007")


def test_a_template_without_fields_is_one_fixed_key(cache: Cache) -> None:
    @cache.locked("nightly-report")
    def report(day: str) -> bool:
        return held(cache, "nightly-report")

    assert report("mon") is True
    assert not held(cache, "nightly-report")


def test_methods_staticmethods_and_classmethods(cache: Cache) -> None:
    class Account:
        name = "accounts"

        def __init__(self, id: int) -> None:
            self.id = id

        @cache.locked("sync:{self.id}")
        def sync(self) -> bool:
            return held(cache, f"sync:{self.id}")

        @staticmethod
        @cache.locked("static:{x}")
        def static(x: int) -> bool:
            return held(cache, f"static:{x}")

        @classmethod
        @cache.locked("class:{cls.name}")
        def klass(cls) -> bool:
            return held(cache, "class:accounts")

    assert Account(3).sync() is True
    assert Account.static(4) is True and Account(1).static(4) is True
    assert Account.klass() is True
    assert not any(held(cache, k) for k in ("sync:3", "static:4", "class:accounts"))
    # Below @staticmethod/@classmethod it would get the wrong arguments: refused.
    with pytest.raises(TypeError, match="@staticmethod above it"):
        cache.locked("x")(staticmethod(lambda: None))
    with pytest.raises(TypeError, match="@classmethod above it"):
        cache.locked("x")(classmethod(lambda cls: None))  # type: ignore[arg-type]


def test_a_call_that_does_not_fit_the_signature_takes_no_lock(cache: Cache) -> None:
    @cache.locked("fit:{x}")
    def f(x: int) -> None:
        raise AssertionError("not called")

    with pytest.raises(TypeError):
        f(1, 2)  # type: ignore[call-arg]
    with pytest.raises(AttributeError):
        cache.locked("fit:{x.nope}")(lambda x: None)(1)


# -- refused at decoration -------------------------------------------------------------------


def test_a_field_that_names_no_parameter_is_refused_at_decoration(cache: Cache) -> None:
    def export(tenant: str, *rest: int, **extra: str) -> None:
        raise AssertionError("not called")

    with pytest.raises(ValueError, match="'tenat', which is not a parameter of"):
        cache.locked("export:{tenat}")(export)
    with pytest.raises(ValueError, match="'width'"):
        cache.locked("export:{tenant:{width}}")(export)  # a nested field is a field too
    with pytest.raises(ValueError, match="'mode'"):
        cache.locked("export:{mode}")(export)  # a key of **extra is not a parameter
    # *rest and **extra are parameters, filled () and {} when not given.
    cache.locked("export:{tenant}:{rest}:{extra}")(export)


@pytest.mark.parametrize("template", ["job:{}", "job:{0}", "job:{[0]}", "job:{.id}", "job:{x}:{1}"])
def test_a_positional_field_is_refused(cache: Cache, template: str) -> None:
    with pytest.raises(ValueError, match="positional field"):
        cache.locked(template)


def test_a_template_that_is_not_a_format_string_or_not_a_str_is_refused(cache: Cache) -> None:
    for bad in ("job:{x", "job:}", "job:{x!z}"):
        with pytest.raises(ValueError, match="template"):
            cache.locked(bad)
    with pytest.raises(TypeError, match="template must be a str, not bytes"):
        cache.locked(b"job:{x}")  # type: ignore[arg-type]


def test_generators_and_coroutine_functions_are_refused(cache: Cache) -> None:
    def gen(x: int) -> Iterator[int]:
        yield x

    async def agen(x: int) -> AsyncIterator[int]:
        yield x

    async def coro(x: int) -> int:
        return x

    with pytest.raises(TypeError, match="generator function"):
        cache.locked("g:{x}")(gen)
    with pytest.raises(TypeError, match="generator function"):
        cache.locked("g:{x}")(agen)
    with pytest.raises(TypeError, match=r"coroutine function: use hotlock\.aio\.AsyncCache\.locked"):
        cache.locked("g:{x}")(coro)
    with pytest.raises(TypeError, match="decorates a function, not int"):
        cache.locked("g")(3)  # type: ignore[arg-type]


BAD_ARGUMENTS: list[tuple[type[Exception], dict[str, Any]]] = [
    (ValueError, {"ttl": 0}),
    (TypeError, {"ttl": "5"}),
    (ValueError, {"ttl": 8 * 24 * 3600}),
    (TypeError, {"ttl": True}),
    (ValueError, {"wait": -1}),
    (TypeError, {"wait": "1"}),
    (ValueError, {"wait": float("nan")}),
    (ValueError, {"limit": 0}),
    (TypeError, {"limit": True}),
    (TypeError, {"limit": 2.0}),
    (TypeError, {"limit": None}),
    (TypeError, {"auto_extend": 1}),
    (ValueError, {"max_hold": 60}),  # without auto_extend
    (ValueError, {"auto_extend": True, "ttl": 0.05}),
    (ValueError, {"auto_extend": True, "max_hold": 0}),
]


@pytest.mark.parametrize(("error", "kwargs"), BAD_ARGUMENTS, ids=[repr(kw) for _, kw in BAD_ARGUMENTS])
def test_bad_arguments_are_refused_before_any_call(
    cache: Cache, error: type[Exception], kwargs: dict[str, Any]
) -> None:
    with pytest.raises(error):
        cache.locked("k:{x}", **kwargs)


# -- the call --------------------------------------------------------------------------------


def test_wait_none_tries_once_and_raises_lock_not_acquired(cache: Cache) -> None:
    calls: list[int] = []

    @cache.locked("once:{x}", ttl=5)
    def f(x: int) -> None:
        calls.append(x)

    with cache.lock("once:1", ttl=5):
        t0 = time.monotonic()
        with pytest.raises(LockNotAcquired) as info:
            f(1)
        assert time.monotonic() - t0 < 0.5
        assert info.value.key == "once:1"
        assert "after waiting" not in str(info.value)
        f(2)  # another key
    f(1)
    assert calls == [2, 1]


def test_wait_waits_for_the_holder_then_gives_up_at_the_deadline(cache: Cache) -> None:
    @cache.locked("handoff:{x}", ttl=5, wait=3)
    def f(x: int) -> bool:
        return held(cache, f"handoff:{x}")

    holder = cache.lock("handoff:1", ttl=10)
    t0 = time.monotonic()  # before the timer starts: the release comes 0.1 s after it at the earliest
    threading.Timer(0.1, holder.unlock).start()
    assert f(1) is True
    waited = time.monotonic() - t0
    assert 0.09 < waited < 0.1 + 1.0, waited

    @cache.locked("handoff:{x}", ttl=5, wait=0.2)
    def g(x: int) -> None:
        raise AssertionError("not called")

    with cache.lock("handoff:2", ttl=10):
        t0 = time.monotonic()
        with pytest.raises(LockNotAcquired, match=r"after waiting 0\.200 s"):
            g(2)
        assert 0.2 <= time.monotonic() - t0 < 0.2 + 1.0


def test_a_limit_admits_that_many_calls_at_once(cache: Cache) -> None:
    @cache.locked("export:{tenant}", ttl=5, limit=2)
    def export(tenant: str, depth: int) -> int:
        # Inside: this call holds one of the two places; one more call fits, a third not.
        if depth == 0:
            return 1 + export(tenant, 1)
        with pytest.raises(LockNotAcquired, match="limit=2"):
            cache.lock(f"export:{tenant}", 5, limit=2)
        return 1

    assert export("acme", 0) == 2
    assert len([cache.lock("export:acme", 5, limit=2) for _ in range(2)]) == 2  # both places freed


def test_released_when_the_function_raises(cache: Cache) -> None:
    class Boom(Exception):
        pass

    @cache.locked("raise:{x}", ttl=5)
    def f(x: int) -> None:
        assert held(cache, f"raise:{x}")
        raise Boom(x)

    with pytest.raises(Boom):
        f(1)
    assert not held(cache, "raise:1")


def test_the_return_value_and_the_functions_identity_pass_through(cache: Cache) -> None:
    def settle(invoice_id: str, amount: int = 0, *, currency: str = "EUR") -> dict[str, Any]:
        """Settle one invoice."""
        return {"id": invoice_id, "amount": amount, "currency": currency}

    wrapped = cache.locked("settle:{invoice_id}", ttl=5)(settle)
    assert wrapped("i-1", 3, currency="USD") == {"id": "i-1", "amount": 3, "currency": "USD"}
    assert wrapped.__name__ == "settle"
    assert wrapped.__doc__ == "Settle one invoice."
    assert wrapped.__wrapped__ is settle  # type: ignore[attr-defined]
    assert inspect.signature(wrapped) == inspect.signature(settle)
    # Two decorations of one template share the key: they exclude each other.
    other = cache.locked("settle:{invoice_id}")(lambda invoice_id: held(cache, f"settle:{invoice_id}"))
    with cache.lock("settle:i-2", ttl=5), pytest.raises(LockNotAcquired):
        other("i-2")


def test_auto_extend_is_passed_on_and_a_loss_raises_lock_lost_as_the_call_returns(
    cache: Cache, redis_server: RedisServer
) -> None:
    @cache.locked("long:{x}", ttl=0.9, auto_extend=True, max_hold=60)
    def long(x: int) -> bool:
        time.sleep(1.0)  # past the TTL: still held, renewed about every 0.3 s
        return held(cache, f"long:{x}")

    assert long(1) is True
    assert not held(cache, "long:1")

    @cache.locked("lost:{x}", ttl=0.6, auto_extend=True)
    def lost(x: int) -> None:
        delete_key(cache, redis_server, f"lost:{x}")
        time.sleep(0.8)  # work that does not look

    # "no longer held", found by the next renewal (or "TTL ran out" on a machine too loaded for it).
    with pytest.raises(LockLost):
        lost(1)


# -- async -----------------------------------------------------------------------------------


def test_async_the_key_is_the_template_filled_from_the_bound_arguments(aio: Aio) -> None:
    async def main() -> None:
        async with await aio.connect() as cache:
            seen: list[tuple[str, bool]] = []

            @cache.locked("export:{tenant.id}:{kind}", ttl=5)
            async def export(tenant: Tenant, kind: str = "full") -> int:
                key = f"export:{tenant.id}:{kind}"
                seen.append((key, await aheld(cache, key)))
                return tenant.id

            assert await export(Tenant(1)) == 1
            assert await export(kind="delta", tenant=Tenant(2)) == 2
            assert seen == [("export:1:full", True), ("export:2:delta", True)]
            assert not await aheld(cache, "export:1:full")
            assert not await aheld(cache, "export:2:delta")

            class Account:
                def __init__(self, id: int) -> None:
                    self.id = id

                @cache.locked("sync:{self.id}:{ids[1]}")
                async def sync(self, ids: tuple[int, ...]) -> bool:
                    return await aheld(cache, f"sync:{self.id}:{ids[1]}")

            assert await Account(3).sync((1, 2)) is True
            assert not await aheld(cache, "sync:3:2")

    aio.run(main())


def test_async_a_limit_admits_that_many_calls_at_once(aio: Aio) -> None:
    async def main() -> None:
        async with await aio.connect() as cache:
            inside: list[str] = []
            both_in = asyncio.Event()
            go = asyncio.Event()

            @cache.locked("sync-tenant:{tenant}", ttl=5, limit=2)
            async def sync(tenant: str) -> None:
                inside.append(tenant)
                if len(inside) == 2:
                    both_in.set()
                await go.wait()

            tasks = [asyncio.ensure_future(sync("acme")) for _ in range(2)]
            await both_in.wait()
            with pytest.raises(LockNotAcquired, match="limit=2"):
                await sync("acme")
            go.set()
            await asyncio.gather(*tasks)
            held = [await cache.lock("sync-tenant:acme", 5, limit=2) for _ in range(2)]  # both freed
            await cache.unlock_many(held)

    aio.run(main())


def test_async_wait_none_and_wait_seconds(aio: Aio) -> None:
    async def main() -> None:
        async with await aio.connect() as cache:
            calls: list[int] = []

            @cache.locked("job:{x}", ttl=5)
            async def once(x: int) -> None:
                calls.append(x)

            @cache.locked("job:{x}", ttl=5, wait=3)
            async def waiting(x: int) -> bool:
                return await aheld(cache, f"job:{x}")

            @cache.locked("job:{x}", ttl=5, wait=0.2)
            async def short(x: int) -> None:
                raise AssertionError("not called")

            holder = await cache.lock("job:1", ttl=10)
            with pytest.raises(LockNotAcquired) as info:
                await once(1)
            assert info.value.key == "job:1" and "after waiting" not in str(info.value)
            loop = asyncio.get_running_loop()
            start = loop.time()
            with pytest.raises(LockNotAcquired, match=r"after waiting 0\.200 s"):
                await short(1)
            # uvloop's clock is cached per loop turn, in whole milliseconds: 10 ms of slack below.
            assert 0.19 <= loop.time() - start < 0.2 + 1.0
            loop.call_later(0.1, lambda: asyncio.ensure_future(holder.unlock()))
            start = loop.time()
            assert await waiting(1) is True
            assert 0.09 < loop.time() - start < 0.1 + 1.0
            await once(1)
            assert calls == [1]

    aio.run(main())


def test_async_released_when_the_coroutine_raises_or_is_cancelled(aio: Aio) -> None:
    async def main() -> None:
        async with await aio.connect() as cache:
            started = asyncio.Event()

            @cache.locked("work:{x}", ttl=5)
            async def fail(x: int) -> None:
                raise KeyError(x)

            @cache.locked("work:{x}", ttl=5)
            async def forever(x: int) -> None:
                started.set()
                await asyncio.sleep(60)

            with pytest.raises(KeyError):
                await fail(1)
            assert not await aheld(cache, "work:1")
            task = asyncio.get_running_loop().create_task(forever(2))
            await started.wait()
            assert await aheld(cache, "work:2")
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
            assert not await aheld(cache, "work:2")

    aio.run(main())


def test_async_the_return_value_and_the_functions_identity_pass_through(aio: Aio) -> None:
    async def settle(invoice_id: str, amount: int = 0) -> tuple[str, int]:
        """Settle one invoice."""
        return invoice_id, amount

    async def main() -> None:
        async with await aio.connect() as cache:
            wrapped = cache.locked("settle:{invoice_id}")(settle)
            assert await wrapped("i-1", 3) == ("i-1", 3)
            assert wrapped.__name__ == "settle"
            assert wrapped.__doc__ == "Settle one invoice."
            assert wrapped.__wrapped__ is settle  # type: ignore[attr-defined]
            assert inspect.signature(wrapped) == inspect.signature(settle)
            assert inspect.iscoroutinefunction(wrapped)

    aio.run(main())


def test_async_auto_extend_is_passed_on_and_a_loss_raises_lock_lost(aio: Aio) -> None:
    async def main() -> None:
        async with await aio.connect() as cache:

            @cache.locked("long:{x}", ttl=0.9, auto_extend=True)
            async def long(x: int) -> bool:
                await asyncio.sleep(1.0)  # past the TTL: still held, renewed about every 0.3 s
                return await aheld(cache, f"long:{x}")

            @cache.locked("lost:{x}", ttl=0.6, auto_extend=True)
            async def lost(x: int) -> None:
                await adelete_key(aio, cache, f"lost:{x}")
                await asyncio.sleep(5)  # cancelled at the loss

            assert await long(1) is True
            assert not await aheld(cache, "long:1")
            with pytest.raises(LockLost):
                await lost(1)

    aio.run(main())


def test_async_refusals_at_decoration(aio: Aio) -> None:
    def plain(x: int) -> int:
        return x

    def gen(x: int) -> Iterator[int]:
        yield x

    async def agen(x: int) -> AsyncIterator[int]:
        yield x

    async def coro(x: int) -> int:
        return x

    async def main() -> None:
        async with await aio.connect() as cache:
            refused: list[tuple[type[Exception], str | None, Callable[[], object]]] = [
                (TypeError, r"is not one: use hotlock\.Cache\.locked", lambda: cache.locked("k:{x}")(plain)),  # type: ignore[arg-type]
                (TypeError, "generator function", lambda: cache.locked("k:{x}")(gen)),  # type: ignore[arg-type]
                (TypeError, "generator function", lambda: cache.locked("k:{x}")(agen)),  # type: ignore[arg-type]
                (ValueError, "'y', which is not a parameter", lambda: cache.locked("k:{y}")(coro)),
                (ValueError, "positional field", lambda: cache.locked("k:{}")),
                (TypeError, "template must be a str", lambda: cache.locked(b"k")),  # type: ignore[arg-type]
            ]
            refused += [(error, None, functools.partial(cache.locked, "k:{x}", **kw)) for error, kw in BAD_ARGUMENTS]
            for error, match, call in refused:
                with pytest.raises(error, match=match):
                    call()
            assert await cache.locked("k:{x}")(coro)(5) == 5

    aio.run(main())
