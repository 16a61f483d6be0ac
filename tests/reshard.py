"""Resharding and failover under load, with the operators' own tools.

A load runner (``run_under_load``): threads lock and unlock keys spread over every slot
(lock, a short critical section the overlap checker sees, unlock) on one shared cache while
an operation changes the cluster. It counts the sections done (and those done while the
operation ran), the conflicts (LockNotAcquired: another thread holds that key, as it
should be), the errors by kind (any CacheError, an unlock that found its lock gone, any
other exception), and the overlaps (must be 0).

The operations are what an operator runs, not hand-made SETSLOT sequences:
``redis-cli --cluster reshard``, ``add-node`` + ``rebalance --cluster-use-empty-masters``
+ a drain (``rebalance`` with the new node's weight 0) + ``del-node``, a plain
``CLUSTER FAILOVER`` sent to a replica while a reshard runs, and Valkey 9's atomic slot
migration (``CLUSTER MIGRATESLOTS``). Used by tests/test_reshard.py and bench/reshard.py.
"""

from __future__ import annotations

import random
import re
import shutil
import subprocess
import tempfile
import threading
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import redis

import hotlock
from hotlock import LockNotAcquired
from hotlock.backends.cluster import key_slot

from .cluster import Cluster, start_node
from .overlap import OverlapChecker

THIRD = 16384 // 3  # the slots one reshard moves: a third of the cluster

# redis-cli runs each step synchronously against loopback servers: a third of the slots
# takes seconds; this bound is for a machine loaded by other test runs, not a target.
CLI_TIMEOUT_S = 600.0


@dataclass
class Report:
    """What one operation under load came to; ``line()`` is the report line a test prints."""

    operation: str
    server: str
    backend: str
    seconds: float = 0.0  # the operation's own wall time
    sections: int = 0  # critical sections completed over the whole run
    during: int = 0  # of those, completed between the operation's start and its end
    conflicts: int = 0  # LockNotAcquired: the key was held by another thread
    errors: Counter[str] = field(default_factory=Counter)
    overlaps: int = 0
    samples: dict[str, str] = field(default_factory=dict)  # one full message per error kind
    notes: list[str] = field(default_factory=list)  # what the operation itself saw
    # What the servers answered the clients while the operation ran (redirect_counts):
    # evidence that the load went through the migration's redirections, not around them.
    redirects: Counter[str] = field(default_factory=Counter)

    def errors_text(self) -> str:
        return ", ".join(f"{kind}: {n}" for kind, n in sorted(self.errors.items())) or "none"

    def redirects_text(self) -> str:
        return ", ".join(f"{kind} {n}" for kind, n in sorted(self.redirects.items())) or "no redirections"

    def line(self) -> str:
        return (
            f"{self.operation} [{self.server}, {self.backend}]: {self.seconds:.1f} s, "
            f"{self.sections} sections ({self.during} during the operation), {self.conflicts} conflicts, "
            f"errors: {self.errors_text()}, overlaps: {self.overlaps}, server side: {self.redirects_text()}"
            + (f" ({'; '.join(self.notes)})" if self.notes else "")
        )

    @property
    def cache_errors(self) -> int:
        return sum(n for kind, n in self.errors.items() if kind.startswith("CacheError"))

    @property
    def others(self) -> int:
        """Errors that are not CacheError: never expected (a bug in the library or the runner)."""
        return sum(n for kind, n in self.errors.items() if not kind.startswith("CacheError"))


def error_kind(exc: BaseException) -> str:
    """An error's kind: its type and message with the addresses, numbers and key names
    taken out, so the same failure on two nodes or keys counts as one kind."""
    text = str(exc).split("\n")[0]
    text = re.sub(r"\s*\(server [^)]*\)", "", text)  # the cache's seeds, the same on every error
    text = re.sub(r"\d+\.\d+\.\d+\.\d+:\d+", "<node>", text)
    text = re.sub(r"'[^']*'", "<key>", text)
    text = re.sub(r"\d+", "N", text)
    return f"{type(exc).__name__}: {text[:120]}"


