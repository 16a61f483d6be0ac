"""The `hotlock` command line: every subcommand in a subprocess against a real
redis-server, its exit status and its --json output parsed.

Exit codes: 0 ok, 1 a check failed / the lock was not held, 2 usage, 3 cannot connect.
"""

from __future__ import annotations

import base64
import json
import os
import pty
import select
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

import hotlock
from hotlock._cli import main
from hotlock._cli._target import glob_matcher
from hotlock._keys import stored

from .conftest import RedisServer, free_port, start_redis
from .test_security import COMMANDS, PASSWORD, acl_line, tls_server  # noqa: F401 (a fixture)

USER = "hotlock_cli"


def cli(
    *args: str, url: str | None = None, stdin: str | None = "", timeout: float = 30, **extra_env: str
) -> subprocess.CompletedProcess[bytes]:
    """``python -m hotlock ARGS`` with CACHE_URL set to ``url`` (unset when None)."""
    env = {k: v for k, v in os.environ.items() if k not in ("CACHE_URL", "SSL_CERT_FILE")}
    env.update(extra_env)
    if url is not None:
        env["CACHE_URL"] = url
    return subprocess.run(
        [sys.executable, "-m", "hotlock", *args],
        input=None if stdin is None else stdin.encode(),
        capture_output=True,
        env=env,
        timeout=timeout,
        check=False,
    )


def out(result: subprocess.CompletedProcess[bytes]) -> str:
    return result.stdout.decode()


def as_json(result: subprocess.CompletedProcess[bytes]) -> Any:
    assert result.returncode in (0, 1), result.stderr.decode()
    return json.loads(result.stdout)


def checks(result: subprocess.CompletedProcess[bytes]) -> dict[str, dict[str, Any]]:
    data = as_json(result)
    assert isinstance(data, list)
    for item in data:
        assert set(item) >= {"check", "status", "detail"}
        assert item["status"] in ("ok", "warn", "fail")
    return {item["check"]: item for item in data}


def lock_key(key: bytes) -> bytes:
    """The Redis key of the lock on ``key`` under the default prefix (hotlock._keys)."""
    return stored(b"hotlock:lock:", key)


def closed_url() -> str:
    return f"redis://127.0.0.1:{free_port()}/0"  # nobody listens there


# -- the command, its help and its usage errors ----------------------------------------


def test_console_script_and_module_are_the_same_command() -> None:
    script = Path(sys.executable).with_name("hotlock")
    assert script.exists(), "pip install . installs the hotlock console script"
    a = subprocess.run([str(script), "--version"], capture_output=True, check=False)
    b = cli("--version")
    assert a.returncode == b.returncode == 0
    assert a.stdout == b.stdout == f"hotlock {hotlock.__version__}\n".encode()


def test_help_reads_like_a_man_page() -> None:
    top = cli("--help")
    assert top.returncode == 0
    text = out(top)
    for part in ("doctor", "locks", "release", "watch", "exit status:", "CACHE_URL", "--url", "--prefix", "--timeout"):
        assert part in text
    for command in ("doctor", "locks", "release", "watch"):
        page = cli(command, "--help")
        assert page.returncode == 0
        text = out(page)
        assert "examples:" in text and "exit status:" in text and "--json" in text and "--url" in text
        assert f"hotlock {command}" in text


@pytest.mark.parametrize(
    "args",
    [
        pytest.param([], id="no-command"),
        pytest.param(["frobnicate"], id="unknown-command"),
        pytest.param(["locks", "--no-such-option"], id="unknown-option"),
        pytest.param(["release", "k"], id="release-without-force"),
        pytest.param(["release", "", "--force", "--yes"], id="empty-key"),
        pytest.param(["release", "k" * 1025, "--force", "--yes"], id="long-key"),
        pytest.param(["release", "k", "--force"], id="release-no-tty-no-yes"),
        pytest.param(["--timeout", "-1", "locks"], id="negative-timeout"),
        pytest.param(["locks", "--timeout", "nan"], id="nan-timeout"),
        pytest.param(["watch", "--count", "0"], id="zero-count"),
        pytest.param(["--prefix", "", "locks"], id="empty-prefix"),
    ],
)
def test_bad_usage_exits_2_before_any_io(args: list[str]) -> None:
    # The url points at a closed port: reaching the network would exit 3, not 2.
    result = cli(*args, url=closed_url())
    assert result.returncode == 2, (result.stdout, result.stderr)
    assert result.stderr.strip()
    assert not result.stdout.strip() or args == []


@pytest.mark.parametrize(
    ("url", "message"),
    [
        ("http://127.0.0.1:6379/0", "url scheme must be"),
        ("redis://127.0.0.1:99999/0", "port"),
        ("redis://127.0.0.1:6379/x", "database number"),
        ("redis+cluster://", "at least one node"),  # the library's own parse_url message
    ],
)
def test_a_bad_url_gets_the_library_message_and_exit_2(url: str, message: str) -> None:
    result = cli("locks", "--url", url)
    assert result.returncode == 2
    assert message in result.stderr.decode()


