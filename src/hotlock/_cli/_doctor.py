"""`hotlock doctor`: the operator checklist (docs/operations.md), run against the server.

Each check gives ok, warn or fail, what it found and, unless ok, what to do. The ACL check
sends every command the library sends on scratch keys under the prefix
(``<prefix>doctor:{<random>}:…``, each with a TTL, deleted at the end), never on a lock.
"""

from __future__ import annotations

import contextlib
import logging
import re
import secrets
import statistics
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any

import redis

from .._dialect import COMMAND_PROBE, commands_from, detect, kind_and_version
from .._keys import LOCK_SPACE, WAKE_SPACE
from .._scripts import ACQUIRE, EXTEND, RELEASE, SCRIPTS, Script, held_value
from ..backends.native import backend_info
from ..errors import HotlockError, LockNotAcquired
from ._target import Node, Target, glob_escape

if TYPE_CHECKING:
    from .. import Cache

    # hotlock.connect, as the command hands it down (its keyword arguments).
    Connect = Callable[..., Cache]

__all__ = ["Check", "run_checks"]

OK, WARN, FAIL = "ok", "warn", "fail"
PING_SAMPLES = 200
SCRATCH_TTL_MS = 10_000  # a scratch key left behind by a crash expires by itself
_POLICY_OK = "noeviction"


@dataclass
class Check:
    check: str
    status: str  # ok, warn or fail
    detail: str
    advice: str | None = None

    def as_json(self) -> dict[str, Any]:
        return asdict(self)


def _raw(client: Any, *args: Any) -> Any:
    """A command whose reply redis-py would mis-parse (COMMAND INFO of an unknown command),
    sent and read on one pooled connection without redis-py's reply callbacks."""
    pool = client.connection_pool
    conn = pool.get_connection()
    try:
        conn.send_command(*args)
        return conn.read_response()
    finally:
        pool.release(conn)


def _info(client: Any, section: str) -> dict[str, Any] | None:
    try:
        return dict(client.info(section))
    except redis.ResponseError as exc:
        if isinstance(exc, redis.exceptions.NoPermissionError):
            return None
        raise


def _config(client: Any, name: str) -> str | None:
    try:
        value = client.config_get(name).get(name)
    except redis.ResponseError:
        return None  # refused (ACL, or a managed service that renames CONFIG)
    return None if value is None else str(value)


def _version(text: str) -> tuple[int, ...]:
    return tuple(int(p) for p in re.findall(r"\d+", text)[:3])


# -- server, dialect -----------------------------------------------------------------


def server_kind(info: dict[str, Any]) -> tuple[str, str]:
    """("Redis" or "Valkey", its version) from INFO server, by the library's own reading
    (hotlock._dialect.kind_and_version: Valkey 8+ keeps redis_version at 7.2.4 for old
    clients, so that one is never trusted on Valkey)."""
    kind, version = kind_and_version({str(k): str(v) for k, v in info.items()})
    return _KIND_NAMES.get(kind, "unknown server"), version or "?"


_KIND_NAMES = {"redis": "Redis", "valkey": "Valkey"}


def check_server(target: Target) -> list[Check]:
    seen = []
    for node in target.nodes:
        info = _info(node.client, "server")
        if info is None:
            return [
                Check(
                    "server",
                    WARN,
                    f"INFO is refused by the ACL on {node.address}: server kind and version unknown",
                    "grant +info (the library tolerates a refused INFO, but skips its eviction warning)",
                )
            ]
        kind, version = server_kind(info)
        seen.append((kind, version, str(info.get("redis_mode", "standalone")), node.address))
    kinds = sorted({f"{k} {v}" for k, v, _, _ in seen})
    mode = seen[0][2]
    old = [(k, v, a) for k, v, _, a in seen if k == "Redis" and _version(v) < (6, 2)]
    detail = f"{', '.join(kinds)} ({mode} mode) at {target.display}"
    if old:
        _, v, a = old[0]
        return [Check("server", FAIL, f"{detail}: {a} runs Redis {v}", "hotlock needs Redis 6.2 or later, or Valkey")]
    if target.kind != "cluster" and mode == "cluster":
        return [
            Check(
                "server",
                FAIL,
                f"{detail}: a cluster node reached with a single-server url",
                "use redis+cluster://host:port,... so every key goes to the shard that owns it",
            )
        ]
    return [Check("server", OK, detail)]