def run_under_load(
    url: str,
    backend: str,
    operation: Callable[[Report], None],
    report: Report,
    keys: int = 600,
    threads: int = 8,
    hold_s: float = 0.0005,
    settle_s: float = 0.3,
    timeout: float = 2.0,
    names: list[str] | None = None,
) -> Report:
    """Start ``threads`` threads locking and unlocking ``keys`` keys (spread over every
    slot) on one cache; once sections flow, run ``operation(report)``; go on ``settle_s``
    after it, then stop. Returns ``report`` filled in. ``timeout``: the cache's reply
    timeout (its retry budget for TRYAGAIN/CLUSTERDOWN derives from it). ``names``: the
    keys to lock, in place of ``keys`` ones spread over every slot (see hot_keys)."""
    names = names or [f"rs{i}" for i in range(keys)]
    keys = len(names)
    checker = OverlapChecker(keys)
    stop = threading.Event()
    guard = threading.Lock()
    conflicts = [0] * threads
    cache = hotlock.connect(url, backend=backend, timeout=timeout)

    def note(exc: BaseException) -> None:
        kind = error_kind(exc)
        with guard:
            report.errors[kind] += 1
            report.samples.setdefault(kind, str(exc))

    def worker(n: int) -> None:
        rng = random.Random(n)
        while not stop.is_set():
            k = rng.randrange(keys)
            try:
                lock = cache.lock(names[k], ttl=5)
            except LockNotAcquired:
                conflicts[n] += 1
                continue
            except Exception as exc:  # counted by kind, the test decides what is allowed
                note(exc)
                continue
            checker.enter(k)
            time.sleep(hold_s)
            checker.exit(k)
            try:
                if not lock.unlock():
                    # The lock was gone before its TTL (5 s, far above the section): a bug.
                    note(AssertionError("unlock found the lock gone"))
            except Exception as exc:
                note(exc)

    pool = [threading.Thread(target=worker, args=(n,), daemon=True) for n in range(threads)]
    for t in pool:
        t.start()
    try:
        deadline = time.monotonic() + 30
        while checker.sections < 50 * threads:  # the load runs before the operation starts
            if time.monotonic() > deadline:
                raise AssertionError(f"the load did not start: {checker.sections} sections, {report.errors}")
            time.sleep(0.02)
        before = checker.sections
        started = time.monotonic()
        operation(report)
        report.seconds = time.monotonic() - started
        report.during = checker.sections - before
        time.sleep(settle_s)
    finally:
        stop.set()
        for t in pool:
            t.join(30)
        cache.close()
    report.sections = checker.sections
    report.overlaps = checker.overlaps
    report.conflicts = sum(conflicts)
    return report


def hot_tags(first: int, last: int) -> list[str]:
    """A hash tag for each slot from ``first`` to ``last``: a load aimed at the slots a
    reshard moves first. A lock's key is its user key in braces, so a user key
    ``{tag}:j`` hashes as ``{tag`` and all of one tag share a slot (see hot_keys)."""
    tags: dict[int, str] = {}
    n = 0
    while len(tags) < last - first + 1:
        tag = f"h{n}"
        slot = key_slot(b"hotlock:lock:{{" + tag.encode() + b"}:0}")
        if first <= slot <= last:
            tags.setdefault(slot, tag)
        n += 1
    return list(tags.values())


def hot_keys(tags: list[str], per_slot: int) -> list[str]:
    """``per_slot`` user keys in the slot of each tag."""
    return [f"{{{tag}}}:{j}" for tag in tags for j in range(per_slot)]


def fill(client: redis.Redis, tags: list[str], per_slot: int) -> None:
    """``per_slot`` plain keys in the slot of each tag (hashed as ``{tag``, as the locks):
    the other data a cluster holds, which makes each slot's MIGRATE take a while, so the
    load meets its slot MIGRATING, not only moved."""
    pipe = client.pipeline(transaction=False)
    for tag in tags:
        for i in range(per_slot):
            pipe.set(f"fill:{{{{{tag}}}:{i}}}", b"x" * 100)
    pipe.execute()


