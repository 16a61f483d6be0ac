"""Redis Cluster below the backend line: hash slots, the slot map, the redirection rules,
and the one sync backend that routes through them over any transport.

Written once, in pure Python (the native path never imports redis): a transport gives
one ``Link`` per primary (the native one: a hiredis context per node per thread;
the redis-py one: a connection pool per node), and ``ClusterBackend`` decides what
goes where:

- every key goes to the primary of its slot (CRC16-XMODEM of the key's hash tag, mod
  16384); the slot map comes from ``CLUSTER SHARDS`` (``CLUSTER SLOTS`` where SHARDS is
  missing, or where a shard lists two primaries: see needs_slots), primaries only, flagged
  ``fail`` or not (see parse_shards);
- ``MOVED slot host:port``: the slot now belongs there; note it, resend there, and refresh
  the whole map before the next call (a MOVED usually means a reshard moved many slots);
- ``ASK slot host:port`` (the slot is being migrated and this key is already gone):
  ``ASKING`` plus the command on that node, once, without touching the map;
- a transient reply (hotlock._transient): ``TRYAGAIN`` (a multi-key operation during a
  migration), ``CLUSTERDOWN`` (the cluster lost a shard, or is electing a primary),
  ``BUSY`` (a long script on the node), ``LOADING``, ``MASTERDOWN`` and ``READONLY`` (a
  demoted primary: the map is asked again): sent again after a jittered pause while the
  call's own timeout lasts, then CacheError naming the reply;
- ``NOSCRIPT`` from a node: load the scripts there and resend what did not run;
- a lost reply (I/O error, timeout): the node's commands are sent once more with the same
  tokens, within the call's retry budget (the scripts count "already my token" as
  success); the map is refreshed from another node first, so a dead primary's slots are
  looked up again (a failover may have moved them to its replica).

Each primary has its own dialect (hotlock._dialect), asked of it at connect and whenever a
map refresh brings a primary the map did not have: an extend or release goes Lua-free
(``SET … IFEQ``, ``DELIFEQ``/``DELEX``) to a node that has those commands and by script to
one that does not, so a cluster half-way through a rolling upgrade serves both. A miss
(a waiter's mark, which those commands compare too), OOM, WRONGTYPE, or a node that no
longer knows the command (it was downgraded, or renamed it away, in place) sends that key
once more by script, as on one server; the last also keeps that node on the scripts.

The acquire of a plain lock (ACQUIRE, not its waiting forms; no limit) goes to the key's
node as hotlock._acquire's transaction (MULTI, SET NX PX, TIME, EXEC), all four in that
node's write: its fence is the answer, SCRIPT sends the ACQUIRE script to the node next
(a batch: those keys only, one more pipeline per node), and an error reply is handled as
the script's would be. A slot that moved answers MOVED on the queued SET (EXEC then
refuses, EXECABORT): the transaction goes to the new owner. A slot being migrated
answers ASK there: ASKING covers only the command after it, so that key goes to the
target as ASKING and the script. A node that refuses MULTI alone (an ACL, a proxy) takes
its acquires by script from then on (ClusterCore.transacts). Not under
connect(scripts='always').

None of MOVED, ASK, NOSCRIPT or the transient replies means the command ran, so resending
after them is always safe; only a lost reply is ambiguous, and it gets the one retry.

A batch (``acquire_many`` over keys on three shards) is grouped by node; every node's
commands are written before any reply is read, so its wall time is one round trip (the
slowest node's), not one per node. Results come back in the caller's order.
"""

from __future__ import annotations

import array
import contextlib
import logging
import random
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any, Protocol

from .._acquire import commands as transaction
from .._acquire import read as read_transaction
from .._acquire import refused_multi, warn_refused
from .._config import ServerConfig
from .._dialect import (
    COMMAND_PROBE,
    NODE_PROBE,
    UNDETECTED,
    ClusterDialect,
    Dialect,
    by_script,
    extend_command,
    info_fields,
    lacks_command,
    node_dialect,
    release_command,
)
from .._exchange import LOADS, After, Tries, after, lua_free_done
from .._ident import TOKEN_BYTES
from .._scripts import ACQUIRE, ACQUIRE_POLL, CONFIRMED, EXTEND, RELEASE_SHARDED, Script, held_value
from .._transient import resend_until
from ..errors import CacheError, LinkLost, ReplyError, Unreplicated, cache_error, unreplicated
from .wakeup import cluster_slot, wait

__all__ = [
    "MAP_ERRORS",
    "SLOTS",
    "ClusterBackend",
    "ClusterCore",
    "Link",
    "Route",
    "SlotMap",
    "acquired",
    "crc16",
    "endpoint",
    "key_slot",
    "needs_slots",
    "parse_shards",
    "parse_slots",
]

SLOTS = 16384
Address = tuple[str, int]

log = logging.getLogger("hotlock")


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


class Link(Protocol):
    """One primary, as a transport reaches it. ``link_send`` writes the commands (connecting,
    authenticating and loading the scripts first if needed) and returns a handle;
    ``link_recv`` reads that many replies from it, errors in place as ReplyError, all of them
    within ``timeout`` seconds when given. Both raise LinkLost on an I/O failure, after
    which the link reconnects on its next ``link_send``. ``link_drop`` lets go of the
    calling thread's connection (NOAUTH: the next one authenticates anew)."""

    def link_send(self, commands: list[tuple[bytes, ...]]) -> object: ...
    def link_recv(self, handle: object, n: int, timeout: float | None) -> list[Any]: ...
    def link_close(self) -> None: ...
    def link_drop(self) -> None: ...


# -- the slot map ---------------------------------------------------------------------


def _text(value: object) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


# What a node announces when it does not know the address clients should use for a node
# (cluster-preferred-endpoint-type unknown-endpoint, a hostname type with no hostname set, a
# node that never learnt its own IP): nil, "" or "?". It means the address the client asked
# (the Redis Cluster spec; redis-py does the same), as "MOVED 3999 :6381" does.
_UNKNOWN_ENDPOINTS = (None, b"", "", b"?", "?")


