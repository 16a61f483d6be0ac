"""The in-process async backend: the sync MemoryBackend's data, awaited.

Each of MemoryBackend's operations holds a threading.Lock for a few dict operations and
never waits on anything else, so calling it straight from a coroutine never blocks the
loop. It has no await inside, so a task cannot be cancelled half-way through one: the
ordering promise of AsyncBackend holds trivially.
"""

from __future__ import annotations

from .._dialect import Dialect
from .memory import MemoryBackend

__all__ = ["AsyncMemoryBackend"]


class AsyncMemoryBackend:
    name = "memory"
    server = "in-process"

    def __init__(self) -> None:
        self._data = MemoryBackend()
        self.dialect, self.fenced = self._data.dialect, self._data.fenced

    # ``script``: the script a Redis backend would send; nothing to send here.
    async def acquire(
        self, key: bytes, token: bytes, ttl_ms: int, since: float | None, wait_ms: int, script: object
    ) -> int:
        return self._data.acquire(key, token, ttl_ms)

    async def acquire_many(self, keys: list[bytes], tokens: list[bytes], ttl_ms: int) -> list[int]:
        return self._data.acquire_many(keys, tokens, ttl_ms)

    async def extend(self, key: bytes, token: bytes, ttl_ms: int) -> bool:
        return self._data.extend(key, token, ttl_ms)

    async def extend_many(self, keys: list[bytes], tokens: list[bytes], ttl_ms: int) -> list[bool]:
        return self._data.extend_many(keys, tokens, ttl_ms)

    async def release(self, key: bytes, token: bytes) -> bool:
        return self._data.release(key, token)

    async def release_many(self, keys: list[bytes], tokens: list[bytes]) -> list[bool]:
        return self._data.release_many(keys, tokens)

    async def set_nx(self, key: bytes, value: bytes, ttl_ms: int) -> bool:
        return self._data.set_nx(key, value, ttl_ms)

    async def incr(self, key: bytes, amount: int) -> int:
        return self._data.incr(key, amount)

    async def info(self) -> dict[str, str] | None:
        return self._data.info()

    async def command_info(self) -> list[object] | None:
        return None

    def use_dialect(self, dialect: Dialect) -> None:
        # What the data speaks, as MemoryBackend.use_dialect keeps it (connect(fences=...)).
        self._data.use_dialect(dialect)
        self.dialect, self.fenced = self._data.dialect, self._data.fenced

    async def close(self) -> None:
        self._data.close()