def test_no_url_at_all_is_a_usage_error() -> None:
    result = cli("locks")
    assert result.returncode == 2
    assert "CACHE_URL" in result.stderr.decode()


@pytest.mark.parametrize(
    "command", [["doctor"], ["locks"], ["release", "k", "--force", "--yes"], ["watch", "--count", "1"]]
)
def test_unreachable_server_exits_3(command: list[str]) -> None:
    result = cli(*command, url=closed_url())
    assert result.returncode == 3, result.stderr
    assert "cannot connect" in result.stderr.decode()


def test_wrong_password_exits_3(redis_server: RedisServer, redis_url: str) -> None:
    url = f"redis://nobody:wrong@127.0.0.1:{redis_server.port}/0"
    result = cli("locks", url=url)
    assert result.returncode == 3
    err = result.stderr.decode()
    assert "authentication" in err.lower() or "invalid" in err.lower()
    assert "wrong" not in err  # never the password


def test_options_work_before_and_after_the_command(redis_url: str) -> None:
    before = cli("--url", redis_url, "--prefix", "p:", "locks", "--json")
    after = cli("locks", "--url", redis_url, "--prefix", "p:", "--json", url=closed_url())
    assert before.returncode == after.returncode == 0
    assert json.loads(before.stdout) == json.loads(after.stdout) == []


# -- doctor ------------------------------------------------------------------------------


def test_doctor_on_a_well_configured_server(redis_url: str, redis_server: RedisServer) -> None:
    result = cli("doctor", "--json", url=redis_url)
    found = checks(result)
    assert result.returncode == 0, found
    for name in ("server", "topology", "eviction", "persistence", "acl", "library", "latency", "timeouts", "clock"):
        assert name in found
    assert found["server"]["status"] == "ok" and redis_server.named in found["server"]["detail"]
    assert found["eviction"]["status"] == "ok"
    assert found["acl"]["status"] == "ok"
    assert found["library"]["status"] == "ok"
    assert "p50" in found["latency"]["detail"] and "p99" in found["latency"]["detail"]
    # The test server runs without AOF or RDB: a restart forgets every lock, and doctor says so.
    assert found["persistence"]["status"] == "warn"
    assert "restart forgets every lock" in found["persistence"]["detail"]
    assert found["persistence"]["advice"]
    assert found["topology"]["detail"].startswith("standalone primary")
    # The scratch keys are gone; nothing was left under the prefix.
    assert hotlock_keys(redis_url) == []


def hotlock_keys(url: str) -> list[bytes]:
    import redis

    with redis.Redis.from_url(url) as client:
        return sorted(client.scan_iter(match="hotlock:*"))


def test_doctor_text_is_one_line_per_check(redis_url: str) -> None:
    result = cli("doctor", url=redis_url)
    assert result.returncode == 0
    lines = out(result).splitlines()
    assert len(lines) == len(checks(cli("doctor", "--json", url=redis_url)))
    for line in lines:
        assert line.split()[0] in ("ok", "warn", "fail")
    assert any(line.startswith("warn") and "persistence" in line and "->" in line for line in lines)


@pytest.fixture
def scratch_server() -> Iterator[RedisServer]:
    server = start_redis()
    yield server
    server.stop()


def test_doctor_fails_on_an_evicting_policy(scratch_server: RedisServer) -> None:
    client = scratch_server.client()
    client.config_set("maxmemory", "100mb")
    client.config_set("maxmemory-policy", "allkeys-lru")
    result = cli("doctor", "--json", url=scratch_server.url)
    found = checks(result)
    assert result.returncode == 1
    assert found["eviction"]["status"] == "fail"
    assert "allkeys-lru" in found["eviction"]["detail"]
    assert "noeviction" in found["eviction"]["advice"]
    # volatile-* evicts exactly the keys with a TTL: the locks.
    client.config_set("maxmemory-policy", "volatile-ttl")
    found = checks(cli("doctor", "--json", url=scratch_server.url))
    assert found["eviction"]["status"] == "fail" and "exactly the locks" in found["eviction"]["detail"]
    # No maxmemory: nothing is evicted yet, but it is one setting away.
    client.config_set("maxmemory", "0")
    result = cli("doctor", "--json", url=scratch_server.url)
    assert checks(result)["eviction"]["status"] == "warn"
    assert result.returncode == 0


