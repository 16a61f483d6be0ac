"""The processes a failover run starts inside its namespaces.

``worker``: a seeded client contending on a few keys. Each time it gets a lock it reads a
fenced row and an unfenced counter from a shared SQLite store, holds for a while
(mostly briefly; now and then for seconds, extending every ttl/3), then writes both back
incremented: the fenced row only if no higher fence has written it
(``UPDATE ... WHERE fence <= ?``), the counter unconditionally. It writes only while it
believes it holds the lock (not told it is lost, its lease not past). Its history (every
hold with its times, fence, writes, extends and release, and every error) is written as
JSON when it stops, at its deadline or on SIGTERM.

``roles``: polls the local server's ROLE every 50 ms and logs each change, so the checker
can tell how long two primaries coexisted.

``latency``: sequential acquire and release of fresh keys, for the cost of a setting when
nothing fails.

Times are time.monotonic(): one clock for every process on the machine, namespaces or not.
"""

from __future__ import annotations

import argparse
import json
import random
import signal
import socket
import sqlite3
import sys
import time
from pathlib import Path
from typing import Any

STORE_SCHEMA = """
CREATE TABLE IF NOT EXISTS fenced(key TEXT PRIMARY KEY, fence INTEGER NOT NULL, value INTEGER NOT NULL);
CREATE TABLE IF NOT EXISTS counter(key TEXT PRIMARY KEY, value INTEGER NOT NULL);
CREATE TABLE IF NOT EXISTS log(
    seq INTEGER PRIMARY KEY AUTOINCREMENT, key TEXT, hold TEXT, fence INTEGER, accepted INTEGER, t REAL);
"""


def open_store(path: str | Path) -> sqlite3.Connection:
    db = sqlite3.connect(str(path), timeout=10, isolation_level=None)
    db.execute("PRAGMA journal_mode=WAL")
    db.execute("PRAGMA synchronous=OFF")
    return db


def init_store(path: Path, keys: list[str]) -> None:
    db = open_store(path)
    db.executescript(STORE_SCHEMA)
    for k in keys:
        db.execute("INSERT INTO fenced VALUES (?, 0, 0)", (k,))
        db.execute("INSERT INTO counter VALUES (?, 0)", (k,))
    db.close()


class Store:
    def __init__(self, path: str) -> None:
        self.db = open_store(path)

    def read(self, key: str) -> tuple[int, int]:
        (v,) = self.db.execute("SELECT value FROM fenced WHERE key = ?", (key,)).fetchone()
        (c,) = self.db.execute("SELECT value FROM counter WHERE key = ?", (key,)).fetchone()
        return v, c

    def write_fenced(self, key: str, hold: str, fence: int, value: int) -> bool:
        """The fenced write: refused when a higher fence has written the row."""
        db = self.db
        db.execute("BEGIN IMMEDIATE")
        try:
            n = db.execute(
                "UPDATE fenced SET value = ?, fence = ? WHERE key = ? AND fence <= ?", (value, fence, key, fence)
            ).rowcount
            db.execute(
                "INSERT INTO log(key, hold, fence, accepted, t) VALUES (?, ?, ?, ?, ?)",
                (key, hold, fence, n, time.monotonic()),
            )
            db.execute("COMMIT")
        except BaseException:
            db.execute("ROLLBACK")
            raise
        return n == 1

    def write_counter(self, key: str, value: int) -> None:
        self.db.execute("UPDATE counter SET value = ? WHERE key = ?", (value, key))


class Stop(Exception):
    pass


def _on_term(signum: int, frame: object) -> None:
    raise Stop


