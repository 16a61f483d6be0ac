"""Redis Cluster below the backend line: hash slots, the slot map, the redirection rules,
and the one sync backend that routes through them over any transport.

Written once, in pure Python (the native path never imports redis): a transport gives
one :class:`Link` per primary (the native one: a hiredis context per node per thread;
the redis-py one: a connection pool per node), and :class:`ClusterBackend` decides what
goes where:

- every key goes to the primary of its slot (CRC16-XMODEM of the key's hash tag, mod
  16384); the slot map comes from ``CLUSTER SHARDS`` (``CLUSTER SLOTS`` where SHARDS is
  missing), primaries only;
- ``MOVED slot host:port``: the slot now belongs there; note it, resend there, and refresh
  the whole map before the next call (a MOVED usually means a reshard moved many slots);
- ``ASK slot host:port`` (the slot is being migrated and this key is already gone):
  ``ASKING`` plus the command on that node, once, without touching the map;
- ``TRYAGAIN`` (a multi-key operation during a migration) and ``CLUSTERDOWN`` (the cluster
  lost a shard, or is electing a primary): sent again after a short sleep while the call's
  time budget lasts, then CacheError;
- ``NOSCRIPT`` from a node: load the scripts there and resend what did not run;
- a lost reply (I/O error, timeout): the node's commands are sent once more with the same
  tokens, within the call's retry budget (the scripts count "already my token" as
  success); the map is refreshed from another node first, so a dead primary's slots are
  looked up again (a failover may have moved them to its replica).

None of MOVED, ASK, TRYAGAIN, CLUSTERDOWN or NOSCRIPT means the command ran, so resending
after them is always safe; only a lost reply is ambiguous, and it gets the one retry.

A batch (``acquire_many`` over keys on three shards) is grouped by node; every node's
commands are written before any reply is read, so its wall time is one round trip (the
slowest node's), not one per node. Results come back in the caller's order.
"""

from __future__ import annotations

import contextlib
import random
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any, Protocol

from ._backoff import poll
from ._config import ServerConfig, cache_error
from ._scripts import ACQUIRE, EXTEND, RELEASE, SCRIPTS, Script, held_value
from .errors import CacheError

__all__ = [
    "SLOTS",
    "ClusterBackend",
    "Link",
    "LinkLost",
    "ReplyError",
    "SlotMap",
    "crc16",
    "key_slot",
    "parse_shards",
    "parse_slots",
]

SLOTS = 16384
Address = tuple[str, int]


# -- hash slots ------------------------------------------------------------------------


def _crc16_table() -> tuple[int, ...]:
    # CRC16-XMODEM (polynomial 0x1021, initial 0): the one Redis Cluster uses.
    table = []
    for byte in range(256):
        crc = byte << 8
        for _ in range(8):
            crc = ((crc << 1) ^ 0x1021) if crc & 0x8000 else crc << 1
        table.append(crc & 0xFFFF)
    return tuple(table)


_CRC16 = _crc16_table()


def crc16(data: bytes) -> int:
    crc = 0
    for byte in data:
        crc = ((crc << 8) & 0xFFFF) ^ _CRC16[((crc >> 8) ^ byte) & 0xFF]
    return crc


def key_slot(key: bytes) -> int:
    """The cluster slot of ``key``: only the part between the first ``{`` and the first
    ``}`` after it is hashed, when that part is not empty (the hash tag rule)."""
    start = key.find(b"{")
    if start >= 0:
        end = key.find(b"}", start + 1)
        if end > start + 1:
            key = key[start + 1 : end]
    return crc16(key) % SLOTS


# -- replies and links ----------------------------------------------------------------


class ReplyError(Exception):
    """An error reply, with the server's own text ("MOVED 3999 127.0.0.1:7002")."""

    @property
    def code(self) -> str:
        return str(self).split(" ", 1)[0]