def endpoint(announced: object, asked: str) -> str:
    """The host to connect to for a node announced as ``announced`` by the node at ``asked``."""
    return asked if announced in _UNKNOWN_ENDPOINTS else _text(announced)


def parse_shards(reply: list[Any], tls: bool = False, asked: str = "") -> list[tuple[int, int, Address]]:
    """``CLUSTER SHARDS`` -> (first slot, last slot, primary) ranges; an unknown endpoint
    (endpoint()) is ``asked``, the host of the node that answered.

    A primary the answering node flags ``fail`` keeps its slots, as in CLUSTER SLOTS: a
    node clears that flag on a primary with slots only two node timeouts after setting it,
    so a replica frozen long enough to be flagged and then promoted is reported ``fail``
    while it serves. A primary that is really gone costs a refused (or timed-out) connect,
    after which the call asks another node for the map.

    Over TLS a node's address is its tls-port (a node may listen on both)."""
    return [
        (first, last, address)
        for slots, primaries in _shards(reply, tls, asked)
        for address in primaries
        for first, last in zip(slots[::2], slots[1::2], strict=True)
    ]


def _shards(reply: list[Any], tls: bool, asked: str = "") -> list[tuple[list[int], list[Address]]]:
    """Each shard of a ``CLUSTER SHARDS`` reply: its slot bounds and the nodes it lists as primary."""
    shards = []
    for shard in reply:
        fields = dict(zip(map(_text, shard[::2]), shard[1::2], strict=True))
        slots = [int(s) for s in fields.get("slots", [])]
        primaries = []
        for node in fields.get("nodes", []):
            info = dict(zip(map(_text, node[::2]), node[1::2], strict=True))
            if _text(info.get("role")) != "master":
                continue
            announced = info.get("endpoint")
            if announced in _UNKNOWN_ENDPOINTS and "endpoint" not in info:
                announced = info.get("ip")  # a server that lists no endpoint field
            host = endpoint(announced, asked)
            if tls and info.get("tls-port"):
                port = int(info["tls-port"])
            else:
                port = int(info.get("port") or info.get("tls-port") or 0)
            primaries.append((host, port))
        shards.append((slots, primaries))
    return shards


def needs_slots(reply: Any) -> bool:
    """Whether the map must come from ``CLUSTER SLOTS`` instead of this ``CLUSTER SHARDS``
    reply: SHARDS is an unknown command (Redis 6 and older), or a shard with slots lists
    more than one primary. Valkey keeps a node's shard id through a failover, so a primary
    that died and was replaced is listed as a second primary of its old shard (flagged
    ``fail`` or not yet) until it comes back as a replica: the shard's slots do not say
    which of the two serves them, and a map that gave them to the dead one (or counted it
    among the primaries connect() opens a link to) would fail every call there. SLOTS names
    each range's one owner."""
    if isinstance(reply, ReplyError):
        return True
    return any(slots and len(primaries) > 1 for slots, primaries in _shards(reply, False))


def parse_slots(reply: list[Any], asked: str = "") -> list[tuple[int, int, Address]]:
    """``CLUSTER SLOTS`` -> (first slot, last slot, primary) ranges (the first node is the
    primary); an unknown endpoint (endpoint()) is ``asked``, the host of the node that answered."""
    return [(int(r[0]), int(r[1]), (endpoint(r[2][0], asked), int(r[2][1]))) for r in reply]


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
        self.complete = False
        self.primaries: tuple[Address, ...] = ()
        # Told of every change (the native backend hands the extension its node table).
        self.watch: Callable[[SlotMap], None] | None = None

    def owner(self, slot: int) -> Address | None:
        return self._owner[slot]

    def node_table(self, numbers: dict[Address, int]) -> bytes:
        """The map as SLOTS native-endian uint16 node numbers, 0xFFFF for a slot with no
        primary; an address not in ``numbers`` is given the next number there."""
        table = array.array("H", [0xFFFF]) * SLOTS
        for slot, address in enumerate(self._owner):
            if address is not None:
                table[slot] = numbers.setdefault(address, len(numbers))
        return table.tobytes()

    def moved(self, slot: int, address: Address) -> None:
        # No watch call: a stale map turns the extension's fast path off until replace().
        self._owner[slot] = address
        self.stale = True

    def replace(self, ranges: list[tuple[int, int, Address]]) -> None:
        owner: list[Address | None] = [None] * SLOTS
        for first, last, address in ranges:
            owner[first : last + 1] = [address] * (last - first + 1)
        self._owner = owner
        self.primaries = tuple(sorted({a for _, _, a in ranges}))
        self.complete = None not in owner  # every slot has a primary: no call need look for holes
        self.stale = False
        self.refreshed = time.monotonic()
        if self.watch is not None:
            self.watch(self)


# -- one call's routing, without I/O ---------------------------------------------------

_REDIRECTS = 8  # MOVED/ASK hops per key one call follows before it calls the map broken
UNSERVED_REFRESH_S = 0.1  # how often a call for an unserved slot may ask for the map again


def acquired(result: int) -> bool:
    # The ACQUIRE script's result convention (hotlock._scripts.ACQUIRE): the fence, > 0.
    return result > 0


# The scripts whose call a node with compare-and-set takes as one plain command.
_LUA_FREE_SHAS = (EXTEND.sha, RELEASE_SHARDED.sha)
PROBE_RETRY_S = 5.0  # how often a refresh may ask again a primary whose dialect probe failed


def transaction_form(key: bytes, token: bytes, ms: bytes) -> tuple[bytes, ...]:
    """How an acquire sent as hotlock._acquire's transaction (four commands on the wire)
    is named in a round handed to Route (one entry per key: Route.handed): its replies
    are that key's four, in order."""
    return (b"MULTI", key, token, ms)


def script_form(command: tuple[bytes, ...]) -> tuple[bytes, ...]:
    """The script call a Lua-free extend or release, or a transaction acquire
    (transaction_form), stands for (any other command as it is): what Route sends the
    key by when the node is not to get that form."""
    if command[0] == b"MULTI":
        return (b"EVALSHA", ACQUIRE.sha, b"1", command[1], command[2], command[3])
    if command[0] == b"SET" and len(command) == 7 and command[3] == b"IFEQ":
        return (b"EVALSHA", EXTEND.sha, b"1", command[1], command[2], command[6])
    if command[0] == b"DELIFEQ":
        return (b"EVALSHA", RELEASE_SHARDED.sha, b"1", command[1], command[2])
    if command[0] == b"DELEX":
        return (b"EVALSHA", RELEASE_SHARDED.sha, b"1", command[1], command[3])
    return command


