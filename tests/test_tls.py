"""rediss:// on every backend: the native client's TLS (hotlock._native_tls) and redis-py's.

Two TLS servers started here, with a CA made here: one presenting a certificate for
DNS:localhost that asks no client certificate, one for IP:127.0.0.1 that requires one
(mutual TLS). The settings are redis-py's URL query names on every backend, sync and async.
"""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import tempfile
import textwrap
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

import hotlock
import hotlock.aio
from hotlock.errors import CacheError

from .conftest import REQUIRE_NATIVE
from .test_security import exercise
from .tls import (
    Pki,
    TLSCluster,
    TLSSentinel,
    TLSServer,
    start_tls_cluster,
    start_tls_redis,
    start_tls_sentinel,
)

AIO_BACKENDS = ["native", "redis-py"]


@pytest.fixture(scope="module")
def pki() -> Iterator[Pki]:
    with tempfile.TemporaryDirectory(prefix="hotlock-pki-") as d:
        yield Pki.make(Path(d))


@pytest.fixture(scope="module")
def by_name(pki: Pki) -> Iterator[TLSServer]:
    """TLS for DNS:localhost, no client certificate asked."""
    server = start_tls_redis(pki, "byname", "DNS:localhost")
    yield server
    server.stop()


@pytest.fixture(scope="module")
def mutual(pki: Pki) -> Iterator[TLSServer]:
    """TLS for IP:127.0.0.1 that requires a client certificate signed by the CA."""
    server = start_tls_redis(pki, "mutual", "IP:127.0.0.1", auth_clients="yes")
    yield server
    server.stop()


@pytest.fixture(scope="module")
def client_cert(pki: Pki) -> tuple[Path, Path]:
    return pki.leaf("client", "", usage="clientAuth")


@pytest.fixture(autouse=True)
def _flushed(by_name: TLSServer, mutual: TLSServer) -> None:
    for server in (by_name, mutual):
        server.plain.client().flushall()


def test_the_tls_build_is_loaded() -> None:
    info = hotlock.backend_info()
    if REQUIRE_NATIVE:
        assert info["tls"] == "native", info
        assert info["tls_reason"] is None
        import ssl

        assert info["openssl"] == ssl.OPENSSL_VERSION


def test_rediss_with_the_ca_in_the_url(redis_backend: str, by_name: TLSServer) -> None:
    with hotlock.connect(by_name.url(ssl_ca_certs=str(by_name.ca)), backend=redis_backend, timeout=2) as cache:
        assert cache.backend == redis_backend
        exercise(cache)


