"""`hotlock locks` and `hotlock release`: the held locks, read without their tokens.

A lock's value is its 16-byte token followed by its fence. The token is a bearer secret, so
nothing here reads it: the value's length (STRLEN) and the bytes after the token (GETRANGE
key 16 -1) are all that leave the server.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import redis

from .._ident import TOKEN_BYTES
from ._target import CliError, Node, Target, fence_of, glob_matcher, lock_name, lock_pattern, user_key

__all__ = ["HeldLock", "release_lock", "scan_locks"]

log = logging.getLogger("hotlock")

# Keys per SCAN step and per pipeline of PTTL/STRLEN/GETRANGE: a few hundred keep each
# reply small and the server responsive while still one round trip per batch.
BATCH = 500
# A fence is at least the server's clock in microseconds at the acquire (see docs/fencing.md); one
# below this (2001-09-09) cannot be a clock, so no hold time is read from it.
_CLOCK_FENCE = 10**15


@dataclass
class HeldLock:
    key: bytes  # the user key, without the prefix
    ttl: float | None  # seconds left; None when the key has no TTL (not written by hotlock)
    fence: int | None  # None for a lock taken before fencing
    held: float | None  # seconds since the acquire, from the fence and the server's clock
    node: str

    def as_json(self) -> dict[str, Any]:
        from ._target import shown_key

        return {
            "key": shown_key(self.key),
            "ttl": None if self.ttl is None else round(self.ttl, 3),
            "fence": self.fence,
            "held": None if self.held is None else round(self.held, 3),
            "node": self.node,
        }


def _server_us(client: Any) -> int | None:
    """The server's clock in microseconds, or None when TIME is refused."""
    try:
        seconds, micros = client.time()
    except redis.ResponseError:
        return None
    return int(seconds) * 1_000_000 + int(micros)


def _held(fence: int | None, now_us: int | None) -> float | None:
    if fence is None or now_us is None or fence < _CLOCK_FENCE or fence > now_us:
        return None
    return (now_us - fence) / 1e6


def _batches(node: Node, match: bytes) -> Iterator[list[bytes]]:
    batch: list[bytes] = []
    for name in node.client.scan_iter(match=match, count=BATCH):
        batch.append(name)
        if len(batch) >= BATCH:
            yield batch
            batch = []
    if batch:
        yield batch


def scan_locks(target: Target, pattern: bytes | None = None) -> tuple[list[HeldLock], int]:
    """Every lock held under the target's prefix whose user key matches the glob ``pattern``
    (Redis's glob syntax), on every primary, sorted by remaining TTL (no TTL last); and the
    number of commands sent that INFO commandstats counts as PTTL (watch subtracts them)."""
    matcher = None if pattern is None else glob_matcher(pattern)
    found: list[HeldLock] = []
    pttls = 0
    for node in target.nodes:
        now_us = _server_us(node.client)
        for names in _batches(node, lock_pattern(target.prefix)):
            keys = []
            for name in names:
                key = user_key(target.prefix, name)
                if key is not None and (matcher is None or matcher.fullmatch(key)):
                    keys.append((name, key))
            if not keys:
                continue
            pipe = node.client.pipeline(transaction=False)
            for name, _ in keys:
                pipe.pttl(name)
                pipe.strlen(name)
                pipe.getrange(name, TOKEN_BYTES, -1)
            replies = pipe.execute(raise_on_error=False)
            pttls += len(keys)
            for i, (_, key) in enumerate(keys):
                pttl, length, tail = replies[3 * i : 3 * i + 3]
                if isinstance(pttl, Exception) or pttl == -2 or isinstance(length, Exception):
                    continue  # gone since the SCAN, or not a string: not a lock
                fence = None if isinstance(tail, Exception) else fence_of(int(length), bytes(tail))
                ttl = None if pttl < 0 else pttl / 1000.0
                found.append(HeldLock(key, ttl, fence, _held(fence, now_us), node.address))
    found.sort(key=lambda lk: (lk.ttl is None, lk.ttl or 0.0, lk.key))
    return found, pttls


def peek_lock(target: Target, key: bytes) -> HeldLock | None:
    """The lock on ``key`` as it is now (for the confirmation prompt), or None if not held."""
    name = lock_name(target.prefix, key)
    client = target.client_for(name)
    pipe = client.pipeline(transaction=True)
    pipe.pttl(name)
    pipe.strlen(name)
    pipe.getrange(name, TOKEN_BYTES, -1)
    pttl, length, tail = pipe.execute(raise_on_error=False)
    return _record(key, pttl, length, tail, client)


def _record(key: bytes, pttl: Any, length: Any, tail: Any, client: Any) -> HeldLock | None:
    for reply in (pttl, length):
        if isinstance(reply, Exception):
            raise CliError(f"the server refused to read the lock: {reply}")
    if pttl == -2:
        return None
    fence = None if isinstance(tail, Exception) else fence_of(int(length), bytes(tail))
    address = _address(client)
    return HeldLock(key, None if pttl < 0 else pttl / 1000.0, fence, _held(fence, _server_us(client)), address)


def _address(client: Any) -> str:
    kw = client.connection_pool.connection_kwargs
    return str(kw.get("path") or f"{kw.get('host')}:{kw.get('port')}")


def release_lock(target: Target, key: bytes) -> HeldLock | None:
    """Delete the lock on ``key`` whoever holds it; what was removed, or None if not held.

    PTTL, STRLEN, GETRANGE and DEL go in one MULTI/EXEC, so what is reported is exactly the
    lock that was deleted: a holder that releases and another that acquires in between can
    never make it report one lock's TTL and delete the next one's.
    """
    name = lock_name(target.prefix, key)
    client = target.client_for(name)
    pipe = client.pipeline(transaction=True)
    pipe.pttl(name)
    pipe.strlen(name)
    pipe.getrange(name, TOKEN_BYTES, -1)
    pipe.delete(name)
    try:
        pttl, length, tail, deleted = pipe.execute(raise_on_error=False)
    except redis.ResponseError as exc:  # EXECABORT: a command was refused (ACL) at queue time
        raise CliError(f"the server refused the release: {exc}") from None
    if isinstance(deleted, Exception):
        raise CliError(f"the server refused DEL: {deleted}")
    if not deleted:
        return None
    return _record(key, pttl, length, tail, client)