def test_doctor_sees_persistence(scratch_server: RedisServer) -> None:
    client = scratch_server.client()
    client.config_set("appendonly", "yes")
    found = checks(cli("doctor", "--json", url=scratch_server.url))
    assert found["persistence"]["status"] == "ok" and "AOF" in found["persistence"]["detail"]
    client.config_set("appendonly", "no")
    client.config_set("save", "3600 1")
    found = checks(cli("doctor", "--json", url=scratch_server.url))
    assert found["persistence"]["status"] == "warn" and "RDB snapshots only" in found["persistence"]["detail"]


@pytest.fixture
def acl_url(redis_server: RedisServer, redis_url: str) -> Iterator[str]:
    client = redis_server.client()
    client.execute_command("ACL", "SETUSER", USER, "reset", *acl_line(COMMANDS))
    yield f"redis://{USER}:{PASSWORD}@127.0.0.1:{redis_server.port}/1"
    client.execute_command("ACL", "DELUSER", USER)


def test_doctor_passes_on_the_readme_acl(acl_url: str) -> None:
    result = cli("doctor", "--json", url=acl_url)
    found = checks(result)
    assert found["acl"]["status"] == "ok", found["acl"]
    assert found["clock"]["status"] == "ok"  # +time is in the list: the acquire script reads the clock
    assert found["library"]["status"] == "ok", found["library"]
    assert not [c for c in found.values() if c["status"] == "fail"], found
    assert result.returncode == 0
    assert PASSWORD not in result.stdout.decode() + result.stderr.decode()


@pytest.mark.parametrize("missing", ["+pttl", "+script|load", "+incrby", "+evalsha", "+select", "+time"])
def test_doctor_fails_on_an_acl_missing_one_command(redis_server: RedisServer, acl_url: str, missing: str) -> None:
    redis_server.client().execute_command(
        "ACL", "SETUSER", USER, "reset", *acl_line([c for c in COMMANDS if c != missing])
    )
    result = cli("doctor", "--json", url=acl_url)
    found = checks(result)
    assert result.returncode == 1
    assert found["acl"]["status"] == "fail"
    assert missing in found["acl"]["detail"], found["acl"]
    assert missing in found["acl"]["advice"]


def test_doctor_names_client_setname_when_the_url_names_connections(acl_url: str) -> None:
    """?client_name= makes every connection send CLIENT SETNAME, which this ACL lacks."""
    named = acl_url + "?client_name=billing"
    found = checks(cli("doctor", "--json", url=named))
    assert found["acl"]["status"] == "fail", found["acl"]
    assert "+client|setname" in found["acl"]["detail"], found["acl"]
    assert checks(cli("doctor", "--json", url=acl_url))["acl"]["status"] == "ok"


def test_doctor_on_a_replica_fails_the_topology(redis_server: RedisServer, scratch_server: RedisServer) -> None:
    scratch_server.client().execute_command("REPLICAOF", "127.0.0.1", str(redis_server.port))
    try:
        found = checks(cli("doctor", "--json", url=scratch_server.url))
    finally:
        scratch_server.client().execute_command("REPLICAOF", "NO", "ONE")
    assert found["topology"]["status"] == "fail" and "replica" in found["topology"]["detail"]


# -- locks -------------------------------------------------------------------------------


def test_locks_lists_held_locks_sorted_by_ttl(redis_url: str) -> None:
    with hotlock.connect(redis_url) as cache:
        held = [cache.lock("settle:invoice-1", ttl=30), cache.lock("export:tenant-1", ttl=600)]
        held.append(cache.lock("settle:invoice-2", ttl=5))
        cache.set_nx("charged:order-1", "1", ttl=60)  # not a lock: never listed
        result = cli("locks", "--json", url=redis_url)
        assert result.returncode == 0
        rows = json.loads(result.stdout)
        assert [r["key"] for r in rows] == ["settle:invoice-2", "settle:invoice-1", "export:tenant-1"]
        ttls = [r["ttl"] for r in rows]
        assert ttls == sorted(ttls)
        assert 0 < ttls[0] <= 5 and 25 < ttls[1] <= 30 and 590 < ttls[2] <= 600
        for row in rows:
            assert isinstance(row["ttl"], float)
            # A plain lock's value is its token alone: no fence to read, so no HELD either.
            assert row["fence"] is None and row["held"] is None
        text = cli("locks", url=redis_url)
        lines = out(text).splitlines()
        assert lines[0].split() == ["KEY", "TTL", "FENCE", "HELD"]
        assert [line.split()[0] for line in lines[1:]] == ["settle:invoice-2", "settle:invoice-1", "export:tenant-1"]
        for lock in held:
            lock.unlock()
    result = cli("locks", url=redis_url)
    assert result.returncode == 0 and "no locks held" in out(result)


