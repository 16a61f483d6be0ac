"""The main job hotlock exists for: settle a batch of invoices exactly once across workers.

Several worker processes walk the same batch in different orders. Each settles an
invoice under `with_lock` (try-once: a conflict means another worker has it) and marks
it with a `set_nx` idempotency key, so even a duplicate grant (a failover, a paused
holder) cannot settle an invoice twice. At the end every invoice must be settled exactly
once.

Runs against CACHE_URL, or a private redis-server it starts (installing it if missing
and possible).
"""

from __future__ import annotations

import multiprocessing as mp
import os
import random
import shutil
import socket
import subprocess
import sys
import tempfile
import time

import hotlock

INVOICES = int(os.environ.get("HOTLOCK_DEMO_INVOICES", "2000"))
WORKERS = 4


def settle(cache: hotlock.Cache, invoice: str) -> bool:
    """The protected work: charge once. The idempotency key makes a second run harmless."""
    if not cache.set_nx(f"settled:{invoice}", "1", ttl=86400):
        return False  # settled already, by an earlier holder
    cache.incr(f"settlements:{invoice}")  # what the audit below counts
    cache.incr("settled")  # progress
    return True


def worker(url: str, prefix: str, n: int, results: mp.Queue) -> None:  # type: ignore[type-arg]
    cache = hotlock.connect(url, prefix=prefix)
    order = [f"inv-{i:05d}" for i in range(INVOICES)]
    random.Random(n).shuffle(order)
    settled = conflicts = skipped = 0
    for invoice in order:
        try:
            if cache.with_lock(f"settle:{invoice}", 30, settle, cache, invoice):
                settled += 1
            else:
                skipped += 1
        except hotlock.LockNotAcquired:
            conflicts += 1  # another worker is settling it right now: a 409, not a failure
    cache.close()
    results.put((n, settled, conflicts, skipped))


def private_redis() -> tuple[str, subprocess.Popen[bytes], str]:
    exe = shutil.which("redis-server")
    if exe is None and os.geteuid() == 0 and shutil.which("apt-get"):
        print("redis-server not found: installing it with apt-get")
        subprocess.run(["apt-get", "update", "-qq"], check=True)
        subprocess.run(["apt-get", "install", "-y", "-qq", "redis-server"], check=True, stdout=subprocess.DEVNULL)
        exe = shutil.which("redis-server")
    if exe is None:
        sys.exit("no CACHE_URL and no redis-server: install redis-server or set CACHE_URL")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    workdir = tempfile.mkdtemp(prefix="hotlock-demo-")
    proc = subprocess.Popen(
        [exe, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no", "--dir", workdir],
        stdout=subprocess.DEVNULL,
    )
    url = f"redis://127.0.0.1:{port}/0"
    for _ in range(200):
        try:
            socket.create_connection(("127.0.0.1", port), 0.1).close()
            break
        except OSError:
            time.sleep(0.02)
    return url, proc, workdir


def main() -> None:
    url = os.environ.get("CACHE_URL")
    proc = workdir = None
    if not url:
        url, proc, workdir = private_redis()
        print(f"no CACHE_URL: started a private redis-server at {url}")
    try:
        # A fresh prefix per run, so a shared CACHE_URL server starts from a clean slate.
        prefix = f"demo-{os.getpid()}-{int(time.time())}:"
        audit = hotlock.connect(url, prefix=prefix)
        why = hotlock.backend_info()["reason"]
        print(f"backend: {audit.backend}" + (f" ({why})" if why else ""))
        print(f"{WORKERS} worker processes settle {INVOICES} invoices, each exactly once")
        results: mp.Queue = mp.Queue()  # type: ignore[type-arg]
        t0 = time.monotonic()
        procs = [mp.Process(target=worker, args=(url, prefix, n, results)) for n in range(WORKERS)]
        for p in procs:
            p.start()
        while any(p.is_alive() for p in procs) and time.monotonic() - t0 < 120:
            time.sleep(0.5)
            print(f"  progress: {audit.incr('settled', 0)}/{INVOICES} settled")
        totals = [0, 0, 0]
        for _ in procs:
            n, settled, conflicts, skipped = results.get(timeout=10)
            print(f"  worker {n}: settled {settled}, conflicts {conflicts}, already settled {skipped}")
            totals = [totals[0] + settled, totals[1] + conflicts, totals[2] + skipped]
        for p in procs:
            p.join()
        elapsed = time.monotonic() - t0
        sections = totals[0] + totals[2]
        counts = [audit.incr(f"settlements:inv-{i:05d}", 0) for i in range(INVOICES)]
        audit.close()
        once = sum(1 for c in counts if c == 1)
        print(
            f"summary: {sections} locked sections in {elapsed:.2f} s ({sections / elapsed:,.0f} sections/s), "
            f"{totals[1]} conflicts seen, {once}/{INVOICES} invoices settled exactly once"
        )
        if once != INVOICES:
            sys.exit("FAILED: some invoice was settled twice or never")
        print("every invoice settled exactly once")
    finally:
        if proc is not None:
            proc.terminate()
            proc.wait()
            shutil.rmtree(workdir or "", ignore_errors=True)


if __name__ == "__main__":
    main()
