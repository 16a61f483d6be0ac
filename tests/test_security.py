"""Least privilege and secrets: the documented ACL command list is enough
and each entry is needed; keys outside the prefix are refused; rediss:// verifies the
certificate and the hostname by default; tokens and passwords never reach logs, reprs or
exception text.
"""

from __future__ import annotations

import asyncio
import base64
import logging
import shutil
import signal
import subprocess
import tempfile
import time
import traceback
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis

import hotlock
import hotlock.aio
from hotlock import CacheError, LockLost, LockNotAcquired
from hotlock.backends.native import native_aio

from .conftest import REQUIRE_NATIVE, RedisServer, free_port, lock_name
from .faultproxy import FaultProxy

USER = "hotlock_sec"
# What an ACL refusal reads like: NOPERM for a command sent, and for a command a script
# calls, Redis 7's "The user executing the script can't run this command".
REFUSED = r"(?i)noperm|no permissions|can't run this command"
PASSWORD = "pw-s3cr3t-Qx7"  # scanned for in every log line, repr and exception text

# The lists of docs/operations.md: what hotlock sends, and what its scripts call (Redis 7 and Valkey
# check the commands a script runs against the user too). +select only for a db other
# than 0, +wait only with wait_replicas, +info only so connect() can check the server and
# its maxmemory-policy, +command|info only so connect() can ask for DELIFEQ/DELEX (refused,
# the version decides).
SCRIPT_PATH = [
    "+evalsha",
    "+script|load",
    "+multi",
    "+exec",
    "+get",
    "+set",
    "+pttl",
    "+pexpire",
    "+del",
    "+time",
    "+incrby",
    "+info",
    "+select",
    "+wait",
]
# Valkey 9 with connect()'s default scripts="auto": extend is SET IFEQ, release DELIFEQ; only
# the acquire is a script (GET, SET, PTTL, TIME inside). No +pexpire, no +del.
VALKEY_LUA_FREE = [
    "+evalsha",
    "+script|load",
    "+multi",
    "+exec",
    "+get",
    "+set",
    "+pttl",
    "+time",
    "+delifeq",
    "+incrby",
    "+info",
    "+command|info",
    "+select",
    "+wait",
]
# The script path's list under its old name (tests/test_cli.py checks `hotlock doctor` with it).
COMMANDS = SCRIPT_PATH
OPTIONAL = ("+info", "+wait", "+command|info", "+multi", "+exec")
# Every entry some list has, on each server (an ACL naming a command the server lacks is refused).
KNOWN = {"redis": SCRIPT_PATH, "valkey": [*SCRIPT_PATH, "+delifeq", "+command|info"]}
# The path under test: connect(scripts=...). On Redis 7.0 both are the script path.
PATHS = ["auto", "always"]


def listed(kind: str, scripts: str) -> list[str]:
    """The documented list for this server kind and path."""
    return VALKEY_LUA_FREE if kind == "valkey" and scripts == "auto" else SCRIPT_PATH


def acl_line(commands: list[str], keys: str = "~hotlock:*") -> list[str]:
    return ["on", f">{PASSWORD}", "resetkeys", keys, "resetchannels", "-@all", *commands]


@pytest.fixture(params=PATHS)
def scripts(request: pytest.FixtureRequest) -> str:
    path: str = request.param
    return path


@pytest.fixture
def acl_user(redis_server: RedisServer, redis_url: str, scripts: str) -> Iterator[str]:
    """The restricted user's URL on db 1 (so SELECT is exercised too), with the list of
    this server kind and path."""
    client = redis_server.client()
    client.execute_command("ACL", "SETUSER", USER, "reset", *acl_line(listed(redis_server.kind, scripts)))
    yield f"redis://{USER}:{PASSWORD}@127.0.0.1:{redis_server.port}/1"
    client.execute_command("ACL", "DELUSER", USER)


def exercise(cache: hotlock.Cache) -> None:
    """Every key operation of the API once."""
    lock = cache.lock("a", ttl=5)
    with pytest.raises(LockNotAcquired):
        cache.lock("a", ttl=5)
    lock.extend(5)
    assert lock.unlock() is True
    cache.lock_wait("b", ttl=5, wait=0.1).unlock()
    assert cache.with_lock("c", 5, lambda: 42) == 42
    locks = cache.lock_many(["d", "e"], ttl=5)
    assert cache.extend_many(locks, 5) == [True, True]
    assert cache.unlock_many(locks) == [True, True]
    assert cache.set_nx("once", "1", ttl=5) is True
    assert cache.incr("n") == 1