def check_dialect(target: Target) -> list[Check]:
    """The Lua-free path (docs/architecture.md): what connect() would choose on each primary, by the
    library's own rule (hotlock._dialect.detect over INFO and COMMAND INFO DELIFEQ DELEX)."""
    found: dict[str, list[str]] = {}
    for node in target.nodes:
        try:
            commands = commands_from(_raw(node.client, *COMMAND_PROBE))
        except redis.ResponseError:
            commands = None  # COMMAND refused: detect goes by the version
        info = _info(node.client, "server")
        dialect = detect(None if info is None else {str(k): str(v) for k, v in info.items()}, commands, "auto")
        if dialect.lua_free:
            how = f"the server offers SET IFEQ and {dialect.release}: extend and release can run without Lua"
        elif dialect.kind == "unknown":
            how = "INFO is refused: the server's kind is unknown, so extend and release run as Lua scripts (EVALSHA)"
        else:
            how = (
                "no SET IFEQ/DELIFEQ/DELEX here (Valkey 9+, Redis 8.4+): "
                "extend and release run as Lua scripts (EVALSHA)"
            )
        found.setdefault(how, []).append(node.address)
    if len(found) == 1:
        return [Check("lua-free", OK, next(iter(found)))]
    # A cluster mid-upgrade: each primary gets what it offers (the backend detects per node).
    return [Check("lua-free", OK, "; ".join(f"{', '.join(nodes)}: {how}" for how, nodes in found.items()))]


# -- eviction, persistence -----------------------------------------------------------


def check_eviction(target: Target) -> list[Check]:
    worst: Check | None = None
    for node in target.nodes:
        policy = _config(node.client, "maxmemory-policy")
        maxmemory_text = _config(node.client, "maxmemory")
        memory = _info(node.client, "memory") or {}
        if policy is None:
            policy = memory.get("maxmemory_policy")
        if maxmemory_text is None:
            maxmemory_text = str(memory.get("maxmemory", "")) or None
        where = f" on {node.address}" if len(target.nodes) > 1 else ""
        if policy is None:
            found = Check(
                "eviction",
                WARN,
                f"maxmemory-policy unknown{where}: CONFIG GET and INFO are refused",
                "check it by hand: it must be noeviction",
            )
        elif policy == _POLICY_OK:
            used, limit = memory.get("used_memory"), int(maxmemory_text or 0)
            if limit and isinstance(used, int) and used > 0.9 * limit:
                found = Check(
                    "eviction",
                    WARN,
                    f"maxmemory-policy noeviction{where}, but {used * 100 // limit}% of maxmemory is used",
                    "raise maxmemory: a full server refuses new locks with an OOM CacheError",
                )
            else:
                found = Check("eviction", OK, f"maxmemory-policy noeviction{where}: no lock is evicted before its TTL")
        else:
            which = "only keys with a TTL: exactly the locks" if policy.startswith("volatile") else "any key, locks too"
            limit = int(maxmemory_text or 0)
            if limit == 0:
                found = Check(
                    "eviction",
                    WARN,
                    f"maxmemory-policy {policy}{where} evicts {which}; no maxmemory is set, so nothing is evicted yet",
                    "set maxmemory-policy noeviction before anyone sets maxmemory",
                )
            else:
                found = Check(
                    "eviction",
                    FAIL,
                    f"maxmemory-policy {policy} with maxmemory {_bytes(limit)}{where}: Redis may evict {which}, "
                    "and an evicted lock is granted twice",
                    "CONFIG SET maxmemory-policy noeviction (and in the config file)",
                )
        if worst is None or _rank(found.status) > _rank(worst.status):
            worst = found
    assert worst is not None
    return [worst]


def _bytes(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:g} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024  # type: ignore[assignment]
    raise AssertionError


def _rank(status: str) -> int:
    return {OK: 0, WARN: 1, FAIL: 2}[status]