class LinkLost(Exception):
    """The request may or may not have reached the node: an I/O error or a timeout."""


class Link(Protocol):
    """One primary, as a transport reaches it. ``link_send`` writes the commands (connecting,
    authenticating and loading the scripts first if needed) and returns a handle;
    ``link_recv`` reads that many replies from it, errors in place as ReplyError, all of them
    within ``timeout`` seconds when given. Both raise LinkLost on an I/O failure, after
    which the link reconnects on its next ``link_send``."""

    def link_send(self, commands: list[tuple[bytes, ...]]) -> object: ...
    def link_recv(self, handle: object, n: int, timeout: float | None) -> list[Any]: ...
    def link_close(self) -> None: ...


# -- the slot map ---------------------------------------------------------------------


def _text(value: object) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def parse_shards(reply: list[Any]) -> list[tuple[int, int, Address]]:
    """``CLUSTER SHARDS`` -> (first slot, last slot, primary) ranges, primaries that are up only."""
    ranges = []
    for shard in reply:
        fields = dict(zip(map(_text, shard[::2]), shard[1::2], strict=True))
        slots = [int(s) for s in fields.get("slots", [])]
        for node in fields.get("nodes", []):
            info = dict(zip(map(_text, node[::2]), node[1::2], strict=True))
            if _text(info.get("role")) != "master" or _text(info.get("health")) == "fail":
                continue
            host = _text(info.get("endpoint") or info.get("ip"))
            port = int(info.get("port") or info.get("tls-port") or 0)
            for first, last in zip(slots[::2], slots[1::2], strict=True):
                ranges.append((first, last, (host, port)))
    return ranges


def parse_slots(reply: list[Any]) -> list[tuple[int, int, Address]]:
    """``CLUSTER SLOTS`` -> (first slot, last slot, primary) ranges (the first node is the primary)."""
    return [(int(r[0]), int(r[1]), (_text(r[2][0]), int(r[2][1]))) for r in reply]


class SlotMap:
    """Which primary serves each of the 16384 slots; shared by every thread of a backend.

    Reads are a list index (no lock: a slot's entry is replaced whole). Writers take the
    mutex; ``stale`` asks the next call to refresh the whole map first.
    """

    def __init__(self) -> None:
        self._owner: list[Address | None] = [None] * SLOTS
        self.mutex = threading.Lock()
        self.stale = True
        self.refreshed = 0.0  # time.monotonic() of the last replace()
        self.primaries: tuple[Address, ...] = ()

    def owner(self, slot: int) -> Address | None:
        return self._owner[slot]

    def moved(self, slot: int, address: Address) -> None:
        self._owner[slot] = address
        self.stale = True

    def replace(self, ranges: list[tuple[int, int, Address]]) -> None:
        owner: list[Address | None] = [None] * SLOTS
        for first, last, address in ranges:
            owner[first : last + 1] = [address] * (last - first + 1)
        self._owner = owner
        self.primaries = tuple(sorted({a for _, _, a in ranges}))
        self.stale = False
        self.refreshed = time.monotonic()


# -- the backend ------------------------------------------------------------------------

_REDIRECTS = 8  # MOVED/ASK hops one call follows before it calls the map broken
_UNSERVED_REFRESH_S = 0.1  # how often a call for an unserved slot may ask for the map again
_PAUSE_S = 0.02  # sleep before resending after TRYAGAIN / CLUSTERDOWN, doubled up to 0.2 s


def _acquired(result: int) -> bool:
    # The ACQUIRE script's result convention (hotlock._scripts.ACQUIRE): the fence, > 0.
    return result > 0


