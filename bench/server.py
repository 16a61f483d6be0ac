"""A private redis-server for the benchmarks: a free loopback port, no persistence, pinned.

Never the system Redis on 6379: every run starts its own server and stops it by pid.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from dataclasses import dataclass

__all__ = ["Pinning", "RedisServer", "free_port", "pin_running", "pinning", "start_redis"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass(frozen=True)
class Pinning:
    """Which cores the server and the client run on, and how to say so in a report."""

    server: int | None
    client: int | None
    note: str

    def prefix(self, core: int | None) -> list[str]:
        """A taskset prefix for a command line, or nothing when unpinned."""
        if core is None or shutil.which("taskset") is None:
            return []
        return ["taskset", "-c", str(core)]


def pinning(one_core: bool = False, unpinned: bool = False) -> Pinning:
    """Server on core 0 and client on core 1 when there are two cores or more.

    On a 2-core machine unpinned numbers jump between regimes from run to run (both
    processes on one core, or each on its own), so the default is to pin. ``one_core``
    puts both on core 0: the client's CPU cost then shows in the throughput.
    """
    cores = sorted(os.sched_getaffinity(0))
    if unpinned or shutil.which("taskset") is None:
        why = "" if unpinned else " (taskset not found)"
        return Pinning(None, None, f"unpinned{why}: server and client float over {len(cores)} cores")
    if one_core or len(cores) < 2:
        core = cores[0]
        why = "asked for by --one-core" if one_core else "only one core available"
        return Pinning(core, core, f"server and client both on core {core} ({why})")
    return Pinning(cores[0], cores[1], f"server on core {cores[0]}, client on core {cores[1]} (taskset)")


def pin_running(pids: list[int], core: int) -> None:
    """Pin processes already running to ``core``, every thread of each (``taskset -apc``):
    servers someone else started, such as a cluster's nodes."""
    for pid in pids:
        subprocess.run(["taskset", "-apc", str(core), str(pid)], check=True, capture_output=True)


@dataclass
class RedisServer:
    host: str
    port: int
    proc: subprocess.Popen[bytes]
    workdir: str

    @property
    def url(self) -> str:
        return f"redis://{self.host}:{self.port}/0"

    @property
    def pid(self) -> int:
        return self.proc.pid

    def version(self) -> str:
        out = subprocess.run(["redis-server", "--version"], capture_output=True, text=True, check=False).stdout
        for part in out.split():
            if part.startswith("v="):
                return part[2:]
        return "?"

    def stop(self) -> None:
        """Stop the server this run started, by its pid."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        shutil.rmtree(self.workdir, ignore_errors=True)

    def __enter__(self) -> RedisServer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def _ping(host: str, port: int) -> bool:
    try:
        with socket.create_connection((host, port), timeout=0.5) as s:
            s.sendall(b"PING\r\n")
            return s.recv(16).startswith(b"+PONG")
    except OSError:
        return False


def start_redis(core: int | None = None, *extra: str) -> RedisServer:
    """Start redis-server on a free loopback port (pinned to ``core``); wait until it answers."""
    exe = shutil.which("redis-server")
    if exe is None:
        raise SystemExit("bench: redis-server is not installed (apt-get install redis-server)")
    host, port = "127.0.0.1", free_port()
    workdir = tempfile.mkdtemp(prefix="hotlock-bench-redis-")
    cmd = [
        exe,
        "--port",
        str(port),
        "--bind",
        host,
        "--save",
        "",
        "--appendonly",
        "no",
        "--dir",
        workdir,
        "--daemonize",
        "no",
        "--loglevel",
        "warning",
        "--logfile",
        os.path.join(workdir, "redis.log"),
        "--maxclients",
        "4096",
        *extra,
    ]
    if core is not None and shutil.which("taskset"):
        cmd = ["taskset", "-c", str(core), *cmd]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    server = RedisServer(host, port, proc, workdir)
    deadline = time.monotonic() + 10
    while not _ping(host, port):
        if proc.poll() is not None or time.monotonic() > deadline:
            log = os.path.join(workdir, "redis.log")
            text = ""
            if os.path.exists(log):
                with open(log) as f:
                    text = f.read()[-2000:]
            server.stop()
            raise SystemExit(f"bench: redis-server did not start: {text}")
        time.sleep(0.02)
    return server