def check_persistence(target: Target) -> list[Check]:
    node = target.nodes[0]
    info = _info(node.client, "persistence")
    if info is None:
        return [Check("persistence", WARN, "INFO is refused: persistence unknown", "check appendonly and save by hand")]
    aof = bool(info.get("aof_enabled"))
    save = _config(node.client, "save")
    fsync = _config(node.client, "appendfsync")
    where = f" (checked on {node.address})" if len(target.nodes) > 1 else ""
    if aof:
        if fsync == "no":
            return [
                Check(
                    "persistence",
                    WARN,
                    f"AOF with appendfsync no{where}: a crash forgets what the OS had not flushed (tens of seconds)",
                    "appendfsync everysec",
                )
            ]
        return [
            Check(
                "persistence",
                OK,
                f"AOF (appendfsync {fsync or '?'}){where}: a restart forgets at most the last second of locks",
            )
        ]
    unsaved = info.get("rdb_changes_since_last_save", "?")
    age = int(time.time()) - int(info.get("rdb_last_save_time", 0) or 0)
    if save:
        return [
            Check(
                "persistence",
                WARN,
                f"RDB snapshots only (save {save}){where}: a restart forgets every lock, set_nx key and counter "
                f"written since the last snapshot ({age} s ago, {unsaved} changes)",
                "appendonly yes, if a restart freeing locks (two holders) or forgetting set_nx keys matters",
            )
        ]
    detail = "no AOF" + (", no RDB snapshots" if save == "" else ", RDB schedule unknown (CONFIG refused)")
    return [
        Check(
            "persistence",
            WARN,
            f"{detail}{where}: a restart forgets every lock (their holders keep running: two holders), "
            "every set_nx idempotency key and every counter",
            "appendonly yes; or accept it, and make the work idempotent (set_nx, fencing)",
        )
    ]


# -- ACL -----------------------------------------------------------------------------


def _script_commands() -> list[str]:
    """The commands the Lua scripts call: Redis checks each against the user too."""
    found: list[str] = []
    for script in SCRIPTS:
        for name in re.findall(rb"redis\.call\(\s*['\"](\w+)['\"]", script.source):
            text = name.decode().lower()
            if text not in found:
                found.append(text)
    return found