class Route:
    """One call's rules on a cluster, as a state machine with no I/O, so the sync and the
    async cluster backends share every rule and differ only in how they wait. The rules of
    one server (hotlock._exchange: Tries, after, lua_free_done, LOADS), per node and round,
    and the redirections.

    A round: ``batches()`` gives each node's commands (``ASKING`` before a key that was
    sent ASK, a WAIT after the acquires or extends under wait_replicas); the caller writes
    them all, then hands each node's outcome to ``replies()`` or ``lost()``; ``advance()``
    then says what is next: None (done: ``results``), or how long to sleep before the next
    round. It raises CacheError when the call has failed, after which the caller undoes
    the acquires in ``acquired_values()``, and Unreplicated when extends ran on a node
    whose WAIT fell short, after which the caller releases ``unconfirmed_values()``.
    Between rounds the caller drops the connections of ``reconnect`` nodes and, when
    ``refresh_avoiding`` is set, asks for the slot map.
    """

    def __init__(
        self,
        cluster: ClusterCore,
        what: str,
        keys: Sequence[bytes],
        commands: Sequence[tuple[bytes, ...]],
        retry_until: float | None,
        wait: bool,
        transaction: bool = True,
    ) -> None:
        self._cluster = cluster
        # False: an ACQUIRE goes as the script whatever the node takes (ACQUIRE_POLL).
        self._transaction = transaction
        self.what = what
        self.keys = keys
        # The script forms, always; a fast path may have sent some Lua-free, or as the
        # transaction acquire (see handed).
        self.commands = [script_form(c) for c in commands]
        self._txn = {i for i, c in enumerate(commands) if c[0] == b"MULTI"}  # sent as the transaction this round
        self._plain = {i for i, c in enumerate(commands) if c is not self.commands[i]} - self._txn  # Lua-free
        self._scripted: set[int] = set()  # keys that go by script from now on, whatever the node
        self._slots = [key_slot(k) for k in keys]  # hashed once per call
        self.results: list[Any] = [None] * len(keys)
        self._pending = list(range(len(keys)))
        self._asking: dict[int, Address] = {}
        self._resend = retry_until is not None  # whether the commands may be sent twice
        self._tries = Tries(what, cluster.timeout, time.monotonic, retry_until)
        self.override: float | None = None  # reply timeout of a resend after a lost reply
        self._redirects = 0
        self._transient_reply: tuple[str, bytes] | None = None  # the first, for the error
        self._wait = wait
        self.replicas: list[tuple[Address, int]] = []
        # Under wait_replicas, each key's confirmation: its node, and the replica count of
        # the WAIT behind the round that last sent it (a WAIT confirms the writes before it
        # on its connection, so a key resent elsewhere is confirmed by that node's WAIT).
        self._waited: dict[int, tuple[Address, int]] = {}
        self.unconfirmed: list[int] = []
        self._groups: dict[Address, list[int]] = {}
        self._again: list[int] = []
        self._later: list[int] = []
        self._lost: list[tuple[Address, list[int], BaseException]] = []
        self._error: tuple[str, bytes | None] | None = None
        # NOSCRIPT: the nodes whose next batch begins with LOADS, and those that took them.
        self._reload: set[Address] = set()
        self._reloaded: set[Address] = set()
        self._loading: set[Address] = set()  # this round's batches that begin with LOADS
        # Nodes whose connection the caller drops before the next round (NOAUTH/WRONGPASS).
        self.reconnect: set[Address] = set()
        self.refresh_avoiding: Address | None = None

    def unserved(self) -> bytes | None:
        """A pending key whose slot has no primary in the map (the caller refreshes once)."""
        owner = self._cluster.map.owner
        if self._cluster.map.complete:
            return None
        for i in self._pending:
            if i not in self._asking and owner(self._slots[i]) is None:
                return self.keys[i]
        return None

    def wait_for_primary(self) -> float:
        """A pending key's slot still has no primary in the map after a fresh look (its
        primary failed or handed over, the new one not yet in the map): the pause before
        looking again, within the call's budget, as after CLUSTERDOWN. CacheError when no
        time is left."""
        pause = self._tries.after_transient()
        if pause is None:
            raise cache_error(
                f"{self._tries.words()} failed: no primary serves the slot of the key (the cluster is incomplete)",
                self._cluster.server,
                self.unserved(),
            )
        return pause

    def batches(self) -> list[tuple[Address, list[tuple[bytes, ...]]]]:
        groups: dict[Address, list[int]] = {}
        for i in self._pending:
            address = self._asking.get(i) or self._cluster.map.owner(self._slots[i])
            if address is None:
                raise cache_error(
                    "no primary serves the slot of the key (the cluster is incomplete)",
                    self._cluster.server,
                    self.keys[i],
                )
            groups.setdefault(address, []).append(i)
        self._groups = groups
        self._pending = []
        out = []
        self._plain.clear()
        self._txn.clear()
        self._loading = self._reload & groups.keys()
        for address, idxs in groups.items():
            # After NOSCRIPT there: every script, in the same write as what did not run.
            batch: list[tuple[bytes, ...]] = list(LOADS) if address in self._loading else []
            for i in idxs:
                command = self.commands[i]
                if i in self._asking:
                    # ASKING covers the one command after it: an acquire goes by script.
                    batch.append((b"ASKING",))
                elif self._transaction and i not in self._scripted and self._cluster.transacts(address, command):
                    batch.extend(transaction(command[3], command[4], int(command[5])))
                    self._txn.add(i)
                    continue
                if i not in self._scripted:
                    command = self._cluster.sent_form(address, command)
                    if command is not self.commands[i]:
                        self._plain.add(i)
                batch.append(command)
            if self._wait:
                batch.append(self._cluster.wait_command)
            out.append((address, batch))
        return out

    def handed(self, first: tuple[dict[Address, list[int]], list[tuple[Address, Any]]]) -> None:
        """The first round, already sent by the extension's fast path: which keys went to
        which node, and each node's replies or the exception that lost them."""
        self._groups, outcomes = first
        self._pending = []
        for address, outcome in outcomes:
            if isinstance(outcome, BaseException):
                self.lost(address, outcome)
            else:
                self.replies(address, outcome)

    def lost(self, address: Address, exc: BaseException) -> None:
        self._lost.append((address, self._groups[address], exc))

    def replies(self, address: Address, replies: list[Any]) -> None:
        if address in self._loading:
            loads, replies = replies[: len(LOADS)], replies[len(LOADS) :]
            refused = next((r for r in loads if isinstance(r, ReplyError)), None)
            if refused is not None:
                self._fail(f"{self.what} failed: SCRIPT LOAD: the server replied {refused}", None)
                return
            self._reload.discard(address)
            self._reloaded.add(address)
        if self._wait:
            reply = replies.pop()
            if isinstance(reply, ReplyError):
                self._fail(f"WAIT on {address[0]}:{address[1]}: the server replied {reply}", None)
            else:
                self.replicas.append((address, int(reply)))
                for i in self._groups[address]:
                    self._waited[i] = (address, int(reply))
        j = 0
        for i in self._groups[address]:
            asked = i in self._asking
            if asked:
                j += 1  # ASKING's +OK
                del self._asking[i]
            if i in self._txn:
                four = replies[j : j + 4]
                j += 4
                reply = self._transaction_reply(address, i, four)
                if reply is None:
                    continue
            else:
                reply = replies[j]
                j += 1
            if i in self._plain and self._lua_free_reply(address, i, reply):
                continue
            if not isinstance(reply, ReplyError):
                self.results[i] = reply
                continue
            code = reply.code
            then = after(reply)
            if then is After.REDIRECT:
                self._redirects += 1
                _, slot, target = str(reply).split(" ")
                host, _, port = target.rpartition(":")
                to = (endpoint(host, address[0]), int(port))
                if code == "MOVED":
                    self._cluster.map.moved(int(slot), to)
                elif asked:
                    # An ASK answered with ASK: the migration is confused; do not loop.
                    self._fail(f"{self.what} failed: the server replied {reply} after ASKING", self.keys[i])
                    continue
                else:
                    self._asking[i] = to
                if self._redirects > _REDIRECTS * len(self.keys):
                    self._fail(f"{self.what} failed: redirected {self._redirects} times ({reply})", self.keys[i])
                self._again.append(i)
            elif then is After.PAUSE:
                # The command did not run (hotlock._transient): again after a pause.
                self._later.append(i)
                if self._transient_reply is None:
                    self._transient_reply = (str(reply), self.keys[i])
                if code in ("CLUSTERDOWN", "READONLY", "MASTERDOWN"):
                    # An election, or a demoted primary: look at the map again.
                    self._cluster.map.stale = True
            elif then is After.REAUTH and address not in self._tries.reauthed:
                # That node's connection is not authenticated (rotated credentials, a
                # re-sent AUTH refused): the caller drops it (link_drop) and the new one
                # asks the credential provider again; once per node and call.
                self.reconnect.add(address)
                self._again.append(i)
            elif then is After.RELOAD and address not in self._reloaded:
                # Restart, SCRIPT FLUSH, failover: every script loaded there (once per
                # call), in the same write as what did not run.
                self._reload.add(address)
                self._again.append(i)
            else:
                self._fail(f"{self.what} failed: the server replied {reply}", self.keys[i])

    def _transaction_reply(self, address: Address, i: int, replies: list[Any]) -> Any:
        """A transaction acquire's four replies (hotlock._acquire.read): None when dealt
        with here (the fence, or the key to go again by script, to this node or to the
        next one a redirection names), else the error reply to handle as a script's
        (MOVED on the queued SET, with EXEC's EXECABORT after it, is MOVED)."""
        if refused_multi(replies, ReplyError):
            self._cluster.refuse_multi(address, str(replies[0]))
        outcome = read_transaction(replies, ReplyError)
        if isinstance(outcome, BaseException):
            return outcome
        if acquired(outcome):
            self.results[i] = outcome
        else:
            # SCRIPT: held, ours after a lost reply, permits; or MULTI refused. The script
            # decides, and its reply is the result.
            self._scripted.add(i)
            self._again.append(i)
        return None

    def _lua_free_reply(self, address: Address, i: int, reply: Any) -> bool:
        """A Lua-free extend's or release's reply: True when it is dealt with here (the
        result, or the key to go again by script); False for the rules every command
        follows (MOVED, ASK...: the next node decides the form again)."""
        if isinstance(reply, ReplyError) and lacks_command(str(reply)):
            # The node no longer has the command (downgraded or renamed in place): this key
            # by script, with the same value, and every later call on that node.
            self._cluster.downgrade(address, str(reply))
        else:
            done = lua_free_done(reply)
            if done is None:
                return False
            if done:
                self.results[i] = 1
                return True
        # Missed (the script announces the release by SPUBLISH, on the lock's own shard).
        self._scripted.add(i)
        self._again.append(i)
        return True

    def _fail(self, text: str, key: bytes | None) -> None:
        if self._error is None:
            self._error = (text, key)

    def advance(self) -> float | None:
        """None when every command has its reply; else the pause before the next round.
        Raises CacheError when the call has failed."""
        server = self._cluster.server
        if self._error is not None:
            raise cache_error(self._error[0], server, self._error[1])
        again, self._again = self._again, []
        self._tries.reauthed |= self.reconnect
        pause = 0.0
        if self._lost:
            where, first, cause = self._lost[0]
            # Whatever happens next, the next call asks for the map first: the node may be
            # gone for good (a killed primary whose replica takes over).
            self._cluster.map.stale = True
            # The one resend, after the caller has asked another node for the map: of any
            # command (an extend, a set_nx) when the nodes could not even be connected to
            # (nothing ran), else only of one that may be sent twice, with the same tokens.
            if all(isinstance(exc, CacheError) for _, _, exc in self._lost):
                limit = self._tries.after_unsent()
            else:
                limit = self._tries.after_lost(self._resend)
            if limit is None:
                raise cache_error(
                    f"{self._tries.words()} failed on {where[0]}:{where[1]}: {cause}",
                    server,
                    self.keys[first[0]] if len(self.keys) == 1 else None,
                ) from cause
            self.override = limit
            self.refresh_avoiding = where
            for _, idxs, _ in self._lost:
                again.extend(idxs)
            self._lost = []
        if self._later:
            transient = self._tries.after_transient()
            if transient is None:
                assert self._transient_reply is not None
                text, key = self._transient_reply
                raise cache_error(
                    f"{self._tries.words()} failed: the server replied {text}",
                    server,
                    key,
                )
            pause = max(pause, transient)
            self._transient_reply = None
            again.extend(self._later)
            self._later = []
        self._pending = sorted(again)
        if not self._pending:
            if self._wait and self.commands and self.commands[0][1] == EXTEND.sha:
                self._confirm_extends()
            elif self._wait:
                short = [(a, r) for a, r in self.replicas if r < self._cluster.wait_replicas]
                if short:
                    (host, port), got = short[0]
                    raise cache_error(
                        unreplicated(
                            self.what, got, self._cluster.wait_replicas, self._cluster.wait_ms, f" of {host}:{port}"
                        ),
                        server,
                        self.keys[0] if len(self.keys) == 1 else None,
                    )
            return None
        return pause

    def _confirm_extends(self) -> None:
        """Under wait_replicas: Unreplicated if an extend ran (1) on a node whose WAIT fell
        short; the extends on the other nodes stand."""
        wanted, ms = self._cluster.wait_replicas, self._cluster.wait_ms
        why: dict[int, str] = {}
        for i, (address, got) in self._waited.items():
            if got < wanted and self.results[i] == 1:
                text = unreplicated(self.what, got, wanted, ms, f" of {address[0]}:{address[1]}")
                why[i] = f"is lost: {text}"
        if why:
            self.unconfirmed = sorted(why)
            raise Unreplicated([r == 1 and i not in why for i, r in enumerate(self.results)], why)

    def unconfirmed_values(self) -> tuple[list[bytes], list[bytes]]:
        """The keys whose extends too few replicas confirmed, and their held values, to release."""
        return [self.keys[i] for i in self.unconfirmed], [self.commands[i][4] for i in self.unconfirmed]

    def acquired_values(self) -> tuple[list[bytes], list[bytes]]:
        """The keys this call acquired and their held values (token + fence), to undo."""
        held = [
            (k, held_value(c[4], r))
            for k, c, r in zip(self.keys, self.commands, self.results, strict=True)
            if c[1] == ACQUIRE.sha and isinstance(r, int) and acquired(r)
        ]
        return [k for k, _ in held], [v for _, v in held]