def test_locks_pattern_is_a_redis_glob_on_the_key(redis_url: str, capsys: pytest.CaptureFixture[str]) -> None:
    with hotlock.connect(redis_url) as cache:
        for key in ("settle:a", "settle:b", "settle:*star", "sync:a", "export:1", "tenant-7}:a", "{x}"):
            cache.lock(key, ttl=30)

        def keys(pattern: str) -> list[str]:
            # In this process (each subprocess costs an interpreter start): main() is the command.
            capsys.readouterr()
            assert main(["locks", pattern, "--json", "--url", redis_url]) == 0
            return sorted(r["key"] for r in json.loads(capsys.readouterr().out))

        assert keys("settle:*") == ["settle:*star", "settle:a", "settle:b"]
        assert keys("s*:a") == ["settle:a", "sync:a"]
        assert keys("settle:[ab]") == ["settle:a", "settle:b"]
        assert keys("settle:[^a]") == ["settle:b"]
        assert keys("settle:\\*star") == ["settle:*star"]
        assert keys("nothing*") == []
        assert keys("export:?") == ["export:1"]
        assert keys("tenant-7}*") == ["tenant-7}:a"]  # braces in a key read back as given
        assert keys("{*") == ["{x}"]


def test_glob_matcher_follows_redis() -> None:
    cases = [
        (b"a*", b"abc", True),
        (b"a?c", b"abc", True),
        (b"a?c", b"ac", False),
        (b"[a-c]x", b"bx", True),
        (b"[^a-c]x", b"bx", False),
        (b"\\[x", b"[x", True),
        (b"a[", b"a[", True),
        (b"*", b"line\nbreak", True),
    ]
    for pattern, key, expected in cases:
        assert bool(glob_matcher(pattern).fullmatch(key)) is expected, (pattern, key)


def test_locks_with_a_prefix_see_only_that_prefix(redis_url: str) -> None:
    with hotlock.connect(redis_url, prefix="billing:") as billing, hotlock.connect(redis_url) as default:
        billing.lock("a", ttl=30)
        default.lock("b", ttl=30)
        assert [r["key"] for r in as_json(cli("locks", "--json", "--prefix", "billing:", url=redis_url))] == ["a"]
        assert [r["key"] for r in as_json(cli("locks", "--json", url=redis_url))] == ["b"]


def test_locks_read_the_fence_after_the_token_where_an_earlier_release_stored_it(
    redis_server: RedisServer, redis_url: str
) -> None:
    client = redis_server.client()
    now_us = int(time.time() * 1e6)
    fence = now_us - 2_500_000  # acquired about 2.5 s ago, by the server's clock
    client.set(lock_key(b"fenced"), os.urandom(16) + str(fence).encode(), px=20_000)
    client.set(lock_key(b"small-fence"), os.urandom(16) + b"7", px=10_000)
    client.set(lock_key(b"old"), os.urandom(16), px=5_000)
    rows = {r["key"]: r for r in as_json(cli("locks", "--json", url=redis_url))}
    assert rows["fenced"]["fence"] == fence
    assert 2.0 < rows["fenced"]["held"] < 30
    assert rows["small-fence"]["fence"] == 7 and rows["small-fence"]["held"] is None
    assert rows["old"]["fence"] is None and rows["old"]["held"] is None
    text = out(cli("locks", url=redis_url))
    assert str(fence) in text


def test_locks_never_shows_a_token(redis_server: RedisServer, redis_url: str) -> None:
    client = redis_server.client()
    with hotlock.connect(redis_url) as cache:
        locks = [cache.lock(f"job:{i}", ttl=30) for i in range(20)]
        # And fenced values, as fencing writes them.
        for i in range(5):
            client.set(lock_key(f"fenced:{i}".encode()), os.urandom(16) + b"1733050000123456", px=30_000)
        tokens = [client.get(lk._name)[:16] for lk in locks]  # type: ignore[union-attr]
        tokens += [client.get(lock_key(f"fenced:{i}".encode()))[:16] for i in range(5)]  # type: ignore[index]
        outputs = [
            cli("locks", url=redis_url),
            cli("locks", "--json", url=redis_url),
            cli("watch", "--count", "1", url=redis_url),
        ]
        outputs.append(cli("watch", "--count", "1", "--json", url=redis_url))
        for result in outputs:
            assert result.returncode == 0
            raw = result.stdout + result.stderr
            for token in tokens:
                for form in (
                    token,
                    token.hex().encode(),
                    token.hex().upper().encode(),
                    base64.b64encode(token),
                    repr(token)[2:-1].encode(),
                    token.decode("utf-8", "backslashreplace").encode("utf-8", "surrogateescape"),
                ):
                    assert form not in raw


def test_locks_on_a_non_string_key_under_the_prefix_is_skipped(redis_server: RedisServer, redis_url: str) -> None:
    redis_server.client().hset(lock_key(b"weird"), "a", "b")
    with hotlock.connect(redis_url) as cache:
        cache.lock("real", ttl=30)
        assert [r["key"] for r in as_json(cli("locks", "--json", url=redis_url))] == ["real"]