def check_acl(target: Target) -> list[Check]:
    """Send each command the library sends, on scratch keys, and name the refused ones."""
    tag = secrets.token_hex(8).encode()
    base = target.prefix + b"doctor:{" + tag + b"}:"  # one hash slot: every probe on one shard
    lock, other, once, count = base + b"lock", base + b"plain", base + b"once", base + b"count"
    client = target.client_for(lock)
    token, rival = secrets.token_bytes(16), secrets.token_bytes(16)
    ttl = str(SCRATCH_TTL_MS)

    def script(s: Script, *args: Any) -> Callable[[], Any]:
        return lambda: client.evalsha(s.sha.decode(), 1, *args)

    held: list[bytes] = [token]  # what extend and release send once it is acquired

    def acquire() -> None:
        fence = client.evalsha(ACQUIRE.sha.decode(), 1, lock, token, ttl)
        held[0] = held_value(token, int(fence)) if int(fence) > 0 else token

    def with_held(s: Script, *args: Any) -> Callable[[], Any]:
        return lambda: client.evalsha(s.sha.decode(), 1, lock, held[0], *args)

    def transaction() -> None:
        # The acquire of a free key: SET NX and TIME in one transaction (hotlock._acquire).
        pipe = client.pipeline(transaction=True)
        pipe.set(other, token, nx=True, px=SCRATCH_TTL_MS)
        pipe.time()
        pipe.execute()

    in_scripts = _script_commands()
    # (name as ACL spells it, call, required): required ones fail the check when refused.
    probes: list[tuple[str, Callable[[], Any], bool]] = [
        *[("script|load", (lambda s=s: client.script_load(s.source)), True) for s in SCRIPTS],
        ("evalsha", acquire, True),
        ("evalsha", script(ACQUIRE, lock, token, ttl), True),  # a retry with the same token
        ("evalsha", script(ACQUIRE, lock, rival, ttl), True),  # the "held elsewhere" path
        ("evalsha", with_held(EXTEND, ttl), True),
        ("evalsha", with_held(RELEASE), True),
        # Refused, every acquire goes by script: it works, at a script's cost to the server.
        ("multi", transaction, False),
    ]
    # The scripts' commands, also sent alone so a refusal names the command (a refused
    # call inside a script only says "can't run this command").
    single: dict[str, Callable[[], Any]] = {
        "set": lambda: client.set(other, b"1", px=SCRATCH_TTL_MS),
        "get": lambda: client.get(other),
        "pttl": lambda: client.pttl(other),
        "pexpire": lambda: client.pexpire(other, SCRATCH_TTL_MS),
        "del": lambda: client.delete(other),
        "time": lambda: client.time(),
    }
    for name in in_scripts:
        if name in single:
            probes.append((name, single[name], True))
    probes += [
        ("set", lambda: client.set(once, b"1", nx=True, px=SCRATCH_TTL_MS), True),  # set_nx
        ("incrby", lambda: client.incrby(count, 1), True),  # incr
        ("pexpire", lambda: client.pexpire(count, SCRATCH_TTL_MS), True),  # (the counter gets a TTL here)
        ("info", lambda: client.info("server"), False),
    ]
    if "time" not in in_scripts:
        probes.append(("time", single["time"], False))
    config = target.config
    if config is not None and config.db:
        probes.append(("select", lambda: client.execute_command("SELECT", config.db), True))
    if config is not None and config.client_name is not None:
        # ?client_name=: every connection sends CLIENT SETNAME, and a refusal fails the connect.
        name = config.client_name
        probes.append(("client|setname", lambda: client.execute_command("CLIENT", "SETNAME", name), True))
    refused: dict[str, str] = {}
    optional_refused: list[str] = []
    inside: str | None = None  # a refusal from inside a script, which does not name the command
    for name, call, required in probes:
        if name in refused or name in optional_refused:
            continue
        try:
            call()
        except redis.ResponseError as exc:
            text = str(exc)
            if "executing the script can't run" in text:
                inside = inside or text
            elif isinstance(exc, redis.exceptions.NoPermissionError):
                if required:
                    refused[name] = text
                else:
                    optional_refused.append(name)
            else:
                refused[name] = f"unexpected reply: {text}"
    for scratch in (lock, other, once, count):
        with contextlib.suppress(redis.ResponseError):  # DEL refused: said above; each key has a TTL
            client.delete(scratch)
    if inside is not None and not refused:
        # Every command passed alone, yet a script was refused one: a rule on the
        # script's own calls (or a command this check does not know the scripts call).
        refused["(a command the scripts call)"] = inside
    if refused:
        names = ", ".join(f"+{n}" for n in refused)
        first = next(iter(refused.values()))
        return [
            Check(
                "acl",
                FAIL,
                f"the server refuses {names} to this user ({first})",
                f"ACL SETUSER <user> {names} (docs/operations.md: the least-privilege ACL user)",
            )
        ]
    checked = sorted({n for n, _, _ in probes if n not in optional_refused})
    detail = f"every command the library sends is allowed ({', '.join(checked)})"
    if "info" in optional_refused:
        # The library tolerates it, but then cannot warn of an evicting policy at connect.
        return [
            Check(
                "acl",
                WARN,
                f"{detail}; INFO is refused",
                "+info: it feeds the connect log line and the eviction warning",
            )
        ]
    if "multi" in optional_refused:
        return [
            Check(
                "acl",
                WARN,
                f"{detail}; MULTI is refused, so every acquire goes by script",
                "+multi +exec: the acquire of a free key is SET NX and TIME in a transaction, "
                "at a third of a script's cost to the server",
            )
        ]
    if optional_refused:  # TIME, while no script calls it: only doctor's clock check needs it
        return [Check("acl", OK, f"{detail}; {', '.join(optional_refused)} refused, which the library does not send")]
    return [Check("acl", OK, detail)]


def check_wakeups(target: Target) -> list[Check]:
    """Whether a release can wake lock_wait's waiters: SUBSCRIBE, UNSUBSCRIBE and PUBLISH on
    a scratch wake-up channel (docs/waiting.md). Refused is a warning, not a
    failure: the library then polls, as it says once in its log."""
    sharded = target.kind == "cluster"  # sharded pub/sub there, on the channel's own node
    tag = secrets.token_hex(8).encode()
    channel = target.prefix + WAKE_SPACE + b"{doctor-" + tag + b"}"
    client = target.client_for(target.prefix + LOCK_SPACE + b"{doctor-" + tag + b"}")
    pubsub = client.pubsub()
    try:
        if sharded:
            pubsub.ssubscribe(channel)
            pubsub.get_sharded_message(timeout=2.0)  # the confirmation, or the refusal raised
            pubsub.sunsubscribe(channel)
            client.spublish(channel, b"")
        else:
            pubsub.subscribe(channel)
            pubsub.get_message(timeout=2.0)  # the confirmation, or the refusal raised
            pubsub.unsubscribe(channel)
            client.publish(channel, b"")
    except redis.ResponseError as exc:
        shown = channel.decode("utf-8", "backslashreplace")
        prefix = target.prefix.decode("utf-8", "backslashreplace")
        return [
            Check(
                "wakeups",
                WARN,
                f"the server refuses the wake-up channel {shown} to this user ({exc}): lock_wait polls with backoff",
                f"ACL SETUSER <user> resetchannels &{prefix}* "
                + ("+spublish +ssubscribe +sunsubscribe" if sharded else "+publish +subscribe +unsubscribe"),
            )
        ]
    finally:
        with contextlib.suppress(redis.RedisError, OSError):
            pubsub.close()
    what = "SSUBSCRIBE and SPUBLISH" if sharded else "SUBSCRIBE and PUBLISH"
    return [Check("wakeups", OK, f"{what} on the wake-up channels are allowed: releases wake waiters")]