class ClusterCore:
    """What the sync and async cluster backends share: the settings, the slot map, the
    commands each Backend method sends, and the INFO summary."""

    def __init__(self, config: ServerConfig, name: str) -> None:
        self.name = name
        self.server = config.display
        self.config = config
        self.timeout = config.timeout
        self.wait_replicas = config.wait_replicas
        self.wait_ms = round(config.wait_timeout * 1000)
        self.wait_command = (b"WAIT", b"%d" % self.wait_replicas, b"%d" % self.wait_ms)
        self.map = SlotMap()
        self._connected = UNDETECTED  # what connect() detected from the first primary's INFO
        self.fenced = True
        # "auto" or "always" once connect() has told use_dialect; until then every node
        # keeps the scripts, which every server runs.
        self._policy: str | None = None
        self._nodes: dict[Address, Dialect] = {}  # each primary's own (read without a lock)
        self._probes: dict[Address, tuple[Any, Any]] = {}  # info()'s NODE_PROBE replies, for use_dialect
        self._unprobed: dict[Address, float] = {}  # a primary whose probe failed: when
        # Primaries that refused MULTI alone (an ACL, a proxy): their acquires go by script.
        self._no_multi: set[Address] = set()

    @property
    def dialect(self) -> Dialect:
        """cache.server_info: the primaries' dialects summed up, and each under "nodes"."""
        nodes = {f"{h}:{p}": self.node_dialect((h, p)) for h, p in self.map.primaries}
        return ClusterDialect.of(self._connected, nodes)

    def node_dialect(self, address: Address) -> Dialect:
        return self._nodes.get(address, UNDETECTED)

    def use_dialect(self, dialect: Dialect) -> None:
        """connect()'s decision says only whether scripts="always" (every node keeps the
        scripts); with "auto" each primary gets the dialect its own probe shows."""
        self._connected = dialect
        self.fenced = dialect.fenced
        self._policy = "always" if dialect.forced else "auto"
        probes, self._probes = self._probes, {}
        for address, (info, commands) in probes.items():
            self.probed(address, info, commands)

    def probed(self, address: Address, info: Any, commands: Any) -> None:
        """A primary's replies to INFO and COMMAND INFO DELIFEQ DELEX (ReplyError: refused)."""
        if self._policy is None:
            self._probes[address] = (info, commands)  # connect() has not decided yet
            return
        self._unprobed.pop(address, None)
        self.set_node(address, node_dialect(info, commands, self._policy, ReplyError))

    def unprobed(self, address: Address) -> None:
        self._unprobed[address] = time.monotonic()

    def set_node(self, address: Address, dialect: Dialect) -> None:
        self._nodes[address] = dialect

    def to_probe(self, before: tuple[Address, ...]) -> list[Address]:
        """After a map refresh, the primaries to ask for their dialect: one the map did not
        have a moment ago (new, at a new address, or back after a failover: it may have
        been upgraded meanwhile), or whose last probe failed (at most every PROBE_RETRY_S)."""
        if self._policy is None:
            return []
        now = time.monotonic()
        return [
            a
            for a in self.map.primaries
            if a not in before
            or (a not in self._nodes and now - self._unprobed.get(a, now - PROBE_RETRY_S) >= PROBE_RETRY_S)
        ]

    def downgrade(self, address: Address, error: str) -> None:
        """The node refused a Lua-free command as unknown: the scripts there from now on."""
        old = self._nodes.get(address)
        if old is None or not old.lua_free:
            return
        reason = f"{error.split(',')[0]}: downgraded in place, extend/release by script"
        self.set_node(address, Dialect(old.kind, old.version, "script", reason))
        log.warning(
            "%s:%d refused a Lua-free extend/release (%s): extend and release on it go by script from now on",
            *address,
            error,
        )

    def transacts(self, address: Address, command: tuple[bytes, ...]) -> bool:
        """Whether ``command`` (a script call) goes to ``address`` as hotlock._acquire's
        transaction: an ACQUIRE (not its waiting forms) of a plain lock (a permit's ask,
        token '#' limit, goes by script), not under connect(scripts='always'), and not to
        a node that refused MULTI."""
        return (
            command[0] == b"EVALSHA"
            and command[1] == ACQUIRE.sha
            and len(command[4]) == TOKEN_BYTES
            and self.transacts_any()
            and address not in self._no_multi
        )

    def transacts_any(self) -> bool:
        """Whether the acquire goes as the transaction on the nodes that did not refuse
        MULTI (connect() chose "auto")."""
        return self._policy == "auto"

    def refuse_multi(self, address: Address, error: str) -> None:
        """The node refused MULTI alone (its SET ran on its own): acquires on it by script
        from now on."""
        if address in self._no_multi:
            return
        self._no_multi.add(address)
        warn_refused(f"{address[0]}:{address[1]}", error)

    def sent_form(self, address: Address, command: tuple[bytes, ...]) -> tuple[bytes, ...]:
        """What goes to ``address`` for ``command`` (a script call): an extend's or a
        release's Lua-free form where that node has it, else ``command`` itself."""
        if command[0] != b"EVALSHA" or command[1] not in _LUA_FREE_SHAS:
            return command
        dialect = self._nodes.get(address)
        if dialect is None or not dialect.lua_free or by_script((command[4],)):
            return command
        if command[1] == EXTEND.sha:
            return extend_command(command[3], command[4], int(command[5]))
        return release_command(dialect, command[3], command[4])

    def primaries(self) -> tuple[Address, ...]:
        """Every primary in the slot map now (for a caller that must visit each one)."""
        return self.map.primaries

    def slot_owner(self, key: bytes) -> Address | None:
        return self.map.owner(key_slot(key))

    def map_candidates(self, avoid: Address | None) -> list[Address]:
        """The nodes to ask for the slot map, in order: the known primaries (shuffled, to
        spread many clients' queries), then the seeds; ``avoid`` last."""
        candidates = list(self.map.primaries)
        random.shuffle(candidates)
        candidates += [s for s in self.config.seeds if s not in candidates]
        if avoid in candidates:
            candidates.remove(avoid)
            candidates.append(avoid)
        return candidates

    def no_map(self, errors: list[str]) -> CacheError:
        return cache_error(f"no cluster node gave the slot map ({'; '.join(errors)})", self.server)

    def took_map(
        self, address: Address, found: list[tuple[int, int, Address]] | BaseException, errors: list[str]
    ) -> list[Address] | None:
        """refresh()'s step at one node: its answer (``found``: map_ranges's, or the failure,
        one of MAP_ERRORS) made the slot map, and the primaries to probe returned (to_probe);
        or None, why not noted in ``errors``, and the next node is asked."""
        if isinstance(found, BaseException):
            errors.append(f"{address[0]}:{address[1]}: {found or type(found).__name__}")
            return None
        if not found:
            errors.append(f"{address[0]}:{address[1]}: no slots assigned")
            return None
        before = self.map.primaries
        with self.map.mutex:
            self.map.replace(found)
        return self.to_probe(before)

    def look_again(self, route: Route) -> bool:
        """Before a round: whether to ask for the map again because a slot had no primary
        when last looked (its primary failed, its replica not yet promoted); not on every
        call of the gap, at most every UNSERVED_REFRESH_S."""
        return route.unserved() is not None and time.monotonic() - self.map.refreshed >= UNSERVED_REFRESH_S

    def retry_until(self, wait_ms: int = 0, since: float | None = None) -> float:
        """As in every backend (hotlock._transient.resend_until), from ``since`` (on
        time.monotonic; None: now)."""
        return resend_until(time.monotonic() if since is None else since, wait_ms / 1000.0, self.timeout)

    def route(
        self,
        what: str,
        script: Script,
        keys: Sequence[bytes],
        args: Sequence[tuple[bytes, ...]],
        retry_until: float | None,
    ) -> Route:
        commands = [(b"EVALSHA", script.sha, b"1", k, *a) for k, a in zip(keys, args, strict=True)]
        # ACQUIRE_POLL: the same script, never the transaction (a key found held a moment
        # ago is likely held still).
        return Route(self, what, keys, commands, retry_until, self.confirms(script), script is not ACQUIRE_POLL)

    def confirms(self, script: Script) -> bool:
        """Whether WAIT rides behind ``script``'s calls: under wait_replicas, the acquires
        (every form) and the extends."""
        return self.wait_replicas > 0 and script in CONFIRMED

    def info_summary(self, replies: list[tuple[Address, Any]]) -> dict[str, str] | None:
        """The first primary's INFO, plus ``cluster_primaries`` and, per primary with an
        evicting policy, ``maxmemory_policy@host:port`` (connect() warns about each)."""
        merged: dict[str, str] | None = None
        for address, reply in replies:
            if isinstance(reply, ReplyError):
                if reply.code == "NOPERM":
                    return None
                raise cache_error(f"INFO failed: the server replied {reply}", self.server)
            fields = info_fields(reply)
            if merged is None:
                merged = dict(fields)
                merged["maxmemory_policy"] = "noeviction"
            policy = fields.get("maxmemory_policy", "noeviction")
            if policy != "noeviction":
                merged[f"maxmemory_policy@{address[0]}:{address[1]}"] = policy
        merged = merged or {}
        merged["cluster_primaries"] = str(len(self.map.primaries))
        return merged


