"""Round trips and commands of a new connection's handshake, per path: ``python -m bench.handshake``.

Each path's cache talks to a private redis-server through a counting proxy. The cache is
warmed (one lock), its connections are killed from the side, and the next ``lock`` makes a
new connection: the proxy counts that connection's round trips (a turn from the client
writing to the server answering) and the commands it carried, minus the lock's own one
round trip and one command. The wake-up subscriber is counted on its own connection (less
its SUBSCRIBE's). With ``--password`` the server requires one (redis-py authenticates in a
round trip of its own).

A turn is counted from the wire, so a reply the client does not wait for still counts when
the client's next write comes after it: the subscriber writes its CLIENT SETINFO without
waiting when nothing in its handshake can be refused (no password, no client_name), and its
first SUBSCRIBE goes out whenever a waiter joins, usually after those replies came.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import contextlib
import socket
import threading
import time
from typing import Any

import hiredis
import redis

import hotlock
import hotlock.aio

from .server import start_redis


class CountingProxy:
    """A TCP proxy that, per accepted connection, counts round trips and parses the
    commands the client sent."""

    def __init__(self, target: tuple[str, int]) -> None:
        self.target = target
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = self.listener.getsockname()[1]
        self.conns: list[dict[str, Any]] = []
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self.listener.accept()
            except OSError:
                return
            server = socket.create_connection(self.target)
            stats: dict[str, Any] = {"turns": 0, "commands": [], "last": None, "lock": threading.Lock()}
            self.conns.append(stats)
            reader = hiredis.Reader()
            threading.Thread(target=self._pipe, args=(client, server, stats, "c", reader), daemon=True).start()
            threading.Thread(target=self._pipe, args=(server, client, stats, "s", None), daemon=True).start()

    @staticmethod
    def _pipe(src: socket.socket, dst: socket.socket, stats: dict[str, Any], side: str, reader: Any) -> None:
        while True:
            try:
                data = src.recv(65536)
            except OSError:
                data = b""
            if not data:
                for s in (src, dst):
                    with contextlib.suppress(OSError):
                        s.shutdown(socket.SHUT_RDWR)
                return
            with stats["lock"]:
                if side == "s" and stats["last"] == "c":
                    stats["turns"] += 1  # the server answers what the client wrote: one round trip
                stats["last"] = side
                if reader is not None:
                    reader.feed(data)
                    while (command := reader.gets()) is not False:
                        words = [w.decode(errors="replace").upper() for w in command[:2]]
                        name = " ".join(words) if words[0] in ("CLIENT", "SCRIPT") else words[0]
                        stats["commands"].append(name)
            dst.sendall(data)


def measure(path: str, password: str | None) -> list[tuple[str, int, list[str]]]:
    """[(connection kind, round trips, commands)] of the handshake on ``path``."""
    with start_redis() as server:
        # One connection, authenticated before the password is set.
        side = redis.Redis(host=server.host, port=server.port, single_connection_client=True)
        if password:
            side.config_set("requirepass", password)
        proxy = CountingProxy((server.host, server.port))
        auth = f":{password}@" if password else ""
        url = f"redis://{auth}127.0.0.1:{proxy.port}/0"
        backend, aio = path.split("/")
        rows = []

        def kill_and_count(kind: str, lock: Any) -> None:
            before = len(proxy.conns)
            side.client_kill_filter(_type="normal", skipme=True)
            time.sleep(0.1)
            lock()
            time.sleep(0.1)
            new = proxy.conns[before:]
            for stats in new:
                commands = [c for c in stats["commands"] if c != "EVALSHA"]
                rows.append((kind, stats["turns"] - 1, commands))

        def subscriber(before: int) -> None:
            for stats in proxy.conns[before:]:
                if "SUBSCRIBE" in stats["commands"]:
                    commands = [c for c in stats["commands"] if c != "SUBSCRIBE"]
                    rows.append(("subscriber", stats["turns"] - 1, commands))

        if aio == "sync":
            cache = hotlock.connect(url, backend=backend)
            try:
                cache.lock("warm", ttl=5).unlock()
                kill_and_count("data", lambda: cache.lock("k", ttl=5))
                before = len(proxy.conns)
                with cache.lock("held", ttl=5), contextlib.suppress(hotlock.LockNotAcquired):
                    cache.lock_wait("held", ttl=5, wait=0.3)
                time.sleep(0.2)
                subscriber(before)
            finally:
                cache.close()
        else:

            async def main() -> None:
                cache = await hotlock.aio.connect(url, backend=backend)
                try:
                    await (await cache.lock("warm", ttl=5)).unlock()
                    loop = asyncio.get_running_loop()

                    async def lock() -> None:
                        await cache.lock("k", ttl=5)

                    await loop.run_in_executor(
                        None,
                        kill_and_count,
                        "data",
                        lambda: asyncio.run_coroutine_threadsafe(lock(), loop).result(10),
                    )
                    before = len(proxy.conns)
                    async with cache.lock("held", ttl=5):
                        with contextlib.suppress(hotlock.LockNotAcquired):
                            await cache.lock_wait("held", ttl=5, wait=0.3)
                    await asyncio.sleep(0.2)
                    subscriber(before)
                finally:
                    await cache.close()

            asyncio.run(main())
        return rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.handshake", description=__doc__.splitlines()[0])
    ap.add_argument("--password", default=None, help="make the server require this password")
    args = ap.parse_args(argv)
    print(f"hotlock from {hotlock.__file__}; server password: {'yes' if args.password else 'no'}")
    print(f"{'path':<16} {'connection':<11} {'round trips':>11}  commands")
    for path in ("native/sync", "redis-py/sync", "native/async", "redis-py/async"):
        for kind, turns, commands in measure(path, args.password):
            shown = ", ".join(f"{n}x {c}" if n > 1 else c for c, n in collections.Counter(commands).items())
            print(f"{path:<16} {kind:<11} {turns:>11}  {shown}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
