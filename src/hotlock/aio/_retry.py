"""The time budget of an async lost-reply retry, the wait_replicas error and the INFO
fields: shared by both async Redis backends, below the chooser in aio/_backend."""

from __future__ import annotations

import asyncio

from .._config import ServerConfig, cache_error
from ..errors import CacheError

__all__ = ["info_fields", "retry_until", "unconfirmed"]


def unconfirmed(what: str, replicas: int, config: ServerConfig, key: bytes | None) -> CacheError:
    """Under wait_replicas: the error for an acquire undone because too few replicas had it."""
    return cache_error(
        f"{what} undone: {replicas} of {config.wait_replicas} replicas confirmed it "
        f"within {round(config.wait_timeout * 1000)} ms (wait_replicas)",
        config.display,
        key,
    )


def retry_until(since: float | None, wait_ms: int, timeout: float) -> float:
    """Until when (loop time) a lost acquire reply may still be retried; see AsyncBackend.acquire."""
    start = asyncio.get_running_loop().time() if since is None else since
    return start + max(wait_ms / 1000.0, timeout) + timeout


def info_fields(raw: bytes) -> dict[str, str]:
    """An INFO reply as its ``name: value`` fields (section headers and blank lines dropped)."""
    fields: dict[str, str] = {}
    for line in raw.decode("utf-8", "replace").splitlines():
        name, sep, value = line.partition(":")
        if sep and not line.startswith("#"):
            fields[name] = value
    return fields