def check_library(target: Target, url: str, connect: Connect) -> list[Check]:
    """The library itself, end to end, on a scratch prefix: connect (hotlock.connect, handed
    down by the command), lock, a conflicting lock, extend, unlock, set_nx, incr. Catches
    what probing by hand would miss (what the native backend sends at connect: AUTH,
    SELECT, the script loads)."""
    prefix = target.prefix + b"doctor:" + secrets.token_hex(8).encode() + b":"
    log = logging.getLogger("hotlock")
    level = log.level
    log.setLevel(logging.ERROR)  # its connect lines repeat what doctor says itself
    try:
        cache = connect(url, prefix=prefix, timeout=target.timeout, connect_timeout=target.timeout)
        try:
            with cache.lock("k", ttl=SCRATCH_TTL_MS / 1000) as lock:
                with contextlib.suppress(LockNotAcquired):
                    cache.lock("k", ttl=1)  # the conflict path (the acquire script's PTTL)
                lock.extend()
            cache.set_nx("k", "1", ttl=SCRATCH_TTL_MS / 1000)
            cache.incr("k")
        finally:
            cache.close()
    except HotlockError as exc:
        return [Check("library", FAIL, f"a lock cycle with the {backend_info()['backend']} backend failed: {exc}")]
    finally:
        log.setLevel(level)
    # Whatever the cycle wrote under the scratch prefix (found by SCAN, so this holds
    # whatever the key layout): each key has a TTL, but leave nothing behind.
    for node in target.nodes:
        with contextlib.suppress(redis.ResponseError):  # a refused DEL or SCAN: said by the acl check
            for name in list(node.client.scan_iter(match=glob_escape(prefix) + b"*", count=100)):
                node.client.delete(name)
    return [
        Check("library", OK, f"lock, conflict, extend, unlock, set_nx and incr work with the {cache.backend} backend")
    ]


def check_backend() -> list[Check]:
    info = backend_info()
    if info["backend"] == "native":
        return [Check("backend", OK, f"this host runs the native backend (hiredis {info['hiredis']})")]
    return [
        Check(
            "backend",
            WARN,
            f"this host runs the redis-py backend: {info['reason']}",
            "install libhiredis-dev and a compiler, then reinstall hotlock, for the native fast path",
        )
    ]


# -- latency, timeouts, clock --------------------------------------------------------


def _ping_ms(node: Node, prefix: bytes) -> list[float]:
    samples = []
    call: Callable[[], Any] = node.client.ping
    try:
        call()
    except redis.ResponseError:
        # PING refused (the library never sends it): time GET of a key nobody has instead.
        call = lambda: node.client.get(prefix + b"doctor:ping")  # noqa: E731
    for _ in range(PING_SAMPLES):
        t0 = time.perf_counter()
        call()
        samples.append((time.perf_counter() - t0) * 1000)
    return samples


def _quantile(samples: list[float], q: float) -> float:
    ordered = sorted(samples)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def _connect_ms(node: Node) -> float:
    """The slowest of 3 fresh connects (TCP, TLS, AUTH, SELECT), in ms."""
    worst = 0.0
    pool = node.client.connection_pool
    for _ in range(3):
        conn = pool.make_connection()
        t0 = time.perf_counter()
        try:
            conn.connect()
        finally:
            worst = max(worst, (time.perf_counter() - t0) * 1000)
            conn.disconnect()
    return worst