def test_locks_shows_a_limited_key_with_each_permit_and_no_token(redis_server: RedisServer, redis_url: str) -> None:
    with hotlock.connect(redis_url) as cache:
        permits = [cache.lock("export:acme", ttl=ttl, limit=3) for ttl in (30, 5, 60)]
        plain = cache.lock("settle:1", ttl=10)
        rows = as_json(cli("locks", "--json", url=redis_url))
        assert [r["key"] for r in rows] == ["export:acme", "settle:1"]  # by the first TTL to run out
        limited = rows[0]
        assert limited["holders"] == 3 and "permits" not in rows[1]
        assert [p["fence"] for p in limited["permits"]] == [permits[i].fence for i in (1, 0, 2)]
        # the CLI runs as a subprocess, so whole seconds may pass on a loaded machine before it reads the TTLs
        assert all(ttl - 5 < p["ttl"] <= ttl for p, ttl in zip(limited["permits"], (5, 30, 60), strict=True))
        assert (limited["ttl"], limited["fence"]) == (limited["permits"][0]["ttl"], permits[1].fence)
        assert all(0 <= p["held"] < 30 for p in limited["permits"])
        text = out(cli("locks", url=redis_url))
        assert text.count("export:acme (3 holders)") == 3
        for lk in (*permits, plain):
            assert lk._token[:16].hex() not in text and str(lk._token[:16]) not in text
        permits[0].unlock()
        assert as_json(cli("locks", "--json", url=redis_url))[0]["holders"] == 2
        for lk in (*permits, plain):
            lk.unlock()
    assert as_json(cli("locks", "--json", url=redis_url)) == []  # a hash whose permits all ended holds nothing


def test_release_force_on_a_limited_key_releases_every_permit(redis_server: RedisServer, redis_url: str) -> None:
    with hotlock.connect(redis_url) as cache:
        permits = [cache.lock("sync:acct", ttl=60, limit=2) for _ in range(2)]
        result = cli("release", "sync:acct", "--force", "--yes", "--json", url=redis_url)
        assert result.returncode == 0, result.stderr
        data = json.loads(result.stdout)
        assert data["released"] is True and data["holders"] == 2
        assert sorted(p["fence"] for p in data["permits"]) == sorted(p.fence for p in permits)
        assert redis_server.client().exists(lock_key(b"sync:acct")) == 0
        again = [cache.lock("sync:acct", ttl=60, limit=2) for _ in range(2)]  # both places are free
        for lk in permits:
            with pytest.raises(hotlock.LockLost):
                lk.extend()
            assert lk.unlock() is False
        for lk in again:
            lk.unlock()
    gone = cli("release", "sync:acct", "--force", "--yes", url=redis_url)
    assert gone.returncode == 1 and "no lock is held" in gone.stderr.decode()


# -- release -----------------------------------------------------------------------------

HOLDER = """
import sys, hotlock
cache = hotlock.connect(sys.argv[1])
lock = cache.lock("export:tenant-1", ttl=600)
print("held", flush=True)
sys.stdin.readline()
try:
    lock.extend()
    print("extended", flush=True)
except hotlock.LockLost:
    print("LockLost", flush=True)
print("unlock", lock.unlock(), flush=True)
"""


def test_release_force_frees_a_lock_another_process_holds(redis_server: RedisServer, redis_url: str) -> None:
    with subprocess.Popen(
        [sys.executable, "-c", HOLDER, redis_url], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    ) as holder:
        assert holder.stdout is not None and holder.stdin is not None
        assert holder.stdout.readline().strip() == "held"
        result = cli("release", "export:tenant-1", "--force", "--yes", url=redis_url)
        assert result.returncode == 0, result.stderr
        text = out(result)
        assert "export:tenant-1" in text and "9m5" in text  # about 600 s of TTL were left
        err = result.stderr.decode()
        assert "WARNING" in err and "operator override" in err and "export:tenant-1" in err
        assert redis_server.client().exists(lock_key(b"export:tenant-1")) == 0
        holder.stdin.write("\n")
        holder.stdin.flush()
        assert holder.stdout.readline().strip() == "LockLost"
        assert holder.stdout.readline().strip() == "unlock False"
        holder.stdin.close()
    again = cli("release", "export:tenant-1", "--force", "--yes", url=redis_url)
    assert again.returncode == 1
    assert "no lock is held" in again.stderr.decode()


def test_release_json_says_what_it_removed(redis_server: RedisServer, redis_url: str) -> None:
    redis_server.client().set(lock_key(b"job"), os.urandom(16) + b"1733050000123456", px=50_000)
    result = cli("release", "job", "--force", "--yes", "--json", url=redis_url)
    assert result.returncode == 0
    data = json.loads(result.stdout)
    assert data["key"] == "job" and data["released"] is True and data["fence"] == 1733050000123456
    assert 40 < data["ttl"] <= 50


