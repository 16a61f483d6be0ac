"""How far one call walks through the library: ``python -m bench.walk [URL]``.

Traces ``cache.lock_wait("k", ttl=30, wait=2)`` on a free key, then its unlock, on three
paths (the native backend, the redis-py backend, the native asyncio backend) of a warmed
cache, and counts what a maintainer following it reads: the Python functions of hotlock it
enters (hops, each entry counted) and the source files they live in. The extension's
Cython functions are not Python frames: a path through them counts as its first Python
caller. Without URL a private redis-server is started.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
from collections.abc import Callable
from pathlib import Path
from types import FrameType
from typing import Any

import hotlock
import hotlock.aio

from .servercost import start

PACKAGE = str(Path(hotlock.__file__).parent) + os.sep


def traced(run: Callable[[], Any]) -> tuple[list[str], set[str]]:
    """The hotlock functions ``run`` enters, in order ("file:function"), and their files."""
    hops: list[str] = []

    def profile(frame: FrameType, event: str, arg: object) -> None:
        if event == "call" and frame.f_code.co_filename.startswith(PACKAGE):
            where = frame.f_code.co_filename[len(PACKAGE) :]
            hops.append(f"{where}:{frame.f_code.co_name}")

    sys.setprofile(profile)
    try:
        run()
    finally:
        sys.setprofile(None)
    return hops, {hop.split(":")[0] for hop in hops}


def sync_path(url: str, backend: str) -> Callable[[], Any]:
    cache = hotlock.connect(url, backend=backend)
    cache.lock_wait("warm", ttl=30, wait=2).unlock()
    return lambda: cache.lock_wait("k", ttl=30, wait=2).unlock()


def async_path(url: str, backend: str) -> Callable[[], Any]:
    loop = asyncio.new_event_loop()
    cache = loop.run_until_complete(hotlock.aio.connect(url, backend=backend))

    async def once(key: str) -> None:
        await (await cache.lock_wait(key, ttl=30, wait=2)).unlock()

    loop.run_until_complete(once("warm"))
    return lambda: loop.run_until_complete(once("k"))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.walk", description=__doc__.split("\n")[0])
    parser.add_argument("url", nargs="?")
    parser.add_argument("--hops", action="store_true", help="also list each hop")
    args = parser.parse_args(argv)
    server = None
    url = args.url
    if url is None:
        server, port = start("redis-server", None)
        url = f"redis://127.0.0.1:{port}/0"
    try:
        for name, make in [
            ("native", lambda: sync_path(url, "native")),
            ("redis-py", lambda: sync_path(url, "redis-py")),
            ("native asyncio", lambda: async_path(url, "native")),
        ]:
            hops, files = traced(make())
            print(f"{name:15} lock_wait + unlock: {len(hops):3} hops through {len(files):2} files")
            if args.hops:
                for hop in hops:
                    print(f"    {hop}")
    finally:
        if server is not None:
            server.terminate()
            server.wait()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
