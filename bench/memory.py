"""Redis memory per held lock: ``python -m bench.memory``.

A private redis-server; ``MEMORY USAGE`` of every key one held lock keeps (one key since
fencing: the lock key holds token + fence), and ``used_memory`` before and after taking
N locks on fresh keys (lock_many in batches, held while measured). Printed, not written:
bench/results.md ("Fencing") keeps the figures.
"""

from __future__ import annotations

import argparse

import redis

import hotlock
from hotlock._lock import shown

from .server import start_redis


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.memory", description=__doc__.splitlines()[0])
    ap.add_argument("--locks", type=int, default=100_000)
    args = ap.parse_args(argv)
    with start_redis() as server:
        side = redis.Redis(host=server.host, port=server.port)
        cache = hotlock.connect(server.url, backend="native")
        one = cache.lock("memory:one", ttl=600)
        keys = side.keys(b"hotlock:*")
        usage = {shown(k): side.memory_usage(k, samples=0) for k in keys}
        value = side.get(keys[0]) or b""
        one.unlock()
        side.memory_purge()
        before = int(side.info("memory")["used_memory"])
        held = []
        for i in range(0, args.locks, 10_000):
            batch = cache.lock_many([f"memory:{j}" for j in range(i, min(i + 10_000, args.locks))], ttl=600)
            assert all(lk is not None for lk in batch)
            held += batch
        after = int(side.info("memory")["used_memory"])
        print(f"redis {server.version()}, hotlock from {hotlock.__file__}")
        print(f"keys one held lock keeps: {usage} (value {len(value)} bytes)")
        print(
            f"used_memory: {before:,} -> {after:,} bytes for {args.locks:,} held locks: "
            f"{(after - before) / args.locks:.1f} bytes per lock"
        )
        cache.unlock_many(held)
        cache.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
