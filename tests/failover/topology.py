"""Network namespaces for one failover run: a primary, replicas, three sentinels and
clients on two sides of a link the harness can cut.

Every node is a namespace of its own (``hotlock-fo-<pid>-<n>-<node>``) with one veth into
a switch namespace holding two bridges, side A and side B, joined by a veth pair, the
trunk. Nothing is created in the caller's namespace: all traffic stays inside these.
Cutting the trunk (``ip link set down``) partitions the two sides while every node keeps
reaching its own side, so the clients placed beside the primary on side A still reach it
when the sentinels and replicas on side B cannot. Which nodes sit on side A is the fault's
choice (the primary alone, or the primary and a replica).

Processes are started with ``ip netns exec`` (which execs, so the pid is the program's)
and stopped by that pid; the namespaces are deleted at the end, and a run that finds
namespaces of an owner process no longer alive deletes them first.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

PREFIX = "hotlock-fo-"
SERVICE = "mymaster"
SUBNET = "10.77.0"
# The fixed addresses: every node is alone in its namespace, so all use the default ports.
ADDRESSES = {
    "p": 2,
    "r1": 3,
    "r2": 4,
    "r3": 5,
    "s1": 11,
    "s2": 12,
    "s3": 13,
    "ca": 21,
    "cb": 22,
}
REDIS_PORT = 6379
SENTINEL_PORT = 26379


class NoNetns(RuntimeError):
    """ip netns is not available here (not root, no iproute2, or no namespace support)."""


def ip(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["ip", *args], capture_output=True, text=True, check=check, timeout=30)


def netns_available() -> str | None:
    """None when namespaces, veth and bridges can be made here, else why not."""
    if shutil.which("ip") is None:
        return "the ip command (iproute2) is not installed"
    if os.geteuid() != 0:
        return "ip netns needs root (run as root, as CI does)"
    probe = f"{PREFIX}{os.getpid()}-probe"
    try:
        ip("netns", "add", probe)
        ip("-n", probe, "link", "add", "pa", "type", "veth", "peer", "name", "pb")
        ip("-n", probe, "link", "add", "pbr", "type", "bridge")
    except (subprocess.CalledProcessError, OSError) as exc:
        detail = exc.stderr.strip() if isinstance(exc, subprocess.CalledProcessError) else str(exc)
        return f"ip netns/veth/bridge failed: {detail}"
    finally:
        ip("netns", "del", probe, check=False)
    return None


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def cleanup_stale() -> list[str]:
    """Delete the namespaces of earlier runs whose owner process is gone (an interrupted
    run that could not clean up), stopping the processes left in them by pid."""
    listed = ip("netns", "list", check=False).stdout.split("\n")
    gone = []
    for line in listed:
        name = line.split(" ", 1)[0]
        if not name.startswith(PREFIX):
            continue
        owner = name[len(PREFIX) :].split("-", 1)[0]
        if owner.isdigit() and _alive(int(owner)):
            continue  # another run, still going (make test runs on several workers)
        for pid in ip("netns", "pids", name, check=False).stdout.split():
            with contextlib.suppress(ProcessLookupError, ValueError):
                os.kill(int(pid), signal.SIGKILL)
        ip("netns", "del", name, check=False)
        gone.append(name)
    return gone


_counter = 0
_live: list[Topology] = []


def _close_all() -> None:
    for topo in list(_live):
        topo.close()


atexit.register(_close_all)


@dataclass
class Topology:
    """One run's namespaces and processes. ``side_a`` lists the nodes cut off with the
    primary (the clients ``ca`` always are); the rest, sentinels included, are side B."""

    replicas: int = 2
    side_a: tuple[str, ...] = ("p",)
    name: str = ""
    workdir: Path = field(default_factory=lambda: Path(tempfile.mkdtemp(prefix="hotlock-fo-")))
    procs: dict[str, subprocess.Popen[bytes]] = field(default_factory=dict)
    extra: list[subprocess.Popen[bytes]] = field(default_factory=list)
    namespaces: list[str] = field(default_factory=list)
    closed: bool = False

    def __post_init__(self) -> None:
        global _counter
        _counter += 1
        self.name = f"{PREFIX}{os.getpid()}-{_counter}"

    # -- the network ------------------------------------------------------------------

    @property
    def nodes(self) -> list[str]:
        return ["p", *(f"r{i + 1}" for i in range(self.replicas)), "s1", "s2", "s3", "ca", "cb"]

    @property
    def data_nodes(self) -> list[str]:
        return ["p", *(f"r{i + 1}" for i in range(self.replicas))]

    def ns(self, node: str) -> str:
        return f"{self.name}-{node}"

    @staticmethod
    def addr(node: str) -> str:
        return f"{SUBNET}.{ADDRESSES[node]}"

    @property
    def switch(self) -> str:
        return f"{self.name}-sw"

    def build(self) -> None:
        _live.append(self)
        sw = self.switch
        ip("netns", "add", sw)
        self.namespaces.append(sw)
        ip("-n", sw, "link", "set", "lo", "up")
        for side in ("a", "b"):
            ip("-n", sw, "link", "add", f"br{side}", "type", "bridge")
            ip("-n", sw, "link", "set", f"br{side}", "up")
        # The trunk: what a cut takes down.
        ip("-n", sw, "link", "add", "ta", "type", "veth", "peer", "name", "tb")
        ip("-n", sw, "link", "set", "ta", "master", "bra")
        ip("-n", sw, "link", "set", "tb", "master", "brb")
        ip("-n", sw, "link", "set", "ta", "up")
        ip("-n", sw, "link", "set", "tb", "up")
        for node in self.nodes:
            ns = self.ns(node)
            ip("netns", "add", ns)
            self.namespaces.append(ns)
            side = "a" if node in self.side_a or node == "ca" else "b"
            ip("-n", sw, "link", "add", f"v-{node}", "type", "veth", "peer", "name", "eth0", "netns", ns)
            ip("-n", sw, "link", "set", f"v-{node}", "master", f"br{side}")
            ip("-n", sw, "link", "set", f"v-{node}", "up")
            ip("-n", ns, "link", "set", "lo", "up")
            ip("-n", ns, "addr", "add", f"{self.addr(node)}/24", "dev", "eth0")
            ip("-n", ns, "link", "set", "eth0", "up")

    def cut(self) -> None:
        """Side A (the primary, the nodes placed with it, the clients ca) loses side B."""
        ip("-n", self.switch, "link", "set", "ta", "down")

    def heal(self) -> None:
        ip("-n", self.switch, "link", "set", "ta", "up")

    # -- processes --------------------------------------------------------------------

    def spawn(self, node: str, argv: list[str], log: Path | None = None) -> subprocess.Popen[bytes]:
        out = open(log, "ab") if log is not None else subprocess.DEVNULL  # noqa: SIM115
        try:
            proc = subprocess.Popen(
                ["ip", "netns", "exec", self.ns(node), *argv],
                stdout=out,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                cwd=self.workdir,
                env=_env(),
            )
        finally:
            if log is not None:
                out.close()  # type: ignore[union-attr]
        return proc

    def redis_argv(self, node: str, config: dict[str, str], aof: bool = False) -> list[str]:
        d = self.workdir / node
        d.mkdir(exist_ok=True)
        argv = [
            shutil.which("redis-server") or "redis-server",
            "--port", str(REDIS_PORT),
            "--bind", "0.0.0.0",
            "--protected-mode", "no",
            "--dir", str(d),
            "--save", "",
            "--appendonly", "yes" if aof else "no",
            "--appendfsync", "everysec",
            "--repl-diskless-sync", "yes",
            "--repl-diskless-sync-delay", "0",
            "--repl-diskless-load", "swapdb",
            "--replica-announce-ip", self.addr(node),
            "--logfile", str(d / "redis.log"),
        ]  # fmt: skip
        for k, v in config.items():
            argv += [f"--{k}", v]
        if node != "p":
            argv += ["--replicaof", self.addr("p"), str(REDIS_PORT)]
        return argv

    def start_data(self, node: str, config: dict[str, str], aof: bool = False) -> None:
        self.procs[node] = self.spawn(node, self.redis_argv(node, config, aof))

    def start_sentinel(self, node: str, down_after_ms: int) -> None:
        d = self.workdir / node
        d.mkdir(exist_ok=True)
        conf = d / "sentinel.conf"
        conf.write_text(
            f"port {SENTINEL_PORT}\nbind 0.0.0.0\nprotected-mode no\ndir {d}\n"
            f"logfile {d / 'sentinel.log'}\n"
            f"sentinel announce-ip {self.addr(node)}\n"
            f"sentinel monitor {SERVICE} {self.addr('p')} {REDIS_PORT} 2\n"
            f"sentinel down-after-milliseconds {SERVICE} {down_after_ms}\n"
            # Long enough that a failover is not retried inside one run, short enough that
            # a slow one does not hang it.
            f"sentinel failover-timeout {SERVICE} 10000\n"
            f"sentinel parallel-syncs {SERVICE} 1\n"
        )
        exe = shutil.which("redis-sentinel") or "redis-sentinel"
        self.procs[node] = self.spawn(node, [exe, str(conf)])

    def cli(self, node: str, *args: str, port: int = REDIS_PORT, timeout: float = 5) -> str:
        """redis-cli inside ``node``'s namespace against its own server; '' on failure."""
        try:
            out = subprocess.run(
                ["ip", "netns", "exec", self.ns(node), "redis-cli", "-p", str(port), *args],
                capture_output=True,
                text=True,
                timeout=timeout,
            )
        except subprocess.TimeoutExpired:
            return ""
        return out.stdout

    def start(self, config: dict[str, str], down_after_ms: int, aof: bool = False) -> None:
        """Data nodes, then (once the replicas are in sync, so the sentinels' first look at
        the primary lists them all: they look again only every 10 s) the sentinels;
        returns once every sentinel knows every replica and the other two sentinels (a
        failover needs both)."""
        self.build()
        for node in self.data_nodes:
            self.start_data(node, config, aof)
        self._until(
            lambda: all("master_link_status:up" in self.cli(r, "info", "replication") for r in self.data_nodes[1:])
        )
        for node in ("s1", "s2", "s3"):
            self.start_sentinel(node, down_after_ms)
        self._until(
            lambda: all(
                self.cli(s, "sentinel", "replicas", SERVICE, port=SENTINEL_PORT).count("\nip\n") == self.replicas
                and self.cli(s, "sentinel", "sentinels", SERVICE, port=SENTINEL_PORT).count("\nip\n") == 2
                for s in ("s1", "s2", "s3")
            )
        )

    def _until(self, ready: Callable[[], bool], limit: float = 30) -> None:
        deadline = time.monotonic() + limit
        while not ready():
            if time.monotonic() > deadline:
                raise RuntimeError(
                    f"{self.name}: the replicas or sentinels did not come up in {limit} s (see {self.workdir})"
                )
            time.sleep(0.1)

    def primary(self) -> str:
        """The address the first sentinel names as the primary now."""
        out = self.cli("s1", "sentinel", "get-master-addr-by-name", SERVICE, port=SENTINEL_PORT).split()
        return out[0] if out else ""

    def sentinel_url(self) -> str:
        hosts = ",".join(f"{self.addr(s)}:{SENTINEL_PORT}" for s in ("s1", "s2", "s3"))
        return f"redis+sentinel://{hosts}/{SERVICE}"

    def signal(self, node: str, sig: signal.Signals) -> None:
        proc = self.procs[node]
        if proc.poll() is None:
            os.kill(proc.pid, sig)

    def kill(self, node: str) -> None:
        proc = self.procs[node]
        if proc.poll() is None:
            os.kill(proc.pid, signal.SIGKILL)
        proc.wait(10)

    def close(self) -> None:
        """Stop every process by pid (a stopped one is continued first), delete the
        namespaces and the work directory. Safe to call twice."""
        if self.closed:
            return
        self.closed = True
        procs = [*self.procs.values(), *self.extra]
        for proc in procs:
            if proc.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(proc.pid, signal.SIGCONT)
                    os.kill(proc.pid, signal.SIGTERM)
        end = time.monotonic() + 5
        for proc in procs:
            try:
                proc.wait(max(0.1, end - time.monotonic()))
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(proc.pid, signal.SIGKILL)
                proc.wait(5)
        for ns in reversed(self.namespaces):
            # Anything still inside (a process we did not start cannot be, but a
            # grandchild could) is stopped by pid before the namespace goes.
            for pid in ip("netns", "pids", ns, check=False).stdout.split():
                with contextlib.suppress(ProcessLookupError, ValueError):
                    os.kill(int(pid), signal.SIGKILL)
            ip("netns", "del", ns, check=False)
        if self in _live:
            _live.remove(self)
        if not os.environ.get("HOTLOCK_FAILOVER_KEEP"):
            shutil.rmtree(self.workdir, ignore_errors=True)

    def __enter__(self) -> Topology:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def install_signal_handlers() -> None:
    """SIGTERM and SIGHUP end the run as Ctrl-C does, so the finally blocks and atexit
    delete the namespaces."""

    def stop(signum: int, frame: object) -> None:
        raise KeyboardInterrupt(f"signal {signum}")

    for sig in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, stop)


def python() -> str:
    return sys.executable


ROOT = Path(__file__).resolve().parents[2]


def _env() -> dict[str, str]:
    """The caller's environment, with the repository on the path so ``python -m
    tests.failover.worker`` imports from any directory (and hotlock from wherever the
    caller's does)."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH", "")) if p)
    return env