def test_the_readme_acl_list_is_enough(
    redis_backend: str, acl_user: str, scripts: str, redis_server: RedisServer, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level("INFO", logger="hotlock")
    with hotlock.connect(acl_user, backend=redis_backend, scripts=scripts) as cache:
        # The path whose list this is: Lua-free on Valkey 9 by default, else the scripts.
        assert cache.server_info["lua_free"] is (redis_server.lua_free and scripts == "auto")
        exercise(cache)
    # INFO was allowed: the version and the policy were checked, nothing said about an ACL.
    assert redis_server.named in caplog.text and "refused" not in caplog.text
    assert redis_server.client().execute_command("ACL", "WHOAMI") == b"default"


def test_keys_outside_the_prefix_are_refused(redis_backend: str, acl_user: str, scripts: str) -> None:
    with hotlock.connect(acl_user, backend=redis_backend, prefix="elsewhere:", scripts=scripts) as cache:
        for call in (
            lambda: cache.lock("a", ttl=5),
            lambda: cache.lock_many(["a", "b"], ttl=5),
            lambda: cache.set_nx("once", "1", ttl=5),
            lambda: cache.incr("n"),
        ):
            with pytest.raises(CacheError, match=REFUSED):
                call()


@pytest.mark.parametrize("missing", [c for c in KNOWN["valkey"] if c not in OPTIONAL])
def test_each_listed_command_is_needed_and_no_other(
    redis_backend: str, acl_user: str, scripts: str, redis_server: RedisServer, missing: str
) -> None:
    """Each entry of the list for this server and path is needed (without it the API fails
    NOPERM); each entry that only another path's list has is not (the user may have every
    command the server knows but that one, and the API works: this path never sends it)."""
    if missing not in KNOWN[redis_server.kind]:
        # Redis 7.0 has no DELIFEQ and a COMMAND INFO hotlock never sends there: no ACL to test.
        assert redis_server.kind == "redis" and missing in ("+delifeq", "+command|info")
        return
    needed = listed(redis_server.kind, scripts)
    allowed = needed if missing in needed else KNOWN[redis_server.kind]
    redis_server.client().execute_command(
        "ACL", "SETUSER", USER, "reset", *acl_line([c for c in allowed if c != missing])
    )
    if missing in needed:
        with (
            pytest.raises(CacheError, match=REFUSED),
            hotlock.connect(acl_user, backend=redis_backend, scripts=scripts) as cache,
        ):
            exercise(cache)
    else:
        with hotlock.connect(acl_user, backend=redis_backend, scripts=scripts) as cache:
            exercise(cache)


def test_command_is_optional_the_version_decides(
    redis_backend: str, acl_user: str, scripts: str, redis_server: RedisServer
) -> None:
    """An ACL that refuses COMMAND: connect() falls back to the version, so Valkey 9 still
    gets the Lua-free path, and the list without +command|info is enough."""
    commands = [c for c in listed(redis_server.kind, scripts) if c != "+command|info"]
    redis_server.client().execute_command("ACL", "SETUSER", USER, "reset", *acl_line(commands))
    with hotlock.connect(acl_user, backend=redis_backend, scripts=scripts) as cache:
        assert cache.server_info["lua_free"] is (redis_server.lua_free and scripts == "auto")
        if cache.server_info["lua_free"]:
            assert "the version (COMMAND refused)" in str(cache.server_info["reason"])
        exercise(cache)


def test_info_is_optional_and_wait_is_needed_for_wait_replicas(
    redis_backend: str, acl_user: str, redis_server: RedisServer, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level("INFO", logger="hotlock")
    redis_server.client().execute_command(
        "ACL", "SETUSER", USER, "reset", *acl_line([c for c in SCRIPT_PATH if c not in ("+info", "+wait")])
    )
    with hotlock.connect(acl_user, backend=redis_backend) as cache:
        exercise(cache)
    assert "INFO is refused" in caplog.text
    with (
        hotlock.connect(acl_user, backend=redis_backend, wait_replicas=1) as cache,
        pytest.raises(CacheError, match=REFUSED),
    ):
        cache.lock("w", ttl=5)
    redis_server.client().execute_command("ACL", "SETUSER", USER, "+wait")
    # Allowed now; with no replica to confirm, the acquire is undone.
    cache = hotlock.connect(acl_user, backend=redis_backend, wait_replicas=1, wait_timeout=0.05)
    try:
        with pytest.raises(CacheError, match="0 of 1 replicas"):
            cache.lock("w", ttl=5)
    finally:
        cache.close()


# -- TLS ------------------------------------------------------------------------------


def _openssl(*args: str, cwd: Path) -> None:
    subprocess.run(["openssl", *args], cwd=cwd, check=True, capture_output=True, timeout=60)


@pytest.fixture(scope="module")
def tls_server() -> Iterator[tuple[int, Path]]:
    """redis-server with TLS only, its certificate for DNS:localhost, signed by a CA made here."""
    exe = shutil.which("redis-server")
    if shutil.which("openssl") is None or exe is None:
        pytest.fail("openssl and redis-server are needed (make test installs them)")
    d = Path(tempfile.mkdtemp(prefix="hotlock-tls-"))
    _openssl("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", "ca.key", "-out", "ca.crt", "-days", "2",
             "-subj", "/CN=hotlock test CA", "-addext", "basicConstraints=critical,CA:TRUE",
             "-addext", "keyUsage=critical,keyCertSign,cRLSign", cwd=d)  # fmt: skip
    _openssl("req", "-newkey", "rsa:2048", "-nodes", "-keyout", "server.key", "-out", "server.csr",
             "-subj", "/CN=localhost", cwd=d)  # fmt: skip
    (d / "ext.cnf").write_text(
        "subjectAltName=DNS:localhost\nbasicConstraints=CA:FALSE\n"
        "keyUsage=digitalSignature,keyEncipherment\nextendedKeyUsage=serverAuth\n"
    )
    _openssl("x509", "-req", "-in", "server.csr", "-CA", "ca.crt", "-CAkey", "ca.key", "-CAcreateserial",
             "-out", "server.crt", "-days", "2", "-extfile", "ext.cnf", cwd=d)  # fmt: skip
    port = free_port()
    proc = subprocess.Popen(
        [exe, "--port", "0", "--tls-port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
         "--dir", str(d), "--tls-cert-file", "server.crt", "--tls-key-file", "server.key",
         "--tls-ca-cert-file", "ca.crt", "--tls-auth-clients", "no", "--loglevel", "warning",
         "--logfile", str(d / "redis.log")],
        cwd=d, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip
    try:
        client = redis.Redis(host="localhost", port=port, ssl=True, ssl_ca_certs=str(d / "ca.crt"), socket_timeout=2)
        deadline = time.monotonic() + 10
        while True:
            try:
                client.ping()
                break
            except redis.ConnectionError:
                if proc.poll() is not None or time.monotonic() > deadline:
                    pytest.fail(f"TLS redis-server did not start: {(d / 'redis.log').read_text()[-2000:]}")
                time.sleep(0.05)
        client.close()
        yield port, d / "ca.crt"
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        shutil.rmtree(d, ignore_errors=True)


def test_rediss_refuses_an_unknown_ca_by_default(tls_server: tuple[int, Path], monkeypatch: pytest.MonkeyPatch) -> None:
    port, _ = tls_server
    monkeypatch.delenv("SSL_CERT_FILE", raising=False)
    with pytest.raises(CacheError, match=r"(?i)certificate verify failed"):
        hotlock.connect(f"rediss://localhost:{port}/0", timeout=2)


def test_rediss_verifies_the_hostname_by_default(tls_server: tuple[int, Path], monkeypatch: pytest.MonkeyPatch) -> None:
    port, ca = tls_server
    monkeypatch.setenv("SSL_CERT_FILE", str(ca))  # the CA is trusted: only the name is wrong
    with pytest.raises(CacheError, match=r"(?i)hostname|IP address mismatch|doesn't match"):
        hotlock.connect(f"rediss://127.0.0.1:{port}/0", timeout=2)


def test_rediss_with_a_trusted_ca_and_the_right_name_works(
    tls_server: tuple[int, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    port, ca = tls_server
    monkeypatch.setenv("SSL_CERT_FILE", str(ca))
    with hotlock.connect(f"rediss://localhost:{port}/0", timeout=2) as cache:
        assert cache.server == f"rediss://localhost:{port}/0"
        exercise(cache)


# -- secrets --------------------------------------------------------------------------


def _forms(secret: bytes) -> list[str]:
    """The ways a secret could leak into text: raw, repr'd, hex, base64."""
    return [
        secret.decode("latin-1"),
        repr(secret)[2:-1],
        secret.hex(),
        secret.hex().upper(),
        base64.b64encode(secret).decode(),
    ]


def test_tokens_and_passwords_never_reach_logs_reprs_or_errors(
    redis_backend: str, acl_user: str, scripts: str, redis_server: RedisServer, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG)  # every logger, redis-py's included
    texts: list[str] = []
    tokens: list[bytes] = []

    def seen(exc: BaseException) -> None:
        texts.append(str(exc))
        texts.append(repr(exc))
        texts.append("".join(traceback.format_exception(exc)))  # the chained causes too

    with FaultProxy(redis_server.port, db=1) as proxy:
        url = proxy.url.replace("redis://", f"redis://{USER}:{PASSWORD}@")
        cache = hotlock.connect(url, backend=redis_backend, timeout=0.3, scripts=scripts)
        try:
            texts.append(repr(cache))
            lock = cache.lock("secret", ttl=5)
            tokens.append(lock._token)
            texts.append(repr(lock))
            try:
                cache.lock("secret", ttl=5)
            except LockNotAcquired as exc:
                seen(exc)
            redis_server.client().execute_command("SELECT", 1)
            lost = cache.lock("lost", ttl=5)
            tokens.append(lost._token)
            redis.Redis.from_url(redis_server.url.rsplit("/", 1)[0] + "/1").delete(lock_name("lost"))
            try:
                lost.extend(5)
            except LockLost as exc:
                seen(exc)
            many = cache.lock_many(["m1", "m2"], ttl=5)
            tokens += [m._token for m in many if m is not None]
            texts += [repr(m) for m in many]
            # An outage while holding: the extend fails, the release in the with block fails
            # and is logged as a WARNING.
            with cache.lock("held", ttl=5) as held:
                tokens.append(held._token)
                proxy.blackhole(True)
                try:
                    held.extend(5)
                except CacheError as exc:
                    seen(exc)
            proxy.blackhole(False)
        finally:
            cache.close()
    for url in (
        f"redis://{USER}:wrong-{PASSWORD}@127.0.0.1:{redis_server.port}/1",  # refused credentials
        f"redis://{USER}:{PASSWORD}@127.0.0.1:{free_port()}/1",  # nobody listening
    ):
        try:
            hotlock.connect(url, backend=redis_backend, timeout=0.3, connect_timeout=0.3)
        except CacheError as exc:
            seen(exc)
        else:
            pytest.fail("connect should have failed")
    try:
        hotlock.connect(f"redis://{USER}:{PASSWORD}@127.0.0.1:notaport/1")
    except ValueError as exc:
        seen(exc)
    assert any(r.levelname == "WARNING" and "release" in r.getMessage() for r in caplog.records)
    assert len(texts) > 10 and len(tokens) >= 4
    haystack = caplog.text + "\n".join(texts) + "".join(r.getMessage() for r in caplog.records)
    for secret in [PASSWORD.encode(), *tokens]:
        for form in _forms(secret):
            assert form not in haystack, f"a secret leaked as {form!r}"


def test_config_and_cache_reprs_hide_the_password(redis_backend: str, acl_user: str, scripts: str) -> None:
    from hotlock._config import parse_url

    config = parse_url(acl_user, connect_timeout=1, timeout=1)
    with hotlock.connect(acl_user, backend=redis_backend, scripts=scripts) as cache:
        for text in (repr(config), config.display, repr(cache), cache.server, str(hotlock.backend_info())):
            assert PASSWORD not in text


AIO_BACKENDS = ["redis-py"] + (["native"] if native_aio()[0] is not None or REQUIRE_NATIVE else [])


@pytest.mark.parametrize("aio_backend", AIO_BACKENDS)
def test_the_readme_acl_list_is_enough_for_the_async_api(aio_backend: str, acl_user: str, scripts: str) -> None:
    async def main() -> None:
        async with await hotlock.aio.connect(acl_user, backend=aio_backend, scripts=scripts) as cache:
            lock = await cache.lock("a", ttl=5)
            with pytest.raises(LockNotAcquired):
                await cache.lock("a", ttl=5)
            await lock.extend(5)
            assert await lock.unlock() is True
            await (await cache.lock_wait("b", ttl=5, wait=0.1)).unlock()
            locks = await cache.lock_many(["d", "e"], ttl=5)
            assert await cache.extend_many(locks, 5) == [True, True]
            assert await cache.unlock_many(locks) == [True, True]
            assert await cache.set_nx("once", "1", ttl=5) is True
            assert await cache.incr("n") == 1
        async with await hotlock.aio.connect(
            acl_user, backend=aio_backend, prefix="elsewhere:", scripts=scripts
        ) as cache:
            with pytest.raises(CacheError, match=REFUSED):
                await cache.lock("a", ttl=5)

    asyncio.run(main())


@pytest.mark.parametrize("aio_backend", AIO_BACKENDS)
def test_async_rediss_verifies_certificate_and_hostname(
    aio_backend: str, tls_server: tuple[int, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    port, ca = tls_server

    async def main() -> None:
        monkeypatch.delenv("SSL_CERT_FILE", raising=False)
        with pytest.raises(CacheError, match=r"(?i)certificate verify failed"):
            await hotlock.aio.connect(f"rediss://localhost:{port}/0", backend=aio_backend, timeout=2)
        monkeypatch.setenv("SSL_CERT_FILE", str(ca))
        with pytest.raises(CacheError, match=r"(?i)hostname|IP address mismatch|doesn't match"):
            await hotlock.aio.connect(f"rediss://127.0.0.1:{port}/0", backend=aio_backend, timeout=2)
        for _ in range(5):  # fresh TLS connections, each with the server's session tickets
            async with await hotlock.aio.connect(f"rediss://localhost:{port}/0", backend=aio_backend, timeout=2) as c:
                assert await (await c.lock("tls", ttl=5)).unlock() is True

    asyncio.run(main())