def check_latency(target: Target) -> tuple[list[Check], float, float]:
    """p50/p99 of PING round trips on each primary; the worst p99 and connect time (ms)."""
    worst_p99 = worst_connect = 0.0
    parts = []
    for node in target.nodes:
        samples = _ping_ms(node, target.prefix)
        p50, p99 = statistics.median(samples), _quantile(samples, 0.99)
        connect = _connect_ms(node)
        worst_p99, worst_connect = max(worst_p99, p99), max(worst_connect, connect)
        parts.append(f"{node.address} p50 {p50:.3f} ms, p99 {p99:.3f} ms, connect {connect:.1f} ms")
    detail = f"round trip over {PING_SAMPLES} PINGs: " + "; ".join(parts)
    if worst_p99 > 50:
        return (
            [Check("latency", WARN, detail, "each acquire and release is one round trip: put the server nearer")],
            worst_p99,
            worst_connect,
        )
    return [Check("latency", OK, detail)], worst_p99, worst_connect


def check_timeouts(target: Target, p99_ms: float, connect_ms: float) -> list[Check]:
    timeout_ms = target.timeout * 1000
    detail = (
        f"timeout {target.timeout:g} s and connect_timeout {target.timeout:g} s "
        f"against p99 {p99_ms:.3f} ms and connect {connect_ms:.1f} ms"
    )
    if p99_ms >= timeout_ms or connect_ms >= timeout_ms:
        return [
            Check(
                "timeouts",
                FAIL,
                f"{detail}: ordinary calls already exceed the timeout",
                "raise timeout/connect_timeout in hotlock.connect() (and --timeout here)",
            )
        ]
    if p99_ms * 10 > timeout_ms or connect_ms * 5 > timeout_ms:
        return [
            Check(
                "timeouts",
                WARN,
                f"{detail}: less than 10x headroom, so a slow moment turns into CacheErrors",
                "raise timeout to at least 10x the p99 round trip",
            )
        ]
    return [
        Check(
            "timeouts",
            OK,
            f"{detail}: ample headroom (pass --timeout with the value your services give hotlock.connect())",
        )
    ]


def check_clock(target: Target) -> list[Check]:
    node = target.nodes[0]
    best: tuple[float, float] | None = None  # (round trip, skew) of the tightest sample
    for _ in range(5):
        t0 = time.time()
        try:
            seconds, micros = node.client.time()
        except redis.ResponseError:
            return [Check("clock", WARN, "TIME is refused: clock skew unknown", "grant +time to check the clock")]
        t1 = time.time()
        skew = seconds + micros / 1e6 - (t0 + t1) / 2
        if best is None or t1 - t0 < best[0]:
            best = (t1 - t0, skew)
    assert best is not None
    rtt, skew = best
    side = "ahead of" if skew >= 0 else "behind"
    if abs(skew) < 1.0:
        detail = f"server clock {abs(skew) * 1000:.1f} ms {side} this host (+/- {rtt * 500:.1f} ms)"
    else:
        detail = f"server clock {abs(skew):.3f} s {side} this host (+/- {rtt / 2:.3f} s)"
    if abs(skew) >= 1.0:
        return [
            Check(
                "clock",
                WARN,
                f"{detail}: TTLs are relative and unaffected, but fences come from the server's clock, "
                "and logs will not line up",
                "run NTP (chrony) on the server and this host; a server clock stepped back can repeat a fence",
            )
        ]
    return [Check("clock", OK, f"{detail}: TTLs are relative, so locks do not depend on it")]


# -- topology ------------------------------------------------------------------------


def check_topology(target: Target) -> list[Check]:
    if target.kind == "cluster":
        return _cluster_topology(target)
    if target.kind == "sentinel":
        return _sentinel_topology(target)
    node = target.nodes[0]
    info = _info(node.client, "replication")
    if info is None:
        return [Check("topology", WARN, "INFO is refused: role unknown", "grant +info")]
    if info.get("role") != "master":
        primary = f"{info.get('master_host')}:{info.get('master_port')}"
        return [
            Check(
                "topology",
                FAIL,
                f"{node.address} is a replica of {primary}: every lock would fail with READONLY",
                "point the url at the primary, or use redis+sentinel:// so the library finds it",
            )
        ]
    replicas = int(info.get("connected_slaves", 0))
    detail = f"standalone primary {node.address} with {replicas} replica{'s' if replicas != 1 else ''}"
    if replicas:
        return [
            Check(
                "topology",
                OK,
                f"{detail}: a manual failover can give two holders (see wait_replicas); "
                "a redis+sentinel:// url follows a failover",
            )
        ]
    return [Check("topology", OK, detail)]


