"""The in-process backend: the same lock semantics on the monotonic clock, for one process.

Used only when no Redis URL is configured. Its locks exclude other threads of this
process and nothing outside it; connect() says so in a WARNING.
"""

from __future__ import annotations

import threading
import time
from dataclasses import replace

from .._dialect import MEMORY, Dialect
from .._ident import TOKEN_BYTES
from .._scripts import KIND_CONFLICT, is_permit
from .._waiting import poll
from ..errors import cache_error

__all__ = ["MemoryBackend"]

_SWEEP_MIN = 1024

_fence_mutex = threading.Lock()
_last_fence = 0


def _next_fence() -> int:
    """The wall clock in microseconds, as the server's TIME would give, but at least one
    more than the last fence handed out in this process: strictly increasing per key
    (and across keys) even when the clock is stepped back or two acquisitions fall in
    one microsecond. Process-wide, so a new MemoryBackend (close() and connect again)
    never repeats a fence."""
    global _last_fence
    now = time.time_ns() // 1000
    with _fence_mutex:
        _last_fence = max(now, _last_fence + 1)
        return _last_fence


# A key held with a limit: each permit's token -> (its fence, its monotonic deadline).
Permits = dict[bytes, tuple[int, float]]


class MemoryBackend:
    name = "memory"
    dialect = MEMORY
    fenced = True
    server = "in-process"

    def __init__(self) -> None:
        # key -> (value, monotonic expiry in seconds, or None for "never", as INCR keys);
        # the value of a key held with a limit is its Permits, its expiry the last one's.
        self._data: dict[bytes, tuple[bytes | Permits, float | None]] = {}
        self._mutex = threading.Lock()
        # Expired entries go when next looked at, and all at once whenever the dict has
        # doubled since the last sweep: memory stays bounded by the keys in use (within
        # 2x), not by every key ever locked, at an amortised O(1) per write.
        self._sweep_at = _SWEEP_MIN

    def _put(self, key: bytes, entry: tuple[bytes | Permits, float | None], now: float) -> None:
        self._data[key] = entry
        if len(self._data) >= self._sweep_at:
            self._data = {k: e for k, e in self._data.items() if e[1] is None or e[1] > now}
            self._sweep_at = max(_SWEEP_MIN, 2 * len(self._data))

    def _live(self, key: bytes, now: float) -> tuple[bytes | Permits, float | None] | None:
        entry = self._data.get(key)
        if entry is not None and entry[1] is not None and entry[1] <= now:
            del self._data[key]
            return None
        return entry

    def _acquire_locked(self, key: bytes, token: bytes, ttl_ms: int, now: float) -> int:
        # _scripts.ACQUIRE's contract, value layout included (the token alone).
        if len(token) > TOKEN_BYTES:  # token '#' limit: a permit
            return self._permit_locked(key, token[:TOKEN_BYTES], int(token[TOKEN_BYTES + 1 :]), ttl_ms, now)
        entry = self._live(key, now)
        value = None if entry is None else entry[0]
        if isinstance(value, dict):
            if any(p[1] > now for p in value.values()):
                return KIND_CONFLICT
            value = None  # every permit ended: the key is free
        if entry is None or value is None:
            self._put(key, (token, now + ttl_ms / 1000.0), now)
            return _next_fence()
        if value == token:
            self._data[key] = (value, now + ttl_ms / 1000.0)
            return _next_fence()
        if entry[1] is None:
            return 0
        return -max(1, int((entry[1] - now) * 1000.0))

    def _permit_locked(self, key: bytes, token: bytes, limit: int, ttl_ms: int, now: float) -> int:
        """ACQUIRE's permit branch: a place among ``limit``, or the one ``token`` holds."""
        entry = self._live(key, now)
        permits: Permits = {}
        if entry is not None:
            if not isinstance(entry[0], dict):
                return KIND_CONFLICT
            permits = {t: p for t, p in entry[0].items() if p[1] > now}
        mine = permits.get(token)
        if mine is None and len(permits) >= limit:
            return -max(1, int((min(p[1] for p in permits.values()) - now) * 1000.0))
        fence = _next_fence() if mine is None else mine[0]
        permits[token] = (fence, now + ttl_ms / 1000.0)
        self._put(key, (permits, max(p[1] for p in permits.values())), now)
        return fence

    def _permit(self, key: bytes, value: bytes, now: float) -> tuple[Permits, bytes] | None:
        """The permits of ``key`` and the token of ``value`` (token '#' fence, or a bare
        token) when that permit is live there."""
        entry = self._live(key, now)
        if entry is None or not isinstance(entry[0], dict):
            return None
        token = value[:TOKEN_BYTES]
        held = entry[0].get(token)
        if held is None or held[1] <= now or (len(value) > TOKEN_BYTES and held[0] != int(value[TOKEN_BYTES + 1 :])):
            return None
        return entry[0], token

    def acquire(self, key: bytes, token: bytes, ttl_ms: int) -> int:
        with self._mutex:
            return self._acquire_locked(key, token, ttl_ms, time.monotonic())

    def acquire_wait(self, key: bytes, token: bytes, ttl_ms: int, wait_ms: int) -> tuple[int, float, int]:
        return poll(lambda _script: self.acquire(key, token, ttl_ms), wait_ms)

    def acquire_many(self, keys: list[bytes], tokens: list[bytes], ttl_ms: int) -> list[int]:
        with self._mutex:
            now = time.monotonic()
            return [self._acquire_locked(k, t, ttl_ms, now) for k, t in zip(keys, tokens, strict=True)]

    def _extend_locked(self, key: bytes, token: bytes, ttl_ms: int, now: float) -> bool:
        deadline = now + ttl_ms / 1000.0
        if is_permit(token):
            found = self._permit(key, token, now)
            if found is None:
                return False
            permits, own = found
            permits[own] = (permits[own][0], deadline)
            self._data[key] = (permits, max(deadline, self._data[key][1] or deadline))
            return True
        entry = self._live(key, now)
        if entry is None or entry[0] != token:
            return False
        self._data[key] = (token, deadline)
        return True

    def extend(self, key: bytes, token: bytes, ttl_ms: int) -> bool:
        with self._mutex:
            return self._extend_locked(key, token, ttl_ms, time.monotonic())

    def extend_many(self, keys: list[bytes], tokens: list[bytes], ttl_ms: int) -> list[bool]:
        with self._mutex:
            now = time.monotonic()
            return [self._extend_locked(k, t, ttl_ms, now) for k, t in zip(keys, tokens, strict=True)]

    def _release_locked(self, key: bytes, token: bytes, now: float) -> bool:
        entry = self._live(key, now)
        if entry is None:
            return False
        if isinstance(entry[0], dict):
            found = self._permit(key, token, now)
            if found is None:
                return False
            permits, own = found
            del permits[own]
            if not permits:
                del self._data[key]
            return True
        if entry[0] != token:
            return False
        del self._data[key]
        return True

    def release(self, key: bytes, token: bytes) -> bool:
        with self._mutex:
            return self._release_locked(key, token, time.monotonic())

    def release_many(self, keys: list[bytes], tokens: list[bytes]) -> list[bool]:
        with self._mutex:
            now = time.monotonic()
            return [self._release_locked(k, t, now) for k, t in zip(keys, tokens, strict=True)]

    def set_nx(self, key: bytes, value: bytes, ttl_ms: int) -> bool:
        with self._mutex:
            now = time.monotonic()
            if self._live(key, now) is not None:
                return False
            self._put(key, (value, now + ttl_ms / 1000.0), now)
            return True

    def incr(self, key: bytes, amount: int) -> int:
        with self._mutex:
            now = time.monotonic()
            entry = self._live(key, now)
            # An INCR key is never a lock's (another prefix), so never holds permits.
            current = 0 if entry is None else int(entry[0])  # type: ignore[arg-type]
            value = current + amount
            if not -(2**63) <= value < 2**63:
                # Redis refuses the same overflow; keep the backends identical.
                raise cache_error("INCR failed: increment or decrement would overflow", self.server, key)
            self._put(key, (str(value).encode(), None if entry is None else entry[1]), now)
            return value

    def info(self) -> dict[str, str] | None:
        return {}

    def command_info(self) -> list[object] | None:
        return None

    def use_dialect(self, dialect: Dialect) -> None:
        # In-process: no server to speak to; only connect(fences=False) is kept (every
        # lock's fence 0, as on a server).
        self.dialect = MEMORY if dialect.fenced else replace(MEMORY, fenced=False)
        self.fenced = dialect.fenced

    def close(self) -> None:
        with self._mutex:
            self._data.clear()