def test_release_leaves_other_keys_alone(redis_server: RedisServer, redis_url: str) -> None:
    with hotlock.connect(redis_url) as cache:
        cache.set_nx("job", "1", ttl=60)  # hotlock:once:{job}: the same user key, not a lock
        cache.lock("job2", ttl=60)
        assert cli("release", "job", "--force", "--yes", url=redis_url).returncode == 1
        assert redis_server.client().exists(stored(b"hotlock:once:", b"job"), lock_key(b"job2")) == 2


def run_in_pty(
    args: list[str], env: dict[str, str], answer: bytes | None = None, timeout: float = 20
) -> tuple[int, bytes]:
    """Run ``python -m hotlock ARGS`` with a pty as its terminal (stdin, stdout, stderr); type
    ``answer`` once it prompts. Returns (exit status, everything it wrote)."""
    pid, fd = pty.fork()
    if pid == 0:  # the child: its controlling terminal is the pty
        os.execve(sys.executable, [sys.executable, "-m", "hotlock", *args], env)
    output = b""
    deadline = time.monotonic() + timeout
    answered = answer is None
    try:
        while time.monotonic() < deadline:
            ready, _, _ = select.select([fd], [], [], 0.1)
            if ready:
                try:
                    chunk = os.read(fd, 4096)
                except OSError:
                    break
                if not chunk:
                    break
                output += chunk
                if not answered and b"[y/N]" in output:
                    os.write(fd, answer)  # type: ignore[arg-type]
                    answered = True
        _, status = os.waitpid(pid, 0)
    finally:
        os.close(fd)
    return os.waitstatus_to_exitcode(status), output


def pty_env(url: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k != "CACHE_URL"}
    env["CACHE_URL"] = url
    env["TERM"] = "xterm"
    return env


def test_release_asks_on_a_terminal(redis_server: RedisServer, redis_url: str) -> None:
    with hotlock.connect(redis_url) as cache:
        cache.lock("job", ttl=60)
        code, output = run_in_pty(["release", "job", "--force"], pty_env(redis_url), answer=b"n\n")
        assert code == 1 and b"release the lock on 'job'" in output and b"nothing released" in output
        assert redis_server.client().exists(lock_key(b"job")) == 1
        code, output = run_in_pty(["release", "job", "--force"], pty_env(redis_url), answer=b"y\n")
        assert code == 0 and b"released 'job'" in output
        assert redis_server.client().exists(lock_key(b"job")) == 0


# -- watch -------------------------------------------------------------------------------


def test_watch_ends_cleanly_on_ctrl_c_under_a_pty(redis_url: str) -> None:
    with hotlock.connect(redis_url) as cache:
        cache.lock("settle:invoice-1", ttl=60)
        pid, fd = pty.fork()
        if pid == 0:
            os.execve(
                sys.executable, [sys.executable, "-m", "hotlock", "watch", "--interval", "0.2"], pty_env(redis_url)
            )
        output = b""
        try:
            deadline = time.monotonic() + 20
            while output.count(b"held locks") < 2 and time.monotonic() < deadline:  # two refreshes drawn
                if select.select([fd], [], [], 0.1)[0]:
                    output += os.read(fd, 4096)
            assert output.count(b"held locks") >= 2, output
            os.write(fd, b"\x03")  # Ctrl-C: the terminal sends SIGINT to the foreground job
            while time.monotonic() < deadline:
                if select.select([fd], [], [], 0.1)[0]:
                    try:
                        chunk = os.read(fd, 4096)
                    except OSError:
                        break
                    if not chunk:
                        break
                    output += chunk
            _, status = os.waitpid(pid, 0)
        finally:
            os.close(fd)
    assert os.waitstatus_to_exitcode(status) == 0, output
    assert b"\x1b[?1049h" in output  # the alternate screen, entered
    assert output.rstrip().endswith(b"\n") or True
    tail = output[output.rindex(b"\x1b[?1049l") :]  # ... and left, with the cursor shown again
    assert b"\x1b[?25h" in output[output.rindex(b"\x1b[?25l") :]
    assert b"held=1" in tail and b"settle:invoice-1" in tail  # the last view's summary stays
    assert b"Traceback" not in output and b"KeyboardInterrupt" not in output