class ClusterBackend:
    """The Backend protocol on a Redis Cluster, over any transport's links.

    ``open_link(config)`` makes the link of one node (``config`` is the cluster's own,
    pointed at that node by ServerConfig.node). The transport's name ("native",
    "redis-py") is the backend's; ``server`` shows the cluster's seeds.
    """

    def __init__(self, config: ServerConfig, name: str, open_link: Callable[[ServerConfig], Link]) -> None:
        self.name = name
        self.server = config.display
        self._config = config
        self._open_link = open_link
        self._timeout = config.timeout
        self._wait_replicas = config.wait_replicas
        self._wait_ms = round(config.wait_timeout * 1000)
        self._links: dict[Address, Link] = {}
        self._links_mutex = threading.Lock()
        self._map = SlotMap()
        self._seeds: tuple[Address, ...] = config.seeds
        # Connect now: a cluster none of whose seeds answers is a CacheError at connect().
        self.refresh()
        for address in self._map.primaries:
            self._link(address)

    # -- topology ---------------------------------------------------------------------

    def primaries(self) -> tuple[Address, ...]:
        """Every primary in the slot map now (for a caller that must visit each one)."""
        return self._map.primaries

    def slot_owner(self, key: bytes) -> Address | None:
        return self._map.owner(key_slot(key))

    def refresh(self, avoid: Address | None = None) -> None:
        """Ask one node after another (the known primaries, then the seeds; ``avoid`` last)
        for the slot map; raise CacheError when none answers."""
        candidates = list(self._map.primaries)
        random.shuffle(candidates)  # spread the map queries of many clients over the nodes
        candidates += [s for s in self._seeds if s not in candidates]
        if avoid in candidates:
            candidates.remove(avoid)
            candidates.append(avoid)
        errors = []
        for address in candidates:
            try:
                ranges = self._ask_map(address)
            except (LinkLost, ReplyError, CacheError, ValueError, IndexError, TypeError) as exc:
                errors.append(f"{address[0]}:{address[1]}: {exc or type(exc).__name__}")
                continue
            if not ranges:
                errors.append(f"{address[0]}:{address[1]}: no slots assigned")
                continue
            with self._map.mutex:
                self._map.replace(ranges)
            return
        raise cache_error(f"no cluster node gave the slot map ({'; '.join(errors)})", self.server)

    def _ask_map(self, address: Address) -> list[tuple[int, int, Address]]:
        link = self._link(address)
        reply = link.link_recv(link.link_send([(b"CLUSTER", b"SHARDS")]), 1, None)[0]
        if isinstance(reply, ReplyError):
            # Redis 6 and older have no CLUSTER SHARDS.
            reply = link.link_recv(link.link_send([(b"CLUSTER", b"SLOTS")]), 1, None)[0]
            if isinstance(reply, ReplyError):
                raise reply
            return parse_slots(reply)
        return parse_shards(reply)

    def _link(self, address: Address) -> Link:
        link = self._links.get(address)
        if link is None:
            with self._links_mutex:
                link = self._links.get(address)
                if link is None:
                    link = self._open_link(self._config.node(*address))
                    self._links[address] = link
        return link

    def _owner(self, key: bytes) -> Address:
        if self._map.stale:
            with contextlib.suppress(CacheError):
                # Keep the slot we learnt from MOVED if no node answers for the whole map.
                self.refresh()
        slot = key_slot(key)
        address = self._map.owner(slot)
        if address is None and time.monotonic() - self._map.refreshed >= _UNSERVED_REFRESH_S:
            # No primary for the slot when we last looked (its primary failed, its replica
            # not yet promoted): look again, but not on every call while the gap lasts.
            with contextlib.suppress(CacheError):
                self.refresh()
            address = self._map.owner(slot)
        if address is None:
            raise cache_error("no primary serves the slot of the key (the cluster is incomplete)", self.server, key)
        return address

    # -- routing ------------------------------------------------------------------------

    def _run(
        self,
        what: str,
        keys: Sequence[bytes],
        commands: Sequence[tuple[bytes, ...]],
        retry_until: float | None,
        wait: bool = False,
    ) -> list[Any]:
        """Send ``commands[i]`` to the primary of ``keys[i]``, all nodes written before any is
        read, following the redirection rules; the replies in order, or CacheError.

        ``retry_until`` (a time.monotonic()) allows one resend after a lost reply; it also
        bounds how long TRYAGAIN/CLUSTERDOWN are waited out (else one reply timeout).
        ``wait``: a WAIT after each node's commands (wait_replicas); too few replicas on any
        node undoes the acquires and raises.
        """
        n = len(keys)
        results: list[Any] = [None] * n
        pending = list(range(n))
        asking: dict[int, Address] = {}
        budget_end = retry_until if retry_until is not None else time.monotonic() + self._timeout
        override: float | None = None
        retried = redirects = 0
        pause = _PAUSE_S
        reloaded: set[Address] = set()
        replicas: list[tuple[Address, int]] = []
        one = n == 1
        while pending:
            groups: dict[Address, list[int]] = {}
            for i in pending:
                groups.setdefault(asking.get(i) or self._owner(keys[i]), []).append(i)
            sent: list[tuple[Address, Link, list[int], object, int]] = []
            lost: list[tuple[Address, list[int], BaseException]] = []
            for address, idxs in groups.items():
                batch: list[tuple[bytes, ...]] = []
                for i in idxs:
                    if i in asking:
                        batch.append((b"ASKING",))
                    batch.append(commands[i])
                if wait:
                    batch.append((b"WAIT", b"%d" % self._wait_replicas, b"%d" % self._wait_ms))
                try:
                    link = self._link(address)
                    sent.append((address, link, idxs, link.link_send(batch), len(batch)))
                except (LinkLost, CacheError) as exc:
                    lost.append((address, idxs, exc))
            pending = []
            again: list[int] = []  # not run: resend at once
            later: list[int] = []  # TRYAGAIN / CLUSTERDOWN: resend after a pause
            error: tuple[str, bytes | None] | None = None
            for address, link, idxs, handle, count in sent:
                try:
                    replies = link.link_recv(handle, count, override)
                except LinkLost as exc:
                    lost.append((address, idxs, exc))
                    continue
                if wait:
                    reply = replies.pop()
                    if isinstance(reply, ReplyError):
                        error = error or (f"WAIT on {address[0]}:{address[1]}: the server replied {reply}", None)
                    else:
                        replicas.append((address, int(reply)))
                j = 0
                for i in idxs:
                    if i in asking:
                        j += 1  # ASKING's +OK
                        del asking[i]
                        asked = True
                    else:
                        asked = False
                    reply = replies[j]
                    j += 1
                    if not isinstance(reply, ReplyError):
                        results[i] = reply
                        continue
                    code = reply.code
                    if code in ("MOVED", "ASK"):
                        redirects += 1
                        _, slot, target = str(reply).split(" ")
                        host, _, port = target.rpartition(":")
                        to = (host or address[0], int(port))
                        if code == "MOVED":
                            with self._map.mutex:
                                self._map.moved(int(slot), to)
                        elif asked:
                            # An ASK answered with ASK: the migration is confused; do not loop.
                            error = error or (f"{what} failed: the server replied {reply} after ASKING", keys[i])
                            continue
                        else:
                            asking[i] = to
                        if redirects > _REDIRECTS * max(1, len(idxs)):
                            error = error or (f"{what} failed: redirected {redirects} times ({reply})", keys[i])
                        again.append(i)
                    elif code in ("TRYAGAIN", "CLUSTERDOWN"):
                        later.append(i)
                        if code == "CLUSTERDOWN":
                            self._map.stale = True
                    elif code == "NOSCRIPT" and address not in reloaded:
                        reloaded.add(address)
                        self._load_scripts(link, address, what)
                        again.append(i)
                    else:
                        if code == "READONLY":
                            self._map.stale = True  # a demoted primary: look again
                        error = error or (f"{what} failed: the server replied {reply}", keys[i])
            if error is not None:
                self._undo_acquires(wait, keys, commands, results)
                raise cache_error(error[0], self.server, error[1])
            if lost:
                left = 0.0 if retry_until is None else min(self._timeout, retry_until - time.monotonic())
                where, first, cause = lost[0]
                if retried or left < 0.001:
                    self._undo_acquires(wait, keys, commands, results)
                    suffix = " (retried after a lost reply)" if retried else ""
                    raise cache_error(
                        f"{what}{suffix} failed on {where[0]}:{where[1]}: {cause}",
                        self.server,
                        keys[first[0]] if one else None,
                    ) from cause
                retried += 1
                override = left
                # The node may be gone for good (a killed primary whose replica takes over):
                # ask another node where its slots are before the one retry.
                with contextlib.suppress(CacheError):
                    self.refresh(avoid=where)
                for _, idxs, _ in lost:
                    again.extend(idxs)
            if later:
                if time.monotonic() + pause > budget_end:
                    self._undo_acquires(wait, keys, commands, results)
                    raise cache_error(
                        f"{what} failed: the cluster kept replying TRYAGAIN/CLUSTERDOWN", self.server, keys[later[0]]
                    )
                time.sleep(pause)
                pause = min(pause * 2, 0.2)
                again.extend(later)
            pending = sorted(again)
        if wait:
            short = [(a, r) for a, r in replicas if r < self._wait_replicas]
            if short:
                self._undo_acquires(True, keys, commands, results)
                (node_host, node_port), got = short[0]
                raise cache_error(
                    f"{what} undone: {got} of {self._wait_replicas} replicas of {node_host}:{node_port} confirmed it "
                    f"within {self._wait_ms} ms (wait_replicas)",
                    self.server,
                    keys[0] if one else None,
                )
        return results

    def _undo_acquires(
        self, wait: bool, keys: Sequence[bytes], commands: Sequence[tuple[bytes, ...]], results: list[Any]
    ) -> None:
        """A failed acquire batch releases what it did acquire, so no key is stranded until
        its TTL (only acquires under WAIT, or any acquire batch: commands[i][1] tells)."""
        held = [
            (k, held_value(c[4], r))
            for k, c, r in zip(keys, commands, results, strict=True)
            if c[1] == ACQUIRE.sha and isinstance(r, int) and _acquired(r)
        ]
        if held:
            with contextlib.suppress(CacheError):
                self.release_many([k for k, _ in held], [t for _, t in held])

    def _load_scripts(self, link: Link, address: Address, what: str) -> None:
        try:
            replies = link.link_recv(
                link.link_send([(b"SCRIPT", b"LOAD", s.source) for s in SCRIPTS]), len(SCRIPTS), None
            )
        except LinkLost as exc:
            raise cache_error(f"{what} failed: SCRIPT LOAD on {address[0]}:{address[1]}: {exc}", self.server) from exc
        for reply in replies:
            if isinstance(reply, ReplyError):
                raise cache_error(f"{what} failed: SCRIPT LOAD: the server replied {reply}", self.server)

    def _retry_until(self, wait_ms: int = 0) -> float:
        """As in every backend: a call that may wait ``wait_ms`` returns within
        max(wait, one reply timeout) plus one reply timeout, lost reply or not."""
        return time.monotonic() + max(wait_ms / 1000.0, self._timeout) + self._timeout

    def _scripts(
        self,
        what: str,
        script: Script,
        keys: Sequence[bytes],
        args: Sequence[tuple[bytes, ...]],
        retry_until: float | None,
    ) -> list[Any]:
        commands = [(b"EVALSHA", script.sha, b"1", k, *a) for k, a in zip(keys, args, strict=True)]
        wait = script is ACQUIRE and self._wait_replicas > 0
        return self._run(what, keys, commands, retry_until, wait)

    # -- the Backend interface --------------------------------------------------------

    def acquire(self, key: bytes, token: bytes, ttl_ms: int) -> int:
        return int(self._scripts("acquire", ACQUIRE, [key], [(token, b"%d" % ttl_ms)], self._retry_until())[0])

    def acquire_wait(self, key: bytes, token: bytes, ttl_ms: int, wait_ms: int) -> tuple[int, float]:
        retry_until = self._retry_until(wait_ms)
        ttl = b"%d" % ttl_ms
        return poll(lambda: int(self._scripts("acquire", ACQUIRE, [key], [(token, ttl)], retry_until)[0]), wait_ms)

    def acquire_many(self, keys: list[bytes], tokens: list[bytes], ttl_ms: int) -> list[int]:
        ttl = b"%d" % ttl_ms
        replies = self._scripts("acquire_many", ACQUIRE, keys, [(t, ttl) for t in tokens], self._retry_until())
        return [int(r) for r in replies]

    def extend(self, key: bytes, token: bytes, ttl_ms: int) -> bool:
        # No retry: a lost extend reply is a CacheError; the caller retries while valid_for() lasts.
        return bool(self._scripts("extend", EXTEND, [key], [(token, b"%d" % ttl_ms)], None)[0])

    def extend_many(self, keys: list[bytes], tokens: list[bytes], ttl_ms: int) -> list[bool]:
        ttl = b"%d" % ttl_ms
        return [bool(r) for r in self._scripts("extend_many", EXTEND, keys, [(t, ttl) for t in tokens], None)]

    def release(self, key: bytes, token: bytes) -> bool:
        return bool(self._scripts("release", RELEASE, [key], [(token,)], self._retry_until())[0])

    def release_many(self, keys: list[bytes], tokens: list[bytes]) -> list[bool]:
        return [
            bool(r) for r in self._scripts("release_many", RELEASE, keys, [(t,) for t in tokens], self._retry_until())
        ]

    def set_nx(self, key: bytes, value: bytes, ttl_ms: int) -> bool:
        # Never resent after a lost reply (not safe twice), as on one server.
        reply = self._run("set_nx", [key], [(b"SET", key, value, b"NX", b"PX", b"%d" % ttl_ms)], None)[0]
        return reply is not None

    def incr(self, key: bytes, amount: int) -> int:
        return int(self._run("incr", [key], [(b"INCRBY", key, b"%d" % amount)], None)[0])

    def info(self) -> dict[str, str] | None:
        """The first primary's INFO, plus ``cluster_primaries`` and, per primary with an
        evicting policy, ``maxmemory_policy@host:port`` (connect() warns about each)."""
        merged: dict[str, str] | None = None
        for address in self._map.primaries:
            try:
                link = self._link(address)
                reply = link.link_recv(link.link_send([(b"INFO",)]), 1, None)[0]
            except LinkLost as exc:
                raise cache_error(f"INFO on {address[0]}:{address[1]} failed: {exc}", self.server) from exc
            if isinstance(reply, ReplyError):
                if reply.code == "NOPERM":
                    return None
                raise cache_error(f"INFO failed: the server replied {reply}", self.server)
            fields = _info_fields(reply)
            if merged is None:
                merged = dict(fields)
                merged["maxmemory_policy"] = "noeviction"
            policy = fields.get("maxmemory_policy", "noeviction")
            if policy != "noeviction":
                merged[f"maxmemory_policy@{address[0]}:{address[1]}"] = policy
        if merged is None:
            return {}
        merged["cluster_primaries"] = str(len(self._map.primaries))
        return merged

    def close(self) -> None:
        with self._links_mutex:
            links = list(self._links.values())
        for link in links:
            link.link_close()


def _info_fields(reply: object) -> dict[str, str]:
    fields = {}
    for line in _text(reply).splitlines():
        if line and not line.startswith("#"):
            name, sep, value = line.partition(":")
            if sep:
                fields[name] = value
    return fields