def _sentinel_topology(target: Target) -> list[Check]:
    s = target.sentinel_info
    if "master" not in s:
        return [Check("topology", FAIL, f"no sentinel answered: {'; '.join(s.get('errors', []))}")]
    master, replicas = s["master"], s["replicas"]
    up = [r for r in replicas if "down" not in r.get("flags", "")]
    sentinels = int(master.get("num-other-sentinels", 0)) + 1
    quorum = master.get("quorum", "?")
    detail = (
        f"Sentinel service {target.config.service}: primary {target.nodes[0].address}, "
        f"{len(up)} of {len(replicas)} replicas up, {sentinels} sentinels (quorum {quorum})"
    )
    if not up:
        return [Check("topology", WARN, f"{detail}: no replica to fail over to", "add a replica")]
    if sentinels < 3:
        return [Check("topology", WARN, f"{detail}: fewer than 3 sentinels", "run 3 or more sentinels")]
    return [Check("topology", OK, detail)]


def _cluster_topology(target: Target) -> list[Check]:
    node = target.nodes[0]
    try:
        shards = node.client.execute_command("CLUSTER SHARDS")
        described = [_describe_shard(shard) for shard in shards]
    except redis.ResponseError:
        # Before Redis 7: CLUSTER SLOTS, one entry per slot range.
        slots = node.client.execute_command("CLUSTER SLOTS")
        described = [_describe_slots(slots)]
    try:
        state = node.client.execute_command("CLUSTER INFO").get("cluster_state", "?")
    except redis.ResponseError:
        state = "?"
    detail = f"cluster of {len(target.nodes)} primaries, cluster_state {state}: " + "; ".join(d for d in described if d)
    if state != "ok":
        return [Check("topology", FAIL, detail, "fix the cluster (slots uncovered or a primary down)")]
    return [Check("topology", OK, detail)]


def _describe_shard(shard: Any) -> str:
    fields = _flat(shard)
    slots = fields.get("slots", [])
    ranges = [f"{slots[i]}-{slots[i + 1]}" for i in range(0, len(slots) - 1, 2)]
    primary, replicas = "?", 0
    for entry in fields.get("nodes", []):
        nf = _flat(entry)
        role = _s(nf.get("role"))
        if role == "master":
            primary = f"{_s(nf.get('ip') or nf.get('endpoint'))}:{nf.get('port')}"
        elif role == "replica":
            replicas += 1
    if not ranges:
        return ""
    return f"{primary} slots {','.join(ranges)} ({replicas} replica{'s' if replicas != 1 else ''})"


def _describe_slots(slots: Any) -> str:
    parts = []
    for entry in slots:
        start, end, primary, *replicas = entry
        host, port = _s(primary[0]), primary[1]
        parts.append(f"{host}:{port} slots {start}-{end} ({len(replicas)} replicas)")
    return "; ".join(parts)


def _flat(value: Any) -> dict[str, Any]:
    if isinstance(value, dict):
        return {_s(k): v for k, v in value.items()}
    it = iter(value)
    return {_s(k): v for k, v in zip(it, it, strict=False)}


def _s(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


# -- all of it -----------------------------------------------------------------------


def run_checks(target: Target, url: str, connect: Connect) -> list[Check]:
    """Every check in the order an operator reads them. A check that breaks (an error
    reply nobody expected) is reported as a fail of that check, not a crash."""
    checks: list[Check] = []

    def run(name: str, fn: Callable[[], list[Check]]) -> None:
        try:
            checks.extend(fn())
        except redis.RedisError as exc:
            checks.append(Check(name, FAIL, f"could not check: {type(exc).__name__}: {exc}"))

    run("server", lambda: check_server(target))
    run("topology", lambda: check_topology(target))
    run("eviction", lambda: check_eviction(target))
    run("persistence", lambda: check_persistence(target))
    run("acl", lambda: check_acl(target))
    run("wakeups", lambda: check_wakeups(target))
    run("library", lambda: check_library(target, url, connect))
    run("lua-free", lambda: check_dialect(target))
    measured: list[float] = []

    def latency() -> list[Check]:
        found, p99, connect = check_latency(target)
        measured.extend((p99, connect))
        return found

    run("latency", latency)
    if measured:
        run("timeouts", lambda: check_timeouts(target, *measured))
    run("clock", lambda: check_clock(target))
    run("backend", check_backend)
    return checks