def run_worker(a: argparse.Namespace) -> None:
    import hotlock
    from hotlock import CacheError, LockLost, LockNotAcquired

    rng = random.Random(a.seed)
    keys = a.keys.split(",")
    store = Store(a.store)
    holds: list[dict[str, Any]] = []
    errors: list[dict[str, Any]] = []
    ttl = a.ttl
    cache = None
    n = 0
    fake_fence = 0

    def error(op: str, exc: BaseException) -> None:
        errors.append({"op": op, "t": time.monotonic(), "msg": f"{type(exc).__name__}: {exc}"[:200]})

    try:
        time.sleep(max(0.0, a.start - time.monotonic()))
        while time.monotonic() < a.until:
            if cache is None and not a.nolock:
                try:
                    cache = hotlock.connect(
                        a.url,
                        timeout=a.timeout,
                        connect_timeout=a.timeout,
                        wait_replicas=a.wait_replicas,
                        wakeups=False,
                    )
                except CacheError as exc:
                    error("connect", exc)
                    time.sleep(0.1)
                    continue
            key = rng.choice(keys)
            t0 = time.monotonic()
            lock = None
            if a.nolock:
                # The control: no lock at all. The checker must see the overlaps and lost
                # updates this gives. A fence from the wall clock, as the server's would be.
                fake_fence = max(fake_fence + 1, time.time_ns() // 1000)
                fence = fake_fence
            else:
                assert cache is not None
                try:
                    lock = cache.lock(key, ttl=ttl)
                except LockNotAcquired:
                    time.sleep(rng.uniform(0.005, 0.03))
                    continue
                except CacheError as exc:
                    error("acquire", exc)
                    time.sleep(0.02)
                    continue
                fence = lock.fence
            t1 = time.monotonic()
            n += 1
            hid = f"{a.name}:{n}"
            hold: dict[str, Any] = {
                "id": hid,
                "key": key,
                "fence": fence,
                "t0": t0,
                "t1": t1,
                "valid": t0 + ttl,
                "end": None,
                "lost": None,
                "writes": [],
                "counter": None,
                "extends": [],
                "release": None,
            }
            holds.append(hold)
            v, c = store.read(key)
            long = rng.random() < a.p_long
            until = t1 + (rng.uniform(a.long_min, a.long_max) if long else rng.uniform(0.005, 0.06))
            next_extend = t0 + ttl / 3
            ok = True
            while True:
                now = time.monotonic()
                if now >= until:
                    break
                if now >= hold["valid"] - a.margin:
                    ok = False  # the lease may run out before the write: give it up
                    break
                if long and now >= next_extend and lock is not None:
                    te = time.monotonic()
                    try:
                        lock.extend(ttl)
                    except LockLost:
                        hold["extends"].append([te, time.monotonic(), "lost"])
                        hold["lost"] = te
                        ok = False
                        break
                    except CacheError as exc:
                        hold["extends"].append([te, time.monotonic(), "error"])
                        error("extend", exc)
                        next_extend = time.monotonic() + 0.05
                        continue
                    hold["extends"].append([te, time.monotonic(), "ok"])
                    hold["valid"] = te + ttl
                    next_extend = te + ttl / 3
                    continue
                time.sleep(max(0.0, min(until, next_extend if long else until, hold["valid"] - a.margin) - now))
            if ok and time.monotonic() < hold["valid"] - a.margin:
                tw = time.monotonic()
                accepted = store.write_fenced(key, hid, fence, v + 1)
                hold["writes"].append([tw, time.monotonic(), accepted])
                store.write_counter(key, c + 1)
                hold["counter"] = time.monotonic()
            tr = time.monotonic()
            hold["end"] = tr
            if lock is not None:
                try:
                    released = lock.unlock()
                except CacheError as exc:
                    error("release", exc)
                    hold["release"] = [tr, time.monotonic(), "error"]
                else:
                    hold["release"] = [tr, time.monotonic(), "ok" if released else "gone"]
    except Stop:
        pass
    finally:
        Path(a.out).write_text(json.dumps({"name": a.name, "side": a.side, "holds": holds, "errors": errors}))
        if cache is not None:
            cache.close()


def run_roles(a: argparse.Namespace) -> None:
    """Each change of the local server's ROLE (or of its silence), with the time seen."""
    changes: list[tuple[float, str]] = []
    last = None
    try:
        while time.monotonic() < a.until:
            role = "none"
            try:
                with socket.create_connection(("127.0.0.1", 6379), timeout=0.2) as s:
                    s.settimeout(0.2)
                    s.sendall(b"*1\r\n$4\r\nROLE\r\n")
                    data = s.recv(256)
                    # *3\r\n$6\r\nmaster\r\n... or *5\r\n$5\r\nslave\r\n...
                    parts = data.split(b"\r\n")
                    role = parts[2].decode() if len(parts) > 2 else "none"
            except OSError:
                role = "none"
            if role != last:
                changes.append((time.monotonic(), role))
                last = role
            time.sleep(0.05)
    except Stop:
        pass
    finally:
        changes.append((time.monotonic(), "end"))
        Path(a.out).write_text(json.dumps(changes))


def run_latency(a: argparse.Namespace) -> None:
    import hotlock

    cache = hotlock.connect(a.url, timeout=a.timeout, connect_timeout=a.timeout, wait_replicas=a.wait_replicas)
    samples = []
    for i in range(a.count + 100):
        t0 = time.perf_counter()
        lock = cache.lock(f"lat:{a.name}:{i}", ttl=5)
        t1 = time.perf_counter()
        lock.unlock()
        if i >= 100:  # warm-up
            samples.append(t1 - t0)
    cache.close()
    Path(a.out).write_text(json.dumps(samples))


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m tests.failover.worker")
    p.add_argument("mode", choices=["worker", "roles", "latency"])
    p.add_argument("--url", default="")
    p.add_argument("--name", default="w")
    p.add_argument("--side", default="")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--keys", default="k0,k1,k2")
    p.add_argument("--start", type=float, default=0.0, help="time.monotonic() to begin at")
    p.add_argument("--until", type=float, default=0.0, help="time.monotonic() to stop at")
    p.add_argument("--ttl", type=float, default=1.0)
    p.add_argument("--timeout", type=float, default=0.5)
    p.add_argument("--wait-replicas", type=int, default=0)
    p.add_argument("--store", default="")
    p.add_argument("--out", required=True)
    p.add_argument("--nolock", action="store_true")
    p.add_argument("--p-long", type=float, default=0.15)
    p.add_argument("--long-min", type=float, default=1.0)
    p.add_argument("--long-max", type=float, default=4.0)
    p.add_argument("--margin", type=float, default=0.05)
    p.add_argument("--count", type=int, default=1000)
    a = p.parse_args(argv)
    signal.signal(signal.SIGTERM, _on_term)
    {"worker": run_worker, "roles": run_roles, "latency": run_latency}[a.mode](a)


if __name__ == "__main__":
    main(sys.argv[1:])