def test_rediss_with_the_ca_in_ssl_cert_file(
    redis_backend: str, by_name: TLSServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("SSL_CERT_FILE", str(by_name.ca))
    with hotlock.connect(by_name.url(), backend=redis_backend, timeout=2) as cache:
        assert cache.backend == redis_backend
        exercise(cache)


def test_an_unknown_ca_is_a_cache_error_never_retried(
    redis_backend: str, by_name: TLSServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("SSL_CERT_FILE", raising=False)
    with pytest.raises(CacheError, match=r"(?i)certificate verify failed") as caught:
        hotlock.connect(by_name.url(), backend=redis_backend, timeout=2)
    assert "retried" not in str(caught.value)


def test_a_wrong_hostname_is_refused(redis_backend: str, by_name: TLSServer) -> None:
    with pytest.raises(CacheError, match=r"(?i)IP address mismatch") as caught:
        hotlock.connect(by_name.url("127.0.0.1", ssl_ca_certs=str(by_name.ca)), backend=redis_backend, timeout=2)
    assert "retried" not in str(caught.value)


def test_an_ip_san_counts_and_a_name_it_lacks_does_not(
    redis_backend: str, mutual: TLSServer, client_cert: tuple[Path, Path]
) -> None:
    cert, key = client_cert
    query = {"ssl_ca_certs": str(mutual.ca), "ssl_certfile": str(cert), "ssl_keyfile": str(key)}
    with hotlock.connect(mutual.url("127.0.0.1", **query), backend=redis_backend, timeout=2) as cache:
        exercise(cache)
    with pytest.raises(CacheError, match=r"(?i)hostname mismatch"):
        hotlock.connect(mutual.url("localhost", **query), backend=redis_backend, timeout=2)


def test_a_missing_client_certificate_says_so(redis_backend: str, mutual: TLSServer) -> None:
    """Under TLS 1.3 the server judges the client certificate after the handshake, and its
    alert races the reset that follows it. The native client tells either from a lost
    connection (the server asked for a certificate none is configured for); on the
    redis-py path a reset that wins is a lost handshake reply, tried once more: the second
    try meets the alert, which is not retried, or is cut short too, and the error then
    says a server that requires a client certificate closes the connection so."""
    for _ in range(3):
        with pytest.raises(CacheError, match=r"(?i)certificate required|client certificate") as caught:
            hotlock.connect(mutual.url("127.0.0.1", ssl_ca_certs=str(mutual.ca)), backend=redis_backend, timeout=2)
        if redis_backend == "native":
            assert "retried" not in str(caught.value)


def test_checks_can_be_turned_off_by_name(redis_backend: str, by_name: TLSServer) -> None:
    url = by_name.url("127.0.0.1", ssl_ca_certs=str(by_name.ca), ssl_check_hostname="false")
    with hotlock.connect(url, backend=redis_backend, timeout=2) as cache:
        exercise(cache)
    by_name.plain.client().flushall()
    with hotlock.connect(by_name.url("127.0.0.1", ssl_cert_reqs="none"), backend=redis_backend, timeout=2) as cache:
        exercise(cache)


def test_a_plaintext_client_on_the_tls_port_is_a_cache_error(redis_backend: str, by_name: TLSServer) -> None:
    start = time.monotonic()
    with pytest.raises(CacheError) as caught:
        hotlock.connect(f"redis://127.0.0.1:{by_name.tls_port}/0", backend=redis_backend, timeout=1)
    assert time.monotonic() - start < 10
    if redis_backend == "native":
        assert "rediss://" in str(caught.value)


def test_a_tls_client_on_a_plaintext_port_is_a_cache_error(redis_backend: str, by_name: TLSServer) -> None:
    start = time.monotonic()
    url = f"rediss://localhost:{by_name.plain.port}/0?ssl_ca_certs={by_name.ca}"
    with pytest.raises(CacheError):
        hotlock.connect(url, backend=redis_backend, timeout=0.5, connect_timeout=0.5)
    assert time.monotonic() - start < 10


def test_native_tls_keeps_its_connection_across_session_tickets(by_name: TLSServer) -> None:
    """A TLS 1.3 server's session tickets make an idle socket readable with no reply in it:
    the staleness check must not take them for a dead connection and reconnect."""
    with hotlock.connect(by_name.url(ssl_ca_certs=str(by_name.ca)), backend="native", timeout=2) as cache:
        before = by_name.connections()
        for i in range(50):
            cache.lock(f"t{i}", ttl=5).unlock()
            time.sleep(0.005)  # past the fresh-connection window: every call checks
        assert by_name.connections() == before


@pytest.mark.parametrize("aio_backend", AIO_BACKENDS)
def test_async_rediss_takes_the_same_settings(
    aio_backend: str, by_name: TLSServer, mutual: TLSServer, client_cert: tuple[Path, Path]
) -> None:
    cert, key = client_cert

    async def main() -> None:
        async with await hotlock.aio.connect(
            by_name.url(ssl_ca_certs=str(by_name.ca)), backend=aio_backend, timeout=2
        ) as cache:
            assert await (await cache.lock("a", ttl=5)).unlock() is True
        url = mutual.url("127.0.0.1", ssl_ca_certs=str(mutual.ca), ssl_certfile=str(cert), ssl_keyfile=str(key))
        async with await hotlock.aio.connect(url, backend=aio_backend, timeout=2) as cache:
            assert await (await cache.lock("a", ttl=5)).unlock() is True
        with pytest.raises(CacheError, match=r"(?i)IP address mismatch"):
            await hotlock.aio.connect(by_name.url("127.0.0.1", ssl_ca_certs=str(by_name.ca)), backend=aio_backend)

    asyncio.run(main())


@pytest.mark.parametrize(
    ("url", "match"),
    [
        ("redis://localhost/0?ssl_ca_certs=/etc/hostname", "need a TLS url"),
        ("rediss://localhost/0?ssl_ca_certs=/nonexistent/ca.pem", "names no file"),
        ("rediss://localhost/0?ssl_cert_reqs=maybe", "ssl_cert_reqs must be one of"),
        ("rediss://localhost/0?ssl_check_hostname=perhaps", "ssl_check_hostname must be true or false"),
        ("rediss://localhost/0?ssl_verify=yes", "unknown TLS setting ssl_verify"),
        ("rediss://localhost/0?ssl_keyfile=/etc/hostname", "ssl_keyfile needs ssl_certfile"),
    ],
)
def test_bad_tls_settings_are_refused_before_any_io(url: str, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        hotlock.connect(url)


def test_without_the_tls_build_rediss_runs_on_redis_py_saying_why_once(by_name: TLSServer) -> None:
    code = f"""
        import logging, hotlock
        logging.basicConfig(level=logging.INFO, format="%(name)s %(message)s")
        print(hotlock.backend_info())
        with hotlock.connect({by_name.url(ssl_ca_certs=str(by_name.ca))!r}, timeout=2) as cache:
            print("backend", cache.backend)
            cache.lock("x", ttl=5).unlock()
        with hotlock.connect({by_name.plain.url!r}, timeout=2) as cache:
            print("plaintext", cache.backend)
        """
    proc = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        capture_output=True,
        text=True,
        timeout=100,
        env={**os.environ, "HOTLOCK_NATIVE_TLS": "0"},
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "backend redis-py" in proc.stdout
    assert "plaintext native" in proc.stdout  # plaintext stays native
    assert "'tls': 'redis-py'" in proc.stdout and "HOTLOCK_NATIVE_TLS=0" in proc.stdout
    said = [line for line in proc.stderr.splitlines() if line.startswith("hotlock ") and "redis-py backend" in line]
    assert len(said) == 1 and "HOTLOCK_NATIVE_TLS=0" in said[0], proc.stderr


# -- Sentinel and Cluster over TLS ----------------------------------------------------


SENTINEL_PASSWORD = "sentinel-secret"


@pytest.fixture(scope="module")
def tls_sentinel(pki: Pki) -> Iterator[TLSSentinel]:
    sentinel = start_tls_sentinel(pki, password=SENTINEL_PASSWORD)
    yield sentinel
    sentinel.stop()


@pytest.fixture(scope="module")
def tls_cluster(pki: Pki) -> Iterator[TLSCluster]:
    cluster = start_tls_cluster(pki)
    yield cluster
    cluster.stop()


def test_rediss_sentinel_speaks_tls_to_the_sentinels_and_the_primary(
    redis_backend: str, tls_sentinel: TLSSentinel
) -> None:
    url = tls_sentinel.url(ssl_ca_certs=str(tls_sentinel.primary.ca), sentinel_password=SENTINEL_PASSWORD)
    with hotlock.connect(url, backend=redis_backend, timeout=2) as cache:
        assert cache.backend == redis_backend
        assert cache.server.startswith("rediss+sentinel://localhost:")
        assert SENTINEL_PASSWORD not in cache.server and SENTINEL_PASSWORD not in repr(cache)
        lock = cache.lock("s", ttl=5)
        # The lock is on the primary the sentinel named, reached over TLS.
        assert tls_sentinel.primary.plain.client().pttl(b"hotlock:lock:{s}") > 0
        assert lock.unlock() is True


def test_rediss_sentinel_refuses_a_wrong_sentinel_password(redis_backend: str, tls_sentinel: TLSSentinel) -> None:
    url = tls_sentinel.url(ssl_ca_certs=str(tls_sentinel.primary.ca), sentinel_password="wrong")
    with pytest.raises(CacheError, match="AUTH"):
        hotlock.connect(url, backend=redis_backend, timeout=2)


def test_rediss_sentinel_verifies_the_sentinels_certificate(
    redis_backend: str, tls_sentinel: TLSSentinel, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("SSL_CERT_FILE", raising=False)
    with pytest.raises(CacheError, match=r"(?i)certificate verify failed"):
        hotlock.connect(tls_sentinel.url(sentinel_password=SENTINEL_PASSWORD), backend=redis_backend, timeout=2)


def test_rediss_cluster_verifies_each_node_by_its_announced_address(
    redis_backend: str, tls_cluster: TLSCluster
) -> None:
    for node in tls_cluster.nodes:
        node.plain.client().flushall()
    with hotlock.connect(tls_cluster.url(ssl_ca_certs=str(tls_cluster.ca)), backend=redis_backend, timeout=2) as cache:
        assert cache.backend == redis_backend
        # Keys on every shard: a connection to each primary, each over TLS to its tls-port.
        locks = cache.lock_many([f"k{i}" for i in range(30)], ttl=5)
        assert all(node.plain.client().dbsize() > 0 for node in tls_cluster.nodes)
        assert cache.unlock_many(locks) == [True] * 30


def test_rediss_cluster_refuses_an_unknown_ca(
    redis_backend: str, tls_cluster: TLSCluster, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("SSL_CERT_FILE", raising=False)
    with pytest.raises(CacheError, match=r"(?i)certificate verify failed"):
        hotlock.connect(tls_cluster.url(), backend=redis_backend, timeout=2)
