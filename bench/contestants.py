"""Every lock the benchmarks compare, behind one small interface.

A sync contestant offers: ``cycle(key)`` (acquire a free key once, release it),
``hold(key)`` then ``extend()`` (on the held lock, TTL set to 30 s from now, never
added to what is left), ``batch(keys)`` (hotlock only: lock_many + unlock_many),
``try_acquire(key)``, ``wait(key, seconds)`` (the library's own blocking acquire) and
``release(handle)``. An async contestant offers ``await cycle(key)``.

Each is configured the way its documentation shows, with a 30 s TTL; where the library
would need a setting to do the same job as hotlock, the setting is named here.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

__all__ = [
    "ASYNC",
    "SYNC",
    "AsyncContestant",
    "SyncContestant",
    "async_unavailable",
    "open_async",
    "open_sync",
    "sync_unavailable",
]

TTL = 30  # seconds, every contestant


class NotAcquired(Exception):
    """A contestant's acquire that should have succeeded did not."""


class SyncContestant:
    name = "?"
    has_batch = False

    def cycle(self, key: str) -> None:
        raise NotImplementedError

    def hold(self, key: str) -> None:
        raise NotImplementedError

    def extend(self) -> None:
        raise NotImplementedError

    def batch(self, keys: list[str]) -> None:
        raise NotImplementedError

    def try_acquire(self, key: str) -> Any:
        raise NotImplementedError

    def wait(self, key: str, seconds: float) -> Any:
        """Block in the library's own wait loop; NotAcquired when it gives up."""
        raise NotImplementedError

    def release(self, handle: Any) -> None:
        raise NotImplementedError

    def close(self) -> None:
        pass


# -- hotlock (sync) ------------------------------------------------------------------


class Hotlock(SyncContestant):
    has_batch = True

    def __init__(self, url: str, backend: str, wakeups: bool = True) -> None:
        import hotlock

        self.name = f"hotlock {backend}" + ("" if wakeups else " (polling)")
        self._errors: tuple[type[BaseException], ...] = (hotlock.LockNotAcquired,)
        self.cache = hotlock.connect(url, backend=backend, wakeups=wakeups)
        if self.cache.backend != backend:
            raise RuntimeError(f"asked for the {backend} backend, got {self.cache.backend}")
        self._held: Any = None

    def cycle(self, key: str) -> None:
        self.cache.lock(key, TTL).unlock()

    def hold(self, key: str) -> None:
        self._held = self.cache.lock(key, TTL)

    def extend(self) -> None:
        self._held.extend(TTL)

    def batch(self, keys: list[str]) -> None:
        locks = self.cache.lock_many(keys, TTL)
        if None in locks:
            raise NotAcquired("lock_many found a fresh key held")
        self.cache.unlock_many(locks)

    def try_acquire(self, key: str) -> Any:
        return self.cache.lock(key, TTL)

    def wait(self, key: str, seconds: float) -> Any:
        try:
            return self.cache.lock_wait(key, TTL, seconds)
        except self._errors as exc:
            raise NotAcquired(str(exc)) from None

    def release(self, handle: Any) -> None:
        handle.unlock()

    def close(self) -> None:
        self.cache.close()


# -- peers (sync) --------------------------------------------------------------------


def _redis(url: str) -> Any:
    import redis

    # What the redis-py documentation shows: a client from the URL, its defaults
    # (hiredis is installed, so redis-py parses replies with it).
    return redis.Redis.from_url(url)


class PeerLock(SyncContestant):
    """A peer's lock object from ``_lock(key)``: try-once acquire(blocking=False), release()."""

    def __init__(self, url: str) -> None:
        self.r = _redis(url)
        self._held: Any = None

    def _lock(self, key: str) -> Any:
        raise NotImplementedError

    def try_acquire(self, key: str) -> Any:
        lock = self._lock(key)
        if not lock.acquire(blocking=False):
            raise NotAcquired(key)
        return lock

    def cycle(self, key: str) -> None:
        self.try_acquire(key).release()

    def hold(self, key: str) -> None:
        self._held = self.try_acquire(key)

    def release(self, handle: Any) -> None:
        handle.release()

    def close(self) -> None:
        self.r.close()


class RedisPyLock(PeerLock):
    """redis-py's ``Lock``: SET NX PX to acquire, Lua to release/extend, 0.1 s polling."""

    name = "redis-py Lock"

    def _lock(self, key: str) -> Any:
        return self.r.lock(key, timeout=TTL)

    def extend(self) -> None:
        # replace_ttl=True: set the TTL to 30 s from now, as hotlock's extend does.
        self._held.extend(TTL, replace_ttl=True)

    def wait(self, key: str, seconds: float) -> Any:
        # sleep=0.1 is redis-py's default polling interval, left as users get it.
        lock = self.r.lock(key, timeout=TTL, blocking_timeout=seconds)
        if not lock.acquire():
            raise NotAcquired(key)
        return lock


class PythonRedisLock(PeerLock):
    """ionelmc's python-redis-lock: GET + SET NX EX to acquire, BLPOP wake-up to wait."""

    name = "python-redis-lock"

    def __init__(self, url: str) -> None:
        import redis_lock

        self._mod = redis_lock
        super().__init__(url)

    def _lock(self, key: str) -> Any:
        return self._mod.Lock(self.r, key, expire=TTL)

    def extend(self) -> None:
        self._held.extend(TTL)

    def wait(self, key: str, seconds: float) -> Any:
        lock = self._lock(key)
        # Its timeout is whole seconds (BLPOP's); at least 1.
        if not lock.acquire(timeout=max(1, int(seconds))):
            raise NotAcquired(key)
        return lock


