"""`hotlock locks` and `hotlock release`: the held locks, read without their tokens.

A plain lock's value is its 16-byte token (and a waiter's mark); its fence is not stored,
so it shows none (earlier releases stored it after the token, and it is read there). The
token is a bearer secret, so nothing here reads it: the value's length (STRLEN) and the
bytes after the token (GETRANGE key 16 -1) are all that leave the server. A key held with a concurrency limit is a hash
whose fields are its permits' tokens: only its values (HVALS: each permit's fence and
deadline on the server's clock) are read.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import redis

from .._ident import TOKEN_BYTES
from ._target import CliError, Node, Target, fence_of, glob_matcher, lock_name, lock_pattern, user_key

__all__ = ["HeldLock", "Permit", "release_lock", "scan_locks"]

log = logging.getLogger("hotlock")

# Keys per SCAN step and per pipeline of PTTL/STRLEN/GETRANGE: a few hundred keep each
# reply small and the server responsive while still one round trip per batch.
BATCH = 500
# A fence is at least the server's clock in microseconds at the acquire (see docs/fencing.md); one
# below this (2001-09-09) cannot be a clock, so no hold time is read from it.
_CLOCK_FENCE = 10**15


@dataclass
class Permit:
    """One holder of a key held with a concurrency limit."""

    ttl: float  # seconds left
    fence: int
    held: float | None  # seconds since the acquire, from the fence and the server's clock

    def as_json(self) -> dict[str, Any]:
        return {
            "ttl": round(self.ttl, 3),
            "fence": self.fence,
            "held": None if self.held is None else round(self.held, 3),
        }


@dataclass
class HeldLock:
    key: bytes  # the user key, without the prefix
    ttl: float | None  # seconds left; None when the key has no TTL (not written by hotlock)
    fence: int | None  # None for a lock taken before fencing
    held: float | None  # seconds since the acquire, from the fence and the server's clock
    node: str
    # A key held with a limit: its live permits (ttl, fence and held are then the first to
    # expire's); None for a plain lock.
    permits: list[Permit] | None = None

    def holders(self) -> list[HeldLock | Permit]:
        """Each holder: this lock, or each permit of a key held with a limit."""
        return [self] if self.permits is None else list(self.permits)

    def as_json(self) -> dict[str, Any]:
        from ._target import shown_key

        shown: dict[str, Any] = {
            "key": shown_key(self.key),
            "ttl": None if self.ttl is None else round(self.ttl, 3),
            "fence": self.fence,
            "held": None if self.held is None else round(self.held, 3),
            "node": self.node,
        }
        if self.permits is not None:
            shown["holders"] = len(self.permits)
            shown["permits"] = [p.as_json() for p in self.permits]
        return shown


def _permits(values: Any, now_us: int | None) -> list[Permit]:
    """The live permits among a limited key's hash values ('<fence>:<deadline ms>'; the
    hash's other fields, the last fence and a waiter's mark, have no ':'), soonest first."""
    permits = []
    for value in values:
        fence, sep, deadline = bytes(value).partition(b":")
        if not (sep and fence.isdigit() and deadline.isdigit()) or now_us is None:
            continue
        left = int(deadline) / 1000.0 - now_us / 1e6
        if left > 0:
            permits.append(Permit(left, int(fence), _held(int(fence), now_us)))
    return sorted(permits, key=lambda p: (p.ttl, p.fence))


def _limited(key: bytes, values: Any, node: str, now_us: int | None) -> HeldLock | None:
    """A key held with a limit, as a HeldLock, or None when no permit of it is live (or it
    is some other hash)."""
    if isinstance(values, Exception):
        return None
    permits = _permits(values, now_us)
    if not permits:
        return None
    first = permits[0]
    return HeldLock(key, first.ttl, first.fence, first.held, node, permits)


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
            hashes = []
            for i, (name, key) in enumerate(keys):
                pttl, length, tail = replies[3 * i : 3 * i + 3]
                if isinstance(pttl, Exception) or pttl == -2:
                    continue  # gone since the SCAN
                if isinstance(length, Exception):
                    hashes.append((name, key))  # not a string: a key held with a limit, or not a lock
                    continue
                fence = None if isinstance(tail, Exception) else fence_of(int(length), bytes(tail))
                ttl = None if pttl < 0 else pttl / 1000.0
                found.append(HeldLock(key, ttl, fence, _held(fence, now_us), node.address))
            if hashes:
                pipe = node.client.pipeline(transaction=False)
                for name, _ in hashes:
                    pipe.hvals(name)
                for (_, key), values in zip(hashes, pipe.execute(raise_on_error=False), strict=True):
                    limited = _limited(key, values, node.address, now_us)
                    if limited is not None:
                        found.append(limited)
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
    pipe.hvals(name)
    pttl, length, tail, values = pipe.execute(raise_on_error=False)
    return _record(key, pttl, length, tail, values, client)


def _record(key: bytes, pttl: Any, length: Any, tail: Any, values: Any, client: Any) -> HeldLock | None:
    """What PTTL, STRLEN, GETRANGE and HVALS of one key said, as a HeldLock: a plain lock
    (a string: HVALS refused), a key held with a limit (a hash: STRLEN refused), or None."""
    if isinstance(pttl, Exception):
        raise CliError(f"the server refused to read the lock: {pttl}")
    if pttl == -2:
        return None
    if isinstance(length, Exception):
        if isinstance(values, Exception):
            raise CliError(f"the server refused to read the lock: {length}")
        return _limited(key, values, _address(client), _server_us(client))
    fence = None if isinstance(tail, Exception) else fence_of(int(length), bytes(tail))
    address = _address(client)
    return HeldLock(key, None if pttl < 0 else pttl / 1000.0, fence, _held(fence, _server_us(client)), address)


def _address(client: Any) -> str:
    kw = client.connection_pool.connection_kwargs
    return str(kw.get("path") or f"{kw.get('host')}:{kw.get('port')}")


def release_lock(target: Target, key: bytes) -> HeldLock | None:
    """Delete the lock on ``key`` whoever holds it (every permit of a key held with a
    limit); what was removed, or None if not held.

    PTTL, STRLEN, GETRANGE, HVALS and DEL go in one MULTI/EXEC, so what is reported is
    exactly the lock that was deleted: a holder that releases and another that acquires in
    between can never make it report one lock's TTL and delete the next one's.
    """
    name = lock_name(target.prefix, key)
    client = target.client_for(name)
    pipe = client.pipeline(transaction=True)
    pipe.pttl(name)
    pipe.strlen(name)
    pipe.getrange(name, TOKEN_BYTES, -1)
    pipe.hvals(name)
    pipe.delete(name)
    try:
        pttl, length, tail, values, deleted = pipe.execute(raise_on_error=False)
    except redis.ResponseError as exc:  # EXECABORT: a command was refused (ACL) at queue time
        raise CliError(f"the server refused the release: {exc}") from None
    if isinstance(deleted, Exception):
        raise CliError(f"the server refused DEL: {deleted}")
    if not deleted:
        return None
    return _record(key, pttl, length, tail, values, client)
