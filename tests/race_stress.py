"""The thread-race stress: hotlock's calls from many threads while others close the cache,
flush the scripts and fork, with the interpreter switching threads as often as it can.

Run as its own process (tests/test_races.py, `make stress`), so that a crash is a signal
in its exit status rather than the end of the test run:

    python -m tests.race_stress URL BACKEND SECONDS [--fork] [--flush URL ...]

Every call must end in a result or one of hotlock's own errors (HotlockError); anything
else that escapes (a TypeError from a socket closed under a call, say) is printed and
fails the run (exit 1). A hang fails it by the caller's timeout; a crash by its signal.
The last line printed is a summary: calls made, and how many ended in each error.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import faulthandler
import gc
import os
import random
import sys
import threading
import time
import traceback

import redis

import hotlock

WORKERS = 8


def open_files() -> int:
    return len(os.listdir("/proc/self/fd"))


def leftovers(files_before: int) -> str:
    """What the run left behind once the cache is closed: subscriber threads still running
    after a few of their ticks, or file descriptors beyond the handful the closed cache may
    keep (the native backend's last connections are dropped by their threads' exit)."""
    deadline = time.monotonic() + 5.0
    while time.monotonic() < deadline:
        gc.collect()
        alive = [t for t in threading.enumerate() if t.name.startswith("hotlock-wakeups")]
        extra = open_files() - files_before
        if not alive and extra <= 16:
            return ""
        time.sleep(0.1)
    return f"after close(): {len(alive)} subscriber threads alive and {extra} more files open than at connect"


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("url")
    parser.add_argument("backend")
    parser.add_argument("seconds", type=float)
    parser.add_argument("--fork", action="store_true", help="also fork from a thread now and then")
    parser.add_argument(
        "--flush", action="append", default=[], help="a server to SCRIPT FLUSH every 3 ms (default: URL)"
    )
    args = parser.parse_args()

    # A thread switch after every few bytecodes, and collections all the time: the
    # interleavings a loaded worker meets once a week, every few microseconds.
    sys.setswitchinterval(1e-5)
    gc.set_threshold(50, 5, 5)

    cache = hotlock.connect(args.url, backend=args.backend, timeout=1.0, connect_timeout=1.0, prefix="race:")
    files_before = open_files()
    admins = [redis.Redis.from_url(url) for url in args.flush or [args.url]]
    stop = time.monotonic() + args.seconds
    counts: collections.Counter[str] = collections.Counter()
    escaped: list[str] = []
    guard = threading.Lock()

    def note(what: str) -> None:
        with guard:
            counts[what] += 1

    def call(fn: object, *a: object, **kw: object) -> object:
        try:
            result = fn(*a, **kw)  # type: ignore[operator]
        except hotlock.HotlockError as exc:
            note(type(exc).__name__)
            return None
        except BaseException:
            with guard:
                escaped.append(traceback.format_exc())
            return None
        note("ok")
        return result

    def worker(n: int) -> None:
        rng = random.Random(n)
        while time.monotonic() < stop:
            key = f"k{rng.randrange(16)}"
            op = rng.randrange(4)
            if op == 0:
                lock = call(cache.lock, key, 5)
                if lock is not None:
                    call(lock.extend, 5)  # type: ignore[attr-defined]
                    call(lock.unlock)  # type: ignore[attr-defined]
            elif op == 1:
                keys = [f"m{n}-{i}" for i in range(rng.randrange(1, 20))]
                locks = call(cache.lock_many, keys, 5)
                if isinstance(locks, list):
                    # The caller's list changed by another thread mid-call is the caller's
                    # business, but must never reach the extension unchecked.
                    mine = list(locks)
                    threading.Thread(target=locks.clear).start()
                    call(cache.unlock_many, mine)
            elif op == 2:
                lock = call(cache.lock_wait, key, 5, wait=0.01)
                if lock is not None:
                    call(lock.unlock)  # type: ignore[attr-defined]
            else:
                call(cache.set_nx, f"once-{rng.randrange(1000)}", b"1", 1)

    def closer() -> None:
        rng = random.Random(-1)
        while time.monotonic() < stop:
            time.sleep(rng.uniform(0, 0.002))
            call(cache.close)

    def flusher() -> None:
        while time.monotonic() < stop:
            time.sleep(0.003)
            for admin in admins:
                with contextlib.suppress(redis.RedisError):
                    admin.script_flush()

    def forker() -> None:
        # A child forked while the other threads are mid-call: it must neither touch the
        # parent's connections nor crash, and its own call must end in time.
        while time.monotonic() < stop:
            time.sleep(0.2)
            pid = os.fork()
            if pid == 0:
                # A child stuck past its call's timeouts prints where, and ends non-zero.
                faulthandler.dump_traceback_later(10, exit=True)
                try:
                    cache.lock("child", 1)
                except hotlock.HotlockError:
                    pass
                except BaseException:
                    os._exit(3)
                os._exit(0)
            _, status = os.waitpid(pid, 0)
            if status != 0:
                with guard:
                    escaped.append(f"a forked child ended with status {status}")

    threads = [threading.Thread(target=worker, args=(n,)) for n in range(WORKERS)]
    threads += [threading.Thread(target=closer), threading.Thread(target=flusher)]
    if args.fork:
        threads.append(threading.Thread(target=forker))
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    call(cache.close)
    leaked = leftovers(files_before)
    if leaked:
        escaped.append(leaked)
    for text in escaped[:5]:
        print(text, file=sys.stderr)
    print(f"calls: {sum(counts.values())} {dict(sorted(counts.items()))} escaped: {len(escaped)}", flush=True)
    return 1 if escaped else 0


if __name__ == "__main__":
    sys.exit(main())
