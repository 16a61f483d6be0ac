"""The fault rules over TLS, on every backend that speaks it (native and redis-py).

The fault proxy forwards TLS bytes as they are: a dropped chunk is a lost TLS record,
which breaks that connection (a lost reply, retried once with the same token on a new
connection); a reset mid-handshake is a lost handshake (any call may connect again); a
blackhole costs one reply timeout, read as a timeout; a restarted server costs nothing.
"""

from __future__ import annotations

import subprocess
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

import hotlock
from hotlock import CacheError

from .conftest import lock_name
from .faultproxy import FaultProxy
from .tls import Pki, TLSServer, start_tls_redis

REPLY_TIMEOUT = 0.5


@pytest.fixture(scope="module")
def pki() -> Iterator[Pki]:
    with tempfile.TemporaryDirectory(prefix="hotlock-pki-") as d:
        yield Pki.make(Path(d))


@pytest.fixture(scope="module")
def server(pki: Pki) -> Iterator[TLSServer]:
    s = start_tls_redis(pki, "faults", "DNS:localhost")
    yield s
    s.stop()


@pytest.fixture
def proxy(server: TLSServer) -> Iterator[FaultProxy]:
    server.plain.client().flushall()
    with FaultProxy(server.tls_port) as p:
        yield p


def tls_url(proxy: FaultProxy, server: TLSServer) -> str:
    return f"rediss://localhost:{proxy.port}/0?ssl_ca_certs={server.ca}"


@pytest.fixture
def pcache(redis_backend: str, proxy: FaultProxy, server: TLSServer) -> Iterator[hotlock.Cache]:
    c = hotlock.connect(
        tls_url(proxy, server), backend=redis_backend, timeout=REPLY_TIMEOUT, connect_timeout=REPLY_TIMEOUT
    )
    assert c.backend == redis_backend
    c.lock("warm", ttl=5).unlock()  # the connection made, its session tickets taken
    yield c
    proxy.clear()
    c.close()


def test_lost_tls_acquire_reply_is_retried_with_the_same_token(
    pcache: hotlock.Cache, proxy: FaultProxy, server: TLSServer
) -> None:
    connections = proxy.connections
    proxy.drop_replies(1)
    start = time.monotonic()
    lock = pcache.lock("lost", ttl=5)
    assert proxy.dropped_replies == 1
    assert proxy.connections == connections + 1  # a new connection for the retry
    assert time.monotonic() - start < 10 * REPLY_TIMEOUT
    # The key holds this lock's token: the retry's "already mine" was a success.
    stored = server.plain.client().get(lock_name(b"lost"))
    assert stored is not None and stored.startswith(lock._token)
    assert lock.unlock() is True


def test_lost_tls_release_reply_raises_nothing(pcache: hotlock.Cache, proxy: FaultProxy, server: TLSServer) -> None:
    lock = pcache.lock("rel", ttl=5)
    proxy.drop_replies(1)
    lock.unlock()
    assert server.plain.client().exists(lock_name(b"rel")) == 0


def test_reset_mid_handshake_is_retried_as_a_lost_handshake(
    redis_backend: str, proxy: FaultProxy, server: TLSServer
) -> None:
    # The first request chunk of a connection is the ClientHello: forwarded, then the
    # connection is reset, before the handshake is done.
    proxy.reset_after_request(1)
    with hotlock.connect(
        tls_url(proxy, server), backend=redis_backend, timeout=REPLY_TIMEOUT, connect_timeout=REPLY_TIMEOUT
    ) as cache:
        assert proxy.resets == 1
        assert proxy.connections >= 2
        assert cache.lock("after-reset", ttl=5).unlock() is True


def test_blackhole_over_tls_costs_one_reply_timeout_read_as_a_timeout(pcache: hotlock.Cache, proxy: FaultProxy) -> None:
    proxy.blackhole(True)
    start = time.monotonic()
    with pytest.raises(CacheError, match=r"(?i)no reply within the timeout|timeout reading") as caught:
        pcache.lock("dark", ttl=5)
    if pcache.backend == "native":
        # A TLS read that times out comes back from hiredis as an I/O error (EAGAIN): the
        # same timeout as on plaintext.
        assert "no reply within the timeout" in str(caught.value)
    elapsed = time.monotonic() - start
    assert elapsed < 10 * REPLY_TIMEOUT, elapsed
    assert "TLS session failed" not in str(caught.value)
    proxy.blackhole(False)
    assert pcache.lock("light", ttl=5).unlock() is True


def test_tls_server_restart_between_calls_costs_no_error(redis_backend: str, pki: Pki) -> None:
    own = start_tls_redis(pki, "restart", "DNS:localhost")
    try:
        url = own.url(ssl_ca_certs=str(own.ca))
        with hotlock.connect(url, backend=redis_backend, timeout=2) as cache:
            cache.lock("before", ttl=5).unlock()
            args = own.plain.proc.args  # type: ignore[union-attr]
            own.plain.client().shutdown(nosave=True)
            own.plain.proc.wait(10)  # type: ignore[union-attr]
            own.plain.proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            own.plain._client = None
            deadline = time.monotonic() + 10
            while True:
                try:
                    own.plain.client().ping()
                    break
                except Exception:
                    if time.monotonic() > deadline:
                        raise
                    time.sleep(0.05)
            # A fresh server: the connection is gone and the scripts are unknown (NOSCRIPT).
            lock = cache.lock("after", ttl=5)
            assert lock.unlock() is True
    finally:
        own.stop()