def redirect_counts(cluster: Cluster) -> Counter[str]:
    """Over the live nodes: the ASKING commands served (one per ASK a client followed;
    redis-cli's MIGRATE never sends it) and the MOVED/ASK/TRYAGAIN/CLUSTERDOWN error
    replies (INFO errorstats)."""
    counts: Counter[str] = Counter()
    for node in cluster.nodes:
        if node.proc is None or node.proc.poll() is not None:
            continue
        try:
            stats = node.client().info("commandstats")
            errors = node.client().info("errorstats")
        except redis.RedisError:
            continue
        counts["ASKING"] += int(stats.get("cmdstat_asking", {}).get("calls", 0))
        for code in ("MOVED", "ASK", "TRYAGAIN", "CLUSTERDOWN"):
            counts[code] += int(errors.get(f"errorstat_{code}", {}).get("count", 0))
    return counts


def counted(cluster: Cluster, operation: Callable[[Report], None]) -> Callable[[Report], None]:
    """``operation``, with the redirections the nodes served meanwhile noted in the report
    (those of a node gone by the end, a deleted one, are not)."""

    def run(report: Report) -> None:
        before = redirect_counts(cluster)
        try:
            operation(report)
        finally:
            report.redirects = redirect_counts(cluster) - before

    return run


# -- the operations -------------------------------------------------------------------


def cli(*args: str, timeout: float = CLI_TIMEOUT_S) -> subprocess.CompletedProcess[str]:
    """``redis-cli`` with ``args``; raises with its output when it exits non-zero."""
    exe = shutil.which("redis-cli")
    if exe is None:
        raise AssertionError("redis-cli is not installed (make test installs it)")
    done = subprocess.run([exe, *args], capture_output=True, text=True, timeout=timeout)
    if done.returncode != 0:
        raise AssertionError(f"redis-cli {' '.join(args[:2])} exited {done.returncode}: {tail(done)}")
    return done


def tail(done: subprocess.CompletedProcess[str]) -> str:
    return (done.stdout[-1500:] + done.stderr[-1500:]).strip()


def slot_counts(cluster: Cluster) -> dict[int, int]:
    """Each primary's port -> how many slots it serves."""
    counts: Counter[int] = Counter()
    rows: list[Any] = cluster._slots()
    for r in rows:
        counts[int(r[2][1])] += int(r[1]) - int(r[0]) + 1
    return dict(counts)


def command(client: redis.Redis, *args: object) -> Any:
    """``execute_command``, which redis-py leaves untyped."""
    return client.execute_command(*args)  # type: ignore[no-untyped-call]


def reshard_args(cluster: Cluster, source: int, target: int, slots: int) -> list[str]:
    return [
        "--cluster",
        "reshard",
        f"127.0.0.1:{source}",
        "--cluster-from",
        cluster.node_id(source),
        "--cluster-to",
        cluster.node_id(target),
        "--cluster-slots",
        str(slots),
        "--cluster-yes",
    ]


def reshard(cluster: Cluster, source: int, target: int, slots: int = THIRD) -> Callable[[Report], None]:
    """``redis-cli --cluster reshard`` of ``slots`` slots from ``source`` to ``target``."""

    def run(report: Report) -> None:
        before = slot_counts(cluster)
        cli(*reshard_args(cluster, source, target, slots))
        cluster.wait_ok()
        after = slot_counts(cluster)
        assert after[target] == before[target] + slots, (before, after)
        report.notes.append(f"{slots} slots moved")

    return run


def add_rebalance_drain_delete(cluster: Cluster, kind: str = "redis") -> Callable[[Report], None]:
    """A fourth primary joins (``add-node``), takes its share (``rebalance
    --cluster-use-empty-masters``), gives it all back (``rebalance --cluster-weight
    <it>=0``) and leaves (``del-node``); stopped by pid afterwards."""

    def run(report: Report) -> None:
        seed = f"127.0.0.1:{cluster.primary_ports()[0]}"
        node = start_node(kind)
        cluster.nodes.append(node)
        try:
            cli("--cluster", "add-node", f"127.0.0.1:{node.port}", seed)
            new_id = cluster.node_id(node.port)
            # Every node knows the newcomer before any slot moves to it (a SETSLOT NODE
            # naming a node one has not heard of fails).
            cluster.wait_ok()
            cli("--cluster", "rebalance", seed, "--cluster-use-empty-masters", "--cluster-yes")
            cluster.wait_ok()
            taken = slot_counts(cluster).get(node.port, 0)
            assert taken >= 16384 // 4 - 200, f"the new primary took {taken} slots"
            cli("--cluster", "rebalance", seed, "--cluster-weight", f"{new_id}=0", "--cluster-yes")
            cluster.wait_ok()
            assert node.port not in slot_counts(cluster)
            cli("--cluster", "del-node", seed, new_id)
            cluster.nodes.remove(node)
            cluster.wait_ok()
            report.notes.append(f"the 4th primary took {taken} slots and gave them back")
        finally:
            if node in cluster.nodes:
                cluster.nodes.remove(node)
            node.stop()

    return run