class PotteryRedlock(PeerLock):
    """pottery's ``Redlock`` with one master: SET NX PX, Lua release/extend, 0-0.2 s retries."""

    name = "pottery Redlock"

    def __init__(self, url: str) -> None:
        from pottery import Redlock

        self._cls = Redlock
        super().__init__(url)

    def _lock(self, key: str) -> Any:
        # num_extensions: pottery caps extensions at 3 by default; the extend benchmark
        # extends one lock many times, which hotlock allows.
        return self._cls(key=key, masters={self.r}, auto_release_time=float(TTL), num_extensions=2**31)

    def extend(self) -> None:
        self._held.extend()

    def wait(self, key: str, seconds: float) -> Any:
        lock = self._lock(key)
        if not lock.acquire(timeout=seconds):
            raise NotAcquired(key)
        return lock


SYNC: dict[str, Callable[[str], SyncContestant]] = {
    "hotlock-native": lambda url: Hotlock(url, "native"),
    "hotlock-redis-py": lambda url: Hotlock(url, "redis-py"),
    # lock_wait on its backoff alone (connect(wakeups=False)): the wait loop before wake-ups.
    "hotlock-native-polling": lambda url: Hotlock(url, "native", wakeups=False),
    "redis-py-Lock": RedisPyLock,
    "python-redis-lock": PythonRedisLock,
    "pottery-Redlock": PotteryRedlock,
}

LABELS = {
    "hotlock-native": "hotlock native",
    "hotlock-redis-py": "hotlock redis-py backend",
    "hotlock-native-polling": "hotlock native, polling (wakeups=False)",
    "redis-py-Lock": "redis-py Lock",
    "python-redis-lock": "python-redis-lock",
    "pottery-Redlock": "pottery Redlock (1 master)",
    "hotlock-aio-native": "hotlock.aio native",
    "hotlock-aio-redis-py": "hotlock.aio redis.asyncio backend",
    "redis.asyncio-Lock": "redis.asyncio Lock",
    "C-hiredis": "C loop over hiredis",
    "redis-benchmark": "redis-benchmark",
}

HOTLOCK = ("hotlock-native", "hotlock-redis-py")
# Measured where waiting is: contention and handoff.
POLLING = ("hotlock-native-polling",)
PEERS = ("redis-py-Lock", "python-redis-lock", "pottery-Redlock")


def open_sync(name: str, url: str) -> SyncContestant:
    return SYNC[name](url)


def sync_unavailable(name: str) -> str | None:
    """Why a sync contestant cannot run here ("not built: ..."), or None."""
    if name in ("hotlock-native", "hotlock-native-polling"):
        import hotlock

        info = hotlock.backend_info()
        if info["backend"] != "native":
            return f"not built: {info['reason']}"
        return None
    modules = {
        "hotlock-redis-py": "redis",
        "redis-py-Lock": "redis",
        "python-redis-lock": "redis_lock",
        "pottery-Redlock": "pottery",
    }
    try:
        __import__(modules[name])
    except ImportError as exc:
        return f"not installed: {exc}"
    return None


# -- async ---------------------------------------------------------------------------


class AsyncContestant:
    name = "?"

    async def cycle(self, key: str) -> None:
        raise NotImplementedError

    async def close(self) -> None:
        pass


class HotlockAio(AsyncContestant):
    def __init__(self, cache: Any) -> None:
        self.cache = cache
        self.name = f"hotlock.aio {cache.backend}"

    async def cycle(self, key: str) -> None:
        lock = await self.cache.lock(key, TTL)
        await lock.unlock()

    async def close(self) -> None:
        await self.cache.close()


class RedisAsyncioLock(AsyncContestant):
    """redis.asyncio's ``Lock`` on one client.

    The default pool raises MaxConnectionsError past 100 connections, so at 1000 tasks a
    user must pick a pool: BlockingConnectionPool(max_connections=100) is the documented
    one, and both task counts use it.
    """

    name = "redis.asyncio Lock"

    def __init__(self, url: str) -> None:
        import redis.asyncio

        pool = redis.asyncio.BlockingConnectionPool.from_url(url, max_connections=100, timeout=20)
        self.r = redis.asyncio.Redis(connection_pool=pool)

    async def cycle(self, key: str) -> None:
        lock = self.r.lock(key, timeout=TTL)
        if not await lock.acquire(blocking=False):
            raise NotAcquired(key)
        await lock.release()

    async def close(self) -> None:
        await self.r.aclose()
        await self.r.connection_pool.disconnect()


ASYNC = ("hotlock-aio-native", "hotlock-aio-redis-py", "redis.asyncio-Lock")


async def open_async(name: str, url: str) -> AsyncContestant:
    if name == "redis.asyncio-Lock":
        return RedisAsyncioLock(url)
    import hotlock.aio

    backend = {"hotlock-aio-native": "native", "hotlock-aio-redis-py": "redis-py"}[name]
    cache = await hotlock.aio.connect(url, backend=backend)
    if cache.backend != backend:
        await cache.close()
        raise RuntimeError(f"asked for the async {backend} backend, got {cache.backend}")
    return HotlockAio(cache)


def async_unavailable(name: str, url: str) -> str | None:
    """Why an async contestant cannot run here, or None. Connects once to find out."""
    import asyncio

    if name == "redis.asyncio-Lock":
        return None
    try:
        import hotlock.aio
    except ImportError as exc:
        return f"not built: hotlock.aio does not import ({exc})"
    if not hasattr(hotlock.aio, "connect"):
        return "not built: hotlock.aio has no connect() yet"

    async def probe() -> str | None:
        try:
            contestant = await open_async(name, url)
        except (ValueError, RuntimeError, NotImplementedError, ImportError) as exc:
            return f"not built: {exc}"
        await contestant.close()
        return None

    return asyncio.run(probe())