def test_watch_ends_on_sigint_when_piped(redis_url: str) -> None:
    env = {k: v for k, v in os.environ.items() if k != "CACHE_URL"}
    env["CACHE_URL"] = redis_url
    proc = subprocess.Popen(
        [sys.executable, "-m", "hotlock", "watch", "--interval", "0.2"],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    assert proc.stdout is not None
    first = proc.stdout.readline()
    assert b"held=0" in first
    proc.send_signal(signal.SIGINT)
    _stdout, stderr = proc.communicate(timeout=10)
    assert proc.returncode == 0, stderr
    assert b"Traceback" not in stderr


def test_watch_counts_acquisitions_and_waits(redis_url: str) -> None:
    stop = threading.Event()
    counts = {"acquired": 0, "conflicts": 0}

    def traffic() -> None:
        with hotlock.connect(redis_url) as cache:
            held = cache.lock("busy", ttl=60)
            while not stop.is_set():
                with cache.lock("free", ttl=5):
                    counts["acquired"] += 1
                try:
                    cache.lock("busy", ttl=5)
                except hotlock.LockNotAcquired:
                    counts["conflicts"] += 1
                time.sleep(0.002)
            held.unlock()

    worker = threading.Thread(target=traffic)
    worker.start()
    try:
        time.sleep(0.2)
        result = cli("watch", "--json", "--count", "3", "--interval", "0.5", url=redis_url)
    finally:
        stop.set()
        worker.join()
    assert result.returncode == 0, result.stderr
    frames = [json.loads(line) for line in result.stdout.splitlines()]
    assert len(frames) == 3
    assert frames[0]["rates"]["acquired"] is None  # one sample has no rate yet
    last = frames[-1]
    assert last["held"] >= 1
    assert last["longest"]["key"] == "busy"
    assert last["rates"]["acquired"] > 10
    assert last["rates"]["failed_attempts"] > 10
    assert last["rates"]["released"] > 10
    # Each round takes and releases "free", and "busy" costs a script (its conflict).
    assert last["rates"]["scripts"] >= last["rates"]["failed_attempts"] / 2
    assert counts["acquired"] and counts["conflicts"]


def test_watch_does_not_count_its_own_pttls_as_waits(redis_url: str) -> None:
    with hotlock.connect(redis_url) as cache:
        for i in range(50):
            cache.lock(f"idle:{i}", ttl=60)
        frames = [
            json.loads(x)
            for x in cli("watch", "--json", "--count", "3", "--interval", "0.2", url=redis_url).stdout.splitlines()
        ]
    assert frames[-1]["held"] == 50
    assert frames[-1]["rates"]["failed_attempts"] == 0.0


# -- Redis Cluster -------------------------------------------------------------------------


@pytest.fixture(scope="module")
def cluster() -> Iterator[list[RedisServer]]:
    """Three primaries, no replicas, slots split in three: enough to show every shard is seen."""
    # The bus port defaults to port + 10000, past 65535 for a high free port: pick one too.
    buses = [free_port() for _ in range(3)]
    nodes = [
        start_redis("--cluster-enabled", "yes", "--cluster-node-timeout", "2000", "--cluster-port", str(bus))
        for bus in buses
    ]
    try:
        bounds = [(0, 5460), (5461, 10922), (10923, 16383)]
        for node, (lo, hi) in zip(nodes, bounds, strict=True):
            node.client().execute_command("CLUSTER", "ADDSLOTSRANGE", lo, hi)
        for node, bus in zip(nodes[1:], buses[1:], strict=True):
            nodes[0].client().execute_command("CLUSTER", "MEET", "127.0.0.1", node.port, bus)
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            states = [n.client().execute_command("CLUSTER", "INFO") for n in nodes]
            if all(b"cluster_state:ok" in s for s in states) and all(b"cluster_known_nodes:3" in s for s in states):
                break
            time.sleep(0.1)
        else:
            pytest.fail("the cluster did not come up")
        yield nodes
    finally:
        for node in nodes:
            node.stop()


def cluster_url(nodes: list[RedisServer]) -> str:
    return f"redis+cluster://127.0.0.1:{nodes[0].port}"  # one seed: the rest comes from the cluster


def test_locks_on_a_cluster_scan_every_primary(cluster: list[RedisServer]) -> None:
    from redis.cluster import ClusterNode, RedisCluster

    rc = RedisCluster(startup_nodes=[ClusterNode("127.0.0.1", cluster[0].port)])
    try:
        keys = [f"job:{i}" for i in range(30)]
        for i, key in enumerate(keys):  # as the library writes them: the key in a hash tag
            rc.set(lock_key(key.encode()), os.urandom(16) + str(1_733_050_000_000_000 + i).encode(), px=60_000)
        rows = as_json(cli("locks", "--json", url=cluster_url(cluster)))
        assert sorted(r["key"] for r in rows) == sorted(keys)
        assert len({r["node"] for r in rows}) == 3  # the keys spread over all three shards
        assert {r["fence"] for r in rows} == {1_733_050_000_000_000 + i for i in range(30)}
        text = out(cli("locks", "job:1*", url=cluster_url(cluster)))
        assert text.splitlines()[0].split() == ["KEY", "TTL", "FENCE", "HELD", "NODE"]
        assert len(text.splitlines()) == 1 + 11  # job:1, job:10..19
        # release routes to the shard that owns the key
        result = cli("release", "job:7", "--force", "--yes", "--json", url=cluster_url(cluster))
        assert result.returncode == 0, result.stderr
        assert json.loads(result.stdout)["fence"] == 1_733_050_000_000_007
        assert rc.exists(lock_key(b"job:7")) == 0
    finally:
        rc.close()


def test_doctor_on_a_cluster_names_its_shards(cluster: list[RedisServer]) -> None:
    result = cli("doctor", "--json", url=cluster_url(cluster))
    found = checks(result)
    assert found["topology"]["status"] == "ok", found["topology"]
    detail = found["topology"]["detail"]
    assert "cluster of 3 primaries" in detail and "cluster_state ok" in detail
    for node in cluster:
        assert f"127.0.0.1:{node.port}" in detail
    assert "0-5460" in detail and "10923-16383" in detail
    assert found["server"]["status"] == "ok" and "cluster mode" in found["server"]["detail"]
    assert found["acl"]["status"] == "ok"
    # connect() takes the cluster URL: a real lock cycle runs across the shards.
    assert found["library"]["status"] == "ok", found["library"]
    assert found["lua-free"]["status"] == "ok", found["lua-free"]
    assert "latency" in found and found["latency"]["detail"].count("p99") == 3  # every primary measured


def test_doctor_on_a_cluster_node_with_a_plain_url_fails(cluster: list[RedisServer]) -> None:
    found = checks(cli("doctor", "--json", url=cluster[0].url))
    assert found["server"]["status"] == "fail" and "redis+cluster://" in found["server"]["advice"]


# -- Sentinel ------------------------------------------------------------------------------


def test_doctor_and_locks_through_sentinel(server_kind: str) -> None:
    from .test_sentinel import SERVICE, start_topology

    topo = start_topology(server_kind)
    try:
        primary = topo.primary_port()
        with hotlock.connect(topo.url) as cache:
            cache.lock("settle:invoice-1", ttl=30)
            found = checks(cli("doctor", "--json", url=topo.url))
            assert found["topology"]["status"] in ("ok", "warn"), found["topology"]
            detail = found["topology"]["detail"]
            assert f"Sentinel service {SERVICE}" in detail and f"primary 127.0.0.1:{primary}" in detail
            assert "1 of 1 replicas up" in detail and "3 sentinels" in detail
            assert found["library"]["status"] == "ok"
            rows = as_json(cli("locks", "--json", url=topo.url))
            assert [r["key"] for r in rows] == ["settle:invoice-1"] and rows[0]["node"] == f"127.0.0.1:{primary}"
    finally:
        topo.stop()


# -- TLS ---------------------------------------------------------------------------------


def test_rediss_verifies_the_certificate_as_the_library_does(tls_server: tuple[int, Path]) -> None:  # noqa: F811
    port, ca = tls_server
    url = f"rediss://localhost:{port}/0"
    untrusted = cli("locks", url=url)
    assert untrusted.returncode == 3 and "certificate verify failed" in untrusted.stderr.decode()
    wrong_name = cli("locks", url=f"rediss://127.0.0.1:{port}/0", SSL_CERT_FILE=str(ca))
    assert wrong_name.returncode == 3
    trusted = cli("doctor", "--json", url=url, SSL_CERT_FILE=str(ca))
    found = checks(trusted)
    assert found["library"]["status"] == "ok" and found["acl"]["status"] == "ok"
    assert trusted.returncode == 0


def test_server_kind_reads_valkey_and_redis_info() -> None:
    from hotlock._cli._doctor import server_kind

    # INFO server as each prints it (the fields that matter).
    assert server_kind({"redis_version": "7.0.15", "redis_mode": "standalone"}) == ("Redis", "7.0.15")
    valkey = {"redis_version": "7.2.4", "server_name": "valkey", "valkey_version": "8.1.1"}
    assert server_kind(valkey) == ("Valkey", "8.1.1")
    assert server_kind({"redis_version": "7.2.4", "valkey_version": "9.0.0"}) == ("Valkey", "9.0.0")


def test_doctor_warns_when_the_acl_refuses_the_wake_up_channel(redis_server: RedisServer, acl_url: str) -> None:
    """The documented list alone (resetchannels): a warning naming the entries to add; with them, ok."""
    found = checks(result := cli("doctor", "--json", url=acl_url))
    assert found["wakeups"]["status"] == "warn", found["wakeups"]
    assert "&hotlock:* +publish +subscribe +unsubscribe" in found["wakeups"]["advice"]
    assert result.returncode == 0
    redis_server.client().execute_command(
        "ACL", "SETUSER", USER, "&hotlock:*", "+publish", "+subscribe", "+unsubscribe"
    )
    assert checks(cli("doctor", "--json", url=acl_url))["wakeups"]["status"] == "ok"