def failover_during_reshard(
    cluster: Cluster, source: int, target: int, promoted: int, slots: int = THIRD
) -> Callable[[Report], None]:
    """``redis-cli --cluster reshard`` from ``source`` to ``target``; once a tenth of the
    slots have moved, a plain ``CLUSTER FAILOVER`` to the replica of ``promoted``.

    redis-cli (7.0) gives each moved slot to its new owner with SETSLOT NODE on every
    primary it listed when it started; the demoted one refuses ("Please use SETSLOT only
    with masters") and the reshard stops there, exit code 1, one slot possibly left
    MIGRATING/IMPORTING. What an operator then does is done here: ``redis-cli --cluster
    fix``, then a reshard of the slots still to move (both must exit 0)."""

    def run(report: Report) -> None:
        exe = shutil.which("redis-cli")
        assert exe is not None
        replica = int(cluster.client(promoted).info("replication")["slave0"]["port"])
        base = slot_counts(cluster)[target]
        # Its output to a file: a pipe nobody reads fills up and blocks redis-cli.
        with tempfile.TemporaryFile("w+") as out:
            proc = subprocess.Popen([exe, *reshard_args(cluster, source, target, slots)], stdout=out, stderr=out)
            try:
                deadline = time.monotonic() + CLI_TIMEOUT_S
                while slot_counts(cluster).get(target, 0) < base + slots // 10:
                    assert proc.poll() is None, "the reshard ended before a tenth of the slots had moved"
                    assert time.monotonic() < deadline, "the reshard made no progress"
                    time.sleep(0.01)
                moved_at = slot_counts(cluster).get(target, 0) - base
                # A manual failover gives up if the primary is slow to answer (a loaded
                # machine): asked again, up to three times.
                tries = 0
                for _attempt in range(3):
                    tries += 1
                    assert command(cluster.client(replica), "CLUSTER", "FAILOVER") == b"OK"
                    wait_until = time.monotonic() + 10
                    while (
                        time.monotonic() < wait_until
                        and cluster.client(replica).info("replication")["role"] != "master"
                    ):
                        time.sleep(0.02)
                    if cluster.client(replica).info("replication")["role"] == "master":
                        break
                else:
                    raise AssertionError("the manual failover did not happen")
                # A primary votes against a replica whose claim covers a slot it has seen
                # move with a newer epoch: the source's own replica may be refused until the
                # reshard is over (observed), so when it happened is part of the report.
                # A reshard that has already stopped with an error met the failover mid-way:
                # it stops on the demoted primary's refusal (checked below), so it counts
                # as "while it ran" too.
                ended = proc.poll()
                during = "while the reshard ran" if ended is None or ended != 0 else "after the reshard had ended"
                report.notes.append(f"failover after {moved_at} slots moved (attempt {tries}), {during}")
                code = proc.wait(CLI_TIMEOUT_S)
            finally:
                if proc.poll() is None:
                    proc.kill()
                    proc.wait()
            out.seek(0)
            said = out.read()
        report.notes.append(f"reshard exited {code}")
        if code != 0:
            assert "SETSLOT only with masters" in said, said[-1500:]
            seed = f"127.0.0.1:{target}"
            # fix exits 1 ("Nodes don't agree about configuration!") while the failover's
            # new epoch spreads, and the nodes may not agree at all on the slot that was
            # half-moved when the source's primary changed until fix has closed it: fix
            # again until it exits 0 (seconds; bounded at 60).
            deadline = time.monotonic() + 60
            fixes = 0
            while True:
                fixes += 1
                try:
                    cli("--cluster", "fix", seed, "--cluster-yes")
                    break
                except AssertionError:
                    if time.monotonic() > deadline:
                        raise
                    time.sleep(1)
            cluster.wait_ok()
            left = base + slots - slot_counts(cluster)[target]
            if left > 0:
                cli(*reshard_args(cluster, source if source != promoted else replica, target, left))
            report.notes.append(f"fix ({fixes} runs), then a reshard of the {left} slots left")
        cluster.wait_ok()
        assert slot_counts(cluster)[target] == base + slots
        assert replica in cluster.primary_ports() and promoted not in cluster.primary_ports()

    return run