def map_ranges(
    reply: Any, fallback: Callable[[], Any], tls: bool = False, asked: str = ""
) -> list[tuple[int, int, Address]]:
    """The ranges of a CLUSTER SHARDS reply, or of CLUSTER SLOTS (``fallback()``) where
    SHARDS cannot say (``needs_slots``), as told by the node at host ``asked``."""
    if needs_slots(reply):
        slots = fallback()
        if isinstance(slots, ReplyError):
            raise slots
        return parse_slots(slots, asked)
    return parse_shards(reply, tls, asked)


MAP_ERRORS = (LinkLost, ReplyError, CacheError, ValueError, IndexError, TypeError, KeyError)


class ClusterBackend(ClusterCore):
    """The Backend protocol on a Redis Cluster, over any transport's links.

    ``open_link(config)`` makes the link of one node (``config`` is the cluster's own,
    pointed at that node by ServerConfig.node). The transport's name ("native",
    "redis-py") is the backend's; ``server`` shows the cluster's seeds.
    """

    def __init__(
        self,
        config: ServerConfig,
        name: str,
        open_link: Callable[[ServerConfig], Link],
        router: Callable[[ClusterBackend, SlotMap], Any] | None = None,
    ) -> None:
        super().__init__(config, name)
        self._open_link = open_link
        self._links: dict[Address, Link] = {}
        self._links_mutex = threading.Lock()
        # The native transport's fast path (hotlock._native.ClusterRouter): the healthy
        # case of a call routed in C over these same links, everything else handed back
        # to Route through routed(). Not under wait_replicas: the WAIT stays Route's.
        self._router = None if router is None or config.wait_replicas else router(self, self.map)
        self._numbers: dict[Address, int] = {}  # the router's node number of each address
        if self._router is not None:
            self.map.watch = self._mapped
        # The wake-up subscribers (hotlock.backends.wakeup.ClusterWakeups: sharded pub/sub, one per
        # primary), made on the first long lock_wait.
        self._wakeups = cluster_slot(config, self.slot_owner)
        # Connect now: a cluster none of whose seeds answers is a CacheError at connect().
        self.refresh()
        for address in self.map.primaries:
            self._link(address)

    # -- topology ---------------------------------------------------------------------

    def refresh(self, avoid: Address | None = None) -> None:
        """Ask one node after another for the slot map; CacheError when none answers."""
        errors: list[str] = []
        for address in self.map_candidates(avoid):
            found: list[tuple[int, int, Address]] | BaseException
            try:
                link = self._link(address)
                found = map_ranges(
                    self._call(link, [(b"CLUSTER", b"SHARDS")])[0],
                    lambda link=link: self._call(link, [(b"CLUSTER", b"SLOTS")])[0],  # type: ignore[misc]
                    self.config.tls,
                    address[0],
                )
            except MAP_ERRORS as exc:
                found = exc
            probe = self.took_map(address, found, errors)
            if probe is not None:
                for new in probe:
                    self._probe(new)
                return
        raise self.no_map(errors)

    def _probe(self, address: Address) -> None:
        # A failed probe leaves the node as it was (a new one on the scripts): no call fails for it.
        try:
            info, commands = self._call(self._link(address), list(NODE_PROBE))
        except (LinkLost, CacheError):
            self.unprobed(address)
        else:
            self.probed(address, info, commands)

    def use_dialect(self, dialect: Dialect) -> None:
        super().use_dialect(dialect)
        if self._router is not None:
            self._router.set_transactions(self.transacts_any())

    def refuse_multi(self, address: Address, error: str) -> None:
        super().refuse_multi(address, error)
        if self._router is not None:
            with self._links_mutex:
                number = self._numbers.setdefault(address, len(self._numbers))
            self._router.refuse_multi(number)

    def set_node(self, address: Address, dialect: Dialect) -> None:
        super().set_node(address, dialect)
        # The native link keeps it too: the extension's fast path reads each link's own.
        use = getattr(self._links.get(address), "use_dialect", None)
        if use is not None:
            use(dialect)

    @staticmethod
    def _call(link: Link, commands: list[tuple[bytes, ...]], timeout: float | None = None) -> list[Any]:
        return link.link_recv(link.link_send(commands), len(commands), timeout)

    def _link(self, address: Address) -> Link:
        link = self._links.get(address)
        if link is None:
            with self._links_mutex:
                link = self._links.get(address)
                if link is None:
                    link = self._open_link(self.config.node(*address))
                    self._links[address] = link
                    if self._router is not None:
                        self._router.set_link(self._numbers.setdefault(address, len(self._numbers)), link)
        return link

    def _mapped(self, slot_map: SlotMap) -> None:
        # Each address keeps the node number it first got, so the router's links stay put.
        assert self._router is not None
        with self._links_mutex:
            table = slot_map.node_table(self._numbers)
            links = [self._links.get(a) for a in self._numbers]
            self._router.set_map(table, list(self._numbers), links)

    def taker(self, lock_prefix: bytes, lease_class: type) -> object:
        """Cache.lock's one-call path (hotlock._native), when the extension routes here."""
        return None if self._router is None else self._router.taker(lock_prefix, lease_class)

    def routed(
        self,
        what: str,
        keys: list[bytes],
        commands: list[tuple[bytes, ...]],
        retry_until: float | None,
        first: tuple[dict[Address, list[int]], list[tuple[Address, Any]]] | None,
        transaction: bool = True,
    ) -> list[Any]:
        """A call the extension's fast path did not finish, under Route's rules: from the
        start (``first`` None: a stale map, a slot or node it does not know), or after the
        first round it sent (a redirection, an error reply, a lost reply: the same
        commands, the same tokens, the one lost-reply retry still Route's to spend).
        ``transaction`` False: an ACQUIRE goes on as the script (Route)."""
        return self._run(Route(self, what, keys, commands, retry_until, False, transaction), first)

    # -- routing ------------------------------------------------------------------------

    def _run(
        self, route: Route, first: tuple[dict[Address, list[int]], list[tuple[Address, Any]]] | None = None
    ) -> list[Any]:
        """Send every node's commands, all written before any is read, round after round
        until ``route`` has every reply; on failure undo its acquires, raise CacheError.
        ``first``: the first round's outcome, when the extension sent it (see routed)."""
        try:
            while True:
                if first is not None:
                    route.handed(first)
                    first = None
                elif not self._served(route):
                    continue
                else:
                    sent = []
                    for address, batch in route.batches():
                        try:
                            link = self._link(address)
                            sent.append((address, link, link.link_send(batch), len(batch)))
                        except (LinkLost, CacheError) as exc:
                            route.lost(address, exc)
                    for address, link, handle, count in sent:
                        try:
                            route.replies(address, link.link_recv(handle, count, route.override))
                        except LinkLost as exc:
                            route.lost(address, exc)
                pause = route.advance()
                if pause is None:
                    return route.results
                for address in route.reconnect:
                    self._link(address).link_drop()
                route.reconnect.clear()
                if route.refresh_avoiding is not None:
                    self._look(route.refresh_avoiding)
                    route.refresh_avoiding = None
                if pause:
                    time.sleep(pause)
        except CacheError:
            # No key stranded until its TTL: what this call did acquire is released.
            keys, values = route.acquired_values()
            if keys:
                with contextlib.suppress(CacheError):
                    self.release_many(keys, values)
            raise
        except Unreplicated:
            # Extends too few replicas confirmed: released, as an unconfirmed acquire is.
            keys, values = route.unconfirmed_values()
            with contextlib.suppress(CacheError):
                self.release_many(keys, values)
            raise

    def _served(self, route: Route) -> bool:
        """Before a round: the map asked again where due; False, after a pause, while a slot
        of the round still has no primary (the caller looks again)."""
        if self.map.stale:
            self._look()
        if self.look_again(route):
            self._look()
        if route.unserved() is not None:
            time.sleep(route.wait_for_primary())
            return False
        return True

    def _look(self, avoid: Address | None = None) -> None:
        """refresh(), its failure ignored: the slots learnt from MOVED are kept if no node
        answers for the whole map."""
        with contextlib.suppress(CacheError):
            self.refresh(avoid)

    def _many(
        self, what: str, script: Script, keys: list[bytes], tokens: list[bytes], ms: int, until: float | None
    ) -> list[Any]:
        """A batch of one script (ms -1: no TTL argument); with the extension, grouped by
        node and sent from C, what it cannot finish handed back through routed()."""
        if self._router is not None:
            return self._router.many(what, script.sha, keys, tokens, ms, until)  # type: ignore[no-any-return]
        return self._run(self.route(what, script, keys, [(t,) if ms < 0 else (t, b"%d" % ms) for t in tokens], until))

    def _one(self, what: str, script: Script, key: bytes, token: bytes, ms: int, until: float | None) -> Any:
        """One key's script (ms -1: no TTL argument), on the extension's fast path when it
        routes here."""
        if self._router is not None:
            return self._router.script(what, script.sha, key, token, ms, until, script is not ACQUIRE_POLL)
        return self._run(self.route(what, script, [key], [(token,) if ms < 0 else (token, b"%d" % ms)], until))[0]

    # -- the Backend interface --------------------------------------------------------

    def acquire(self, key: bytes, token: bytes, ttl_ms: int) -> int:
        return int(self._one("acquire", ACQUIRE, key, token, ttl_ms, self.retry_until()))

    def acquire_wait(self, key: bytes, token: bytes, ttl_ms: int, wait_ms: int) -> tuple[int, float, int]:
        until = self.retry_until(wait_ms)
        return wait(self._wakeups, key, lambda s: int(self._one("acquire", s, key, token, ttl_ms, until)), wait_ms)

    def acquire_many(self, keys: list[bytes], tokens: list[bytes], ttl_ms: int) -> list[int]:
        return [int(r) for r in self._many("acquire_many", ACQUIRE, keys, tokens, ttl_ms, self.retry_until())]

    def extend(self, key: bytes, token: bytes, ttl_ms: int) -> bool:
        # No retry: a lost extend reply is a CacheError; the caller retries while valid_for() lasts.
        return bool(self._one("extend", EXTEND, key, token, ttl_ms, None))

    def extend_many(self, keys: list[bytes], tokens: list[bytes], ttl_ms: int) -> list[bool]:
        return [bool(r) for r in self._many("extend_many", EXTEND, keys, tokens, ttl_ms, None)]

    def release(self, key: bytes, token: bytes) -> bool:
        # RELEASE_SHARDED: a waiter's mark is announced by SPUBLISH, on the lock's own shard.
        return bool(self._one("release", RELEASE_SHARDED, key, token, -1, self.retry_until()))

    def release_many(self, keys: list[bytes], tokens: list[bytes]) -> list[bool]:
        return [bool(r) for r in self._many("release_many", RELEASE_SHARDED, keys, tokens, -1, self.retry_until())]

    def set_nx(self, key: bytes, value: bytes, ttl_ms: int) -> bool:
        # Never resent after a lost reply (not safe twice), as on one server.
        if self._router is not None:
            return self._router.set_nx(key, value, ttl_ms) is not None
        command = (b"SET", key, value, b"NX", b"PX", b"%d" % ttl_ms)
        return self._run(Route(self, "set_nx", [key], [command], None, False))[0] is not None

    def incr(self, key: bytes, amount: int) -> int:
        if self._router is not None:
            return int(self._router.incr(key, amount))
        return int(self._run(Route(self, "incr", [key], [(b"INCRBY", key, b"%d" % amount)], None, False))[0])

    def command_info(self) -> list[object] | None:
        return None  # each primary was asked with its INFO (info()); use_dialect decides per node

    def info(self) -> dict[str, str] | None:
        replies = []
        for address in self.map.primaries:
            try:
                info, commands = self._call(self._link(address), [(b"INFO",), COMMAND_PROBE])
            except LinkLost as exc:
                raise cache_error(f"INFO on {address[0]}:{address[1]} failed: {exc}", self.server) from exc
            replies.append((address, info))
            self.probed(address, info, commands)
        return self.info_summary(replies)

    def close(self) -> None:
        if self._wakeups is not None:
            self._wakeups.close()
        with self._links_mutex:
            links = list(self._links.values())
        for link in links:
            link.link_close()
