"""The async block's cancellation on a real Python 3.10, which has no Task.uncancel().

hotlock supports 3.10, where AsyncLock tells the renewer's cancellation from one from
outside by the cancellation's message (tests/test_aio_autoextend.py runs that path on
this interpreter by switching it on). This runs the same cases under a 3.10 interpreter
when one is installed (on PATH, or pyenv's), on the in-process backend: the source tree
alone, no extension and no Redis needed.
"""

from __future__ import annotations

import glob
import os
import shutil
import subprocess
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parent.parent / "src"

CASES = r"""
import asyncio, logging, sys, time
import hotlock.aio
from hotlock import LockLost
from hotlock.aio import _lock
assert sys.version_info[:2] == (3, 10) and not _lock.HAS_UNCANCEL
logging.disable(logging.WARNING)

def delete(cache, key):
    cache._backend._data._data.pop(b"hotlock:lock:{" + key.encode() + b"}")

async def outcome(work):
    try:
        await work
    except LockLost:
        return "LockLost"
    except asyncio.CancelledError:
        return "CancelledError"
    return "nothing"

async def lost():
    cache = await hotlock.aio.connect(None)
    async def work():
        async with cache.lock("a", ttl=0.3, auto_extend=True):
            delete(cache, "a")
            await asyncio.sleep(5)
    return await outcome(work())

async def outside():
    cache = await hotlock.aio.connect(None)
    async def work():
        async with cache.lock("b", ttl=0.3, auto_extend=True):
            await asyncio.sleep(5)
    task = asyncio.ensure_future(work())
    await asyncio.sleep(0.5)  # renewed meanwhile
    task.cancel()
    return await outcome(task)

async def both():
    cache = await hotlock.aio.connect(None)
    async def work():
        async with cache.lock("c", ttl=0.3, auto_extend=True) as lock:
            lock.on_lost(lambda lk: task.cancel())  # from outside, at the loss itself
            await asyncio.sleep(5)
    task = asyncio.ensure_future(work())
    await asyncio.sleep(0.1)
    delete(cache, "c")
    return await outcome(task)

async def ready():
    cache = await hotlock.aio.connect(None)
    async def work():
        async with cache.lock("d", ttl=0.3, auto_extend=True):
            delete(cache, "d")
            end = time.monotonic() + 2
            while time.monotonic() < end:
                await asyncio.sleep(0)  # never waiting on a future when cancelled
    return await outcome(work())

results = [asyncio.run(case()) for case in (lost, outside, both, ready)]
print(" ".join(results))
"""


def python310() -> str | None:
    pyenv = os.environ.get("PYENV_ROOT", os.path.expanduser("~/.pyenv"))
    candidates = sorted(glob.glob(os.path.join(pyenv, "versions", "3.10.*", "bin", "python")))
    if candidates:
        return candidates[-1]
    found = shutil.which("python3.10")
    # A pyenv shim without 3.10 selected fails when run: only a real interpreter counts.
    return found if found and "/shims/" not in found else None


def test_the_block_cancellation_on_python_310() -> None:
    exe = python310()
    if exe is None:
        # As make test-pythons does: CI expects 3.10 (pyenv), a dev machine may lack it.
        if os.environ.get("CI") == "true":
            pytest.fail("no Python 3.10 interpreter installed, and CI expects one (pyenv)")
        pytest.skip("no Python 3.10 interpreter installed")
    env = dict(os.environ, PYTHONPATH=str(SRC), HOTLOCK_PURE_PYTHON="1")
    done = subprocess.run([exe, "-c", CASES], capture_output=True, text=True, env=env, timeout=60)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.split() == ["LockLost", "CancelledError", "CancelledError", "LockLost"]