def plain_failover(cluster: Cluster, promoted: int) -> Callable[[Report], None]:
    """A plain ``CLUSTER FAILOVER`` to the replica of ``promoted`` (asked again up to three
    times, as in failover_during_reshard), done once the old primary calls itself a replica."""

    def run(report: Report) -> None:
        replica = int(cluster.client(promoted).info("replication")["slave0"]["port"])
        for _attempt in range(3):
            assert command(cluster.client(replica), "CLUSTER", "FAILOVER") == b"OK"
            until = time.monotonic() + 10
            while time.monotonic() < until and cluster.client(replica).info("replication")["role"] != "master":
                time.sleep(0.02)
            if cluster.client(replica).info("replication")["role"] == "master":
                break
        else:
            raise AssertionError("the replica was not promoted after three CLUSTER FAILOVERs")
        until = time.monotonic() + 30
        while cluster.client(promoted).info("replication")["role"] != "slave":
            assert time.monotonic() < until, "the old primary never became a replica"
            time.sleep(0.02)

    return run


def migrations(client: redis.Redis) -> list[dict[str, str]]:
    """``CLUSTER GETSLOTMIGRATIONS`` (Valkey 9): one dict per job (its name, state, ...)."""

    def text(v: object) -> str:
        return v.decode() if isinstance(v, bytes) else str(v)

    jobs = []
    for entry in command(client, "CLUSTER", "GETSLOTMIGRATIONS"):
        # A map: redis-py hands it over as a dict, or as a flat list of pairs.
        pairs = list(entry.items()) if isinstance(entry, dict) else list(zip(entry[::2], entry[1::2], strict=True))
        jobs.append({text(k): text(v) for k, v in pairs})
    return jobs


def migrate_slots(cluster: Cluster, source: int, target: int, first: int, last: int) -> Callable[[Report], None]:
    """Valkey 9's atomic slot migration: ``CLUSTER MIGRATESLOTS SLOTSRANGE first last
    NODE <target>`` sent to ``source``, then ``CLUSTER GETSLOTMIGRATIONS`` polled until the
    job is done."""

    def run(report: Report) -> None:
        src = cluster.client(source)
        known = {j["name"] for j in migrations(src)}
        reply = command(src, "CLUSTER", "MIGRATESLOTS", "SLOTSRANGE", first, last, "NODE", cluster.node_id(target))
        assert reply == b"OK", reply
        # A third of the slots of a small data set takes about a second.
        deadline = time.monotonic() + 120
        while True:
            jobs = [j for j in migrations(src) if j["name"] not in known]
            states = {j["state"] for j in jobs}
            if jobs and states <= {"success", "failed", "cancelled"}:
                break
            assert time.monotonic() < deadline, f"the slot migration did not finish: {jobs}"
            time.sleep(0.02)
        assert states == {"success"}, jobs
        cluster.wait_ok()
        assert all(cluster.owner(s) == target for s in (first, (first + last) // 2, last))
        report.notes.append(f"{last - first + 1} slots moved atomically")

    return run


def three_primaries(cluster: Cluster) -> tuple[int, int, int]:
    """(source, target, bystander): the source is the primary with the most slots, so a
    third of the slots moved away leaves it one at least (a primary that loses its last
    slot becomes a replica of the node that took it, and the cluster a primary short)."""
    counts = slot_counts(cluster)
    ports = sorted(counts, key=lambda p: (-counts[p], p))
    return ports[0], ports[1], ports[2]
