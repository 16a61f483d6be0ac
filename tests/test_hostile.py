"""The hostile-reply matrix: every place a backend reads a reply, fed what no healthy server
sends, on every backend that speaks RESP (native and redis-py, sync and async).

A reply site gets one hostile reply from the fake server (tests/fakeserver.py): a wrong
type, a short or nested array, a huge length, a RESP3 type, an extra reply after the right
one, an integer at the ends of its range. Whatever the call does with it, it must end in a
result or in the library's own errors within its timeout (no signal, no hang, no TypeError
from deep inside), and the next call, answered honestly, must get its own reply: the fake
server answers an acquire with a fence computed from the key, so a reply shifted onto the
next caller shows as the wrong fence. A connection whose replies are in doubt has to be
dropped for that, never reused.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import pytest

import hotlock
import hotlock.aio
from hotlock._scripts import ACQUIRE, EXTEND, RELEASE
from hotlock.errors import HotlockError

from .conftest import BACKENDS as ALL_BACKENDS
from .conftest import lock_name
from .fakeserver import INFO, FakeRedis, bulk, fence_of

# The reply timeout of every cache here: short, since some payloads leave the client
# waiting for bytes that never come; the bound on a call is a multiple of it.
TIMEOUT = 0.25

# The backends that speak RESP: native (when the extension is live, required under make test) and redis-py.
BACKENDS = [b for b in ALL_BACKENDS if b != "memory"]


@dataclass(frozen=True)
class Payload:
    """A hostile reply. ``good`` in it is replaced by the site's right reply; ``close``
    closes the connection after it (a truncated reply then ends in EOF, not a wait)."""

    raw: bytes
    close: bool = False
    # How long the call may take: a retry after a lost reply and lock_wait's polling, 10x
    # over. A client that allocates what a huge array header asks for (redis-py, and
    # hiredis with its default maxelements) spends 2-4 s of CPU on it, more on a loaded
    # machine: not a hang, so bounded at 10x that, not failed as one.
    bound: float = 10 * 3 * TIMEOUT


GOOD = b"<good>"
PAYLOADS: dict[str, Payload] = {
    "status": Payload(b"+OK\r\n"),
    "bulk-text": Payload(b"$3\r\nabc\r\n"),
    "bulk-number": Payload(b"$2\r\n42\r\n"),
    "bulk-empty": Payload(b"$0\r\n\r\n"),
    "nil-bulk": Payload(b"$-1\r\n"),
    "nil-array": Payload(b"*-1\r\n"),
    "error": Payload(b"-ERR hostile\r\n"),
    "error-empty": Payload(b"-\r\n"),
    "array-empty": Payload(b"*0\r\n"),
    "array-of-int": Payload(b"*1\r\n:5\r\n"),
    "array-nested": Payload(b"*2\r\n*1\r\n*1\r\n:1\r\n*0\r\n"),
    "array-short-eof": Payload(b"*3\r\n:1\r\n", close=True),
    "array-huge": Payload(b"*999999999\r\n:1\r\n", close=True, bound=40.0),
    "array-huge-2^32": Payload(b"*4294967296\r\n", close=True),
    "bulk-huge": Payload(b"$999999999999\r\nab", close=True),
    "bulk-huge-waits": Payload(b"$999999999999\r\nab"),
    "bulk-negative": Payload(b"$-7\r\n"),
    "int-llong-min": Payload(b":-9223372036854775808\r\n"),
    "int-llong-max": Payload(b":9223372036854775807\r\n"),
    "int-overflow": Payload(b":99999999999999999999\r\n"),
    "int-not-a-number": Payload(b":12abc\r\n"),
    "int-cut-eof": Payload(b":12", close=True),
    "resp3-map": Payload(b"%1\r\n:1\r\n:2\r\n"),
    "resp3-set": Payload(b"~1\r\n:1\r\n"),
    "resp3-push": Payload(b">2\r\n$7\r\nmessage\r\n:1\r\n"),
    "resp3-push-then-good": Payload(b">2\r\n$7\r\nmessage\r\n:1\r\n" + GOOD),
    "resp3-attribute-then-good": Payload(b"|1\r\n+ttl\r\n:3\r\n" + GOOD),
    "resp3-double": Payload(b",1.5\r\n"),
    "resp3-double-inf": Payload(b",inf\r\n"),
    "resp3-bignum": Payload(b"(123456789012345678901234567890\r\n"),
    "resp3-bool": Payload(b"#t\r\n"),
    "resp3-null": Payload(b"_\r\n"),
    "resp3-verbatim": Payload(b"=7\r\ntxt:abc\r\n"),
    "resp3-blob-error": Payload(b"!6\r\nERR no\r\n"),
    "unknown-type-byte": Payload(b"?what\r\n"),
    "good-then-extra": Payload(GOOD + b":7\r\n"),
    "good-then-extra-array": Payload(GOOD + b"*2\r\n:7\r\n:8\r\n"),
}


def payload_bytes(payload: Payload, good: bytes) -> bytes:
    return payload.raw.replace(GOOD, good)


@dataclass
class Site:
    """One reply site: the command whose reply is made hostile (its first arguments), the
    right reply to it, and the call that reads it (after ``setup``, which is answered
    honestly). ``first`` rules go before the hostile one (lock_wait's first, held, attempt).
    ``transaction``: a site of the acquire's transaction (hotlock._acquire), skipped on a
    backend that takes a free key by script."""

    match: tuple[bytes, ...]
    good: bytes
    call: Callable[[Any, Any], Any]
    setup: Callable[[Any], Any] = lambda cache: None
    first: list[tuple[tuple[bytes, ...], bytes]] = field(default_factory=list)
    connect_kwargs: dict[str, Any] = field(default_factory=dict)
    in_connect: bool = False  # the site is in connect() itself
    transaction: bool = False


def acquired(key: str) -> bytes:
    return b":%d\r\n" % fence_of(lock_name(key))


def taken(key: str) -> bytes:
    """EXEC's reply when the transaction took ``key``: SET's OK and TIME's clock, whose
    microseconds are the fence the fake server's script would give (fence_of)."""
    seconds, micros = divmod(fence_of(lock_name(key)), 1_000_000)
    return b"*2\r\n+OK\r\n*2\r\n" + bulk(b"%d" % seconds) + bulk(b"%d" % micros)


ONE = b":1\r\n"
HELD = b":-30\r\n"  # the key is held, 30 ms left
# The acquire's script sites: where a backend sends it for every acquire.
BY_SCRIPT = {"scripts": "always"}

# The sites, with the sync call; the async call is the same with awaits (call_async).
SITES: dict[str, Site] = {
    "acquire": Site((b"EVALSHA", ACQUIRE.sha), acquired("k"), lambda c, _: c.lock("k"), connect_kwargs=BY_SCRIPT),
    "lock_wait-attempt": Site(
        (b"EVALSHA",),
        acquired("k"),
        lambda c, _: c.lock_wait("k", wait=0.3),
        first=[((b"EVALSHA",), HELD)],
        connect_kwargs=BY_SCRIPT,
    ),
    "acquire-multi": Site((b"MULTI",), b"+OK\r\n", lambda c, _: c.lock("k"), transaction=True),
    "acquire-set": Site((b"SET", lock_name("k")), b"+QUEUED\r\n", lambda c, _: c.lock("k"), transaction=True),
    "acquire-exec": Site((b"EXEC",), taken("k"), lambda c, _: c.lock("k"), transaction=True),
    "lock_many-exec-second": Site(
        (b"EXEC",),
        taken("m2"),
        lambda c, _: c.lock_many(["m1", "m2"]),
        first=[((b"EXEC",), taken("m1"))],
        transaction=True,
    ),
    "extend": Site((b"EVALSHA", EXTEND.sha), ONE, lambda _, lock: lock.extend(5), setup=lambda c: c.lock("k")),
    "release": Site((b"EVALSHA", RELEASE.sha), ONE, lambda _, lock: lock.unlock(), setup=lambda c: c.lock("k")),
    "lock_many": Site(
        (b"EVALSHA", ACQUIRE.sha), acquired("m1"), lambda c, _: c.lock_many(["m1", "m2"]), connect_kwargs=BY_SCRIPT
    ),
    "lock_many-second": Site(
        (b"EVALSHA", ACQUIRE.sha),
        acquired("m2"),
        lambda c, _: c.lock_many(["m1", "m2"]),
        first=[((b"EVALSHA", ACQUIRE.sha), acquired("m1"))],
        connect_kwargs=BY_SCRIPT,
    ),
    "extend_many": Site(
        (b"EVALSHA", EXTEND.sha),
        ONE,
        lambda c, locks: c.extend_many(locks, 5),
        setup=lambda c: c.lock_many(["m1", "m2"]),
    ),
    "unlock_many": Site(
        (b"EVALSHA", RELEASE.sha), ONE, lambda c, locks: c.unlock_many(locks), setup=lambda c: c.lock_many(["m1", "m2"])
    ),
    "set_nx": Site((b"SET",), b"+OK\r\n", lambda c, _: c.set_nx("s", b"v", 5)),
    "incr": Site((b"INCRBY",), b":3\r\n", lambda c, _: c.incr("n", 3)),
    "wait_replicas": Site((b"WAIT",), ONE, lambda c, _: c.lock("k"), connect_kwargs={"wait_replicas": 1}),
    "wait_replicas-extend": Site(
        (b"WAIT",),
        ONE,
        lambda _, lock: lock.extend(5),
        setup=lambda c: c.lock("k"),
        connect_kwargs={"wait_replicas": 1},
    ),
    "handshake-script-load": Site((b"SCRIPT", b"LOAD"), b"", lambda c, _: None, in_connect=True),
    "handshake-info": Site((b"INFO",), b"", lambda c, _: None, in_connect=True),
}


async def _maybe(value: Any) -> Any:
    return await value if isinstance(value, Awaitable) else value


def _arm(fake: FakeRedis, site: Site, payload: Payload) -> None:
    for match, reply in site.first:
        fake.on(*match, reply=reply)
    good = site.good
    if site.match == (b"SCRIPT", b"LOAD"):
        good = b"$40\r\n%s\r\n" % ACQUIRE.sha  # the first script loaded is ACQUIRE
    elif site.match == (b"INFO",):
        good = bulk(INFO)
    fake.on(*site.match, reply=payload_bytes(payload, good), close=payload.close)


def _allowed(exc: BaseException) -> bool:
    """The library's own errors; a LockNotAcquired or LockLost is a fair reading of some
    hostile replies (a negative acquire reply is "held")."""
    return isinstance(exc, HotlockError)


PROBE = "probe"


def check_probe_fence(fence: int) -> None:
    assert fence == fence_of(lock_name(PROBE)), (
        f"the call after the hostile reply got fence {fence}, not its own {fence_of(lock_name(PROBE))}: "
        "a reply was handed to the wrong caller"
    )


def _need_transactions(fake: FakeRedis) -> None:
    if not any(c[0].upper() == b"MULTI" for c in fake.received):
        pytest.skip("this backend takes a free key by script: the transaction's sites are not read")


def run_sync(backend: str, site: Site, payload: Payload) -> None:
    with FakeRedis() as fake:
        kwargs = {"backend": backend, "timeout": TIMEOUT, "connect_timeout": 1.0, "wakeups": False}
        kwargs.update(site.connect_kwargs)
        cache: hotlock.Cache | None = None
        started = time.monotonic()
        try:
            if site.in_connect:
                _arm(fake, site, payload)
                cache = hotlock.connect(fake.url, **kwargs)  # type: ignore[arg-type]
            else:
                cache = hotlock.connect(fake.url, **kwargs)  # type: ignore[arg-type]
                if site.transaction:
                    cache.lock("detect")
                    _need_transactions(fake)
                state = site.setup(cache)
                _arm(fake, site, payload)
                site.call(cache, state)
        except Exception as exc:
            if not _allowed(exc):
                raise AssertionError(f"{type(exc).__name__} escaped, not a library error: {exc!r}") from exc
        took = time.monotonic() - started
        assert took < payload.bound, f"the call took {took:.2f} s, past {payload.bound} s"
        assert fake.pending() == 0, "the hostile reply was never asked for: the site is not where the test thinks"
        # The next call, answered honestly, gets its own reply (on this connection or a new one).
        if cache is None:
            cache = hotlock.connect(fake.url, **kwargs)  # type: ignore[arg-type]
        try:
            check_probe_fence(cache.lock(PROBE).fence)
        finally:
            cache.close()


async def run_async(backend: str, site: Site, payload: Payload) -> None:
    with FakeRedis() as fake:
        kwargs = {"backend": backend, "timeout": TIMEOUT, "connect_timeout": 1.0, "wakeups": False}
        kwargs.update(site.connect_kwargs)
        cache: hotlock.aio.AsyncCache | None = None
        started = time.monotonic()
        try:
            if site.in_connect:
                _arm(fake, site, payload)
                cache = await hotlock.aio.connect(fake.url, **kwargs)  # type: ignore[arg-type]
            else:
                cache = await hotlock.aio.connect(fake.url, **kwargs)  # type: ignore[arg-type]
                if site.transaction:
                    await cache.lock("detect")
                    _need_transactions(fake)
                state = await _maybe(site.setup(cache))
                _arm(fake, site, payload)
                await asyncio.wait_for(_maybe(site.call(cache, state)), payload.bound)
        except Exception as exc:
            if not _allowed(exc):
                raise AssertionError(f"{type(exc).__name__} escaped, not a library error: {exc!r}") from exc
        took = time.monotonic() - started
        assert took < payload.bound, f"the call took {took:.2f} s, past {payload.bound} s"
        assert fake.pending() == 0, "the hostile reply was never asked for: the site is not where the test thinks"
        if cache is None:
            cache = await hotlock.aio.connect(fake.url, **kwargs)  # type: ignore[arg-type]
        try:
            check_probe_fence((await cache.lock(PROBE)).fence)
        finally:
            await cache.close()


# Every site gets the CORE payloads (one of each kind of trouble); the acquire, the hottest
# site, gets all of them. The rest of the cross product is the slow form (make test-slow).
CORE = [
    "status",
    "bulk-text",
    "nil-bulk",
    "array-nested",
    "array-huge",
    "int-llong-min",
    "resp3-push-then-good",
    "resp3-attribute-then-good",
    "resp3-double",
    "good-then-extra",
]


def _fast(backend: str, site: str, payload: str) -> bool:
    if payload == "array-huge":
        # A client that allocates what such a header asks for spends seconds of CPU on it
        # before the EOF ends it (redis-py; the sync native client until it bounds its
        # arrays): at the acquire only here, at every site in the slow form.
        return site in ("acquire", "acquire-exec")
    return payload in CORE or site in ("acquire", "acquire-exec")


ALL_CASES = [(backend, site, payload) for backend in BACKENDS for site in SITES for payload in PAYLOADS]
CASES = [case for case in ALL_CASES if _fast(*case)]
SLOW_CASES = [case for case in ALL_CASES if not _fast(*case)]


def _ids(cases: list[tuple[str, str, str]]) -> list[str]:
    return ["-".join(case) for case in cases]


@pytest.mark.timeout(60)
@pytest.mark.parametrize(("backend", "site", "payload"), CASES, ids=_ids(CASES))
def test_hostile_reply_sync(backend: str, site: str, payload: str) -> None:
    run_sync(backend, SITES[site], PAYLOADS[payload])


@pytest.mark.timeout(60)
@pytest.mark.parametrize(("backend", "site", "payload"), CASES, ids=_ids(CASES))
def test_hostile_reply_async(backend: str, site: str, payload: str) -> None:
    asyncio.run(run_async(backend, SITES[site], PAYLOADS[payload]))


@pytest.mark.slow
@pytest.mark.timeout(60)
@pytest.mark.parametrize(("backend", "site", "payload"), SLOW_CASES, ids=_ids(SLOW_CASES))
def test_hostile_reply_sync_more(backend: str, site: str, payload: str) -> None:
    run_sync(backend, SITES[site], PAYLOADS[payload])


@pytest.mark.slow
@pytest.mark.timeout(60)
@pytest.mark.parametrize(("backend", "site", "payload"), SLOW_CASES, ids=_ids(SLOW_CASES))
def test_hostile_reply_async_more(backend: str, site: str, payload: str) -> None:
    asyncio.run(run_async(backend, SITES[site], PAYLOADS[payload]))


@pytest.mark.timeout(60)
def test_async_native_refuses_a_reply_past_its_size_bound() -> None:
    """A bulk reply whose header asks for 100 MB, 17 MiB of it sent and the rest held back:
    the async core drops the connection once 16 MiB of one reply are buffered, at once,
    rather than growing its buffer until the reply timeout (no timeout while bytes flow)."""
    if "native" not in BACKENDS:
        pytest.skip("the native extension is not live")

    async def main() -> None:
        with FakeRedis() as fake:
            cache = await hotlock.aio.connect(fake.url, backend="native", timeout=5.0, wakeups=False)
            # INCRBY, since it is never resent after a lost reply (an acquire would be, and succeed).
            fake.on(b"INCRBY", reply=b"$100000000\r\n" + b"x" * (17 << 20))
            started = time.monotonic()
            with pytest.raises(hotlock.CacheError, match="larger than"):
                await cache.incr("n")
            assert time.monotonic() - started < 4.0, "it waited for the reply timeout instead"
            check_probe_fence((await cache.lock(PROBE)).fence)
            await cache.close()

    asyncio.run(main())
