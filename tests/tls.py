"""Throwaway TLS material and TLS servers for the tests: a CA made here, certificates it
signs, and redis-server listening on a TLS port (plus a plaintext one, for looking at the
server from the side).

    pki = Pki.make(tmpdir)                       # ca.crt, and leaf() for any SANs
    server = start_tls_redis(pki, sans="DNS:localhost", auth_clients="no")
    server.tls_port, server.ca  ...  server.stop()
"""

from __future__ import annotations

import shutil
import signal
import ssl
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

from hotlock._sentinel import _ask

from .conftest import RedisServer, free_port, start_redis

__all__ = [
    "Pki",
    "TLSCluster",
    "TLSSentinel",
    "TLSServer",
    "start_tls_cluster",
    "start_tls_redis",
    "start_tls_sentinel",
]


def _openssl(*args: str, cwd: Path) -> None:
    subprocess.run(["openssl", *args], cwd=cwd, check=True, capture_output=True, timeout=60)


@dataclass
class Pki:
    """A CA and the certificates it signed, in one directory."""

    dir: Path

    @property
    def ca(self) -> Path:
        return self.dir / "ca.crt"

    @classmethod
    def make(cls, where: Path) -> Pki:
        if shutil.which("openssl") is None:
            pytest.fail("openssl is needed (make test installs it)")
        where.mkdir(parents=True, exist_ok=True)
        _openssl("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", "ca.key", "-out", "ca.crt",
                 "-days", "2", "-subj", "/CN=hotlock test CA", "-addext", "basicConstraints=critical,CA:TRUE",
                 "-addext", "keyUsage=critical,keyCertSign,cRLSign", cwd=where)  # fmt: skip
        return cls(where)

    def leaf(self, name: str, sans: str, usage: str = "serverAuth") -> tuple[Path, Path]:
        """A certificate for ``sans`` ("DNS:localhost,IP:127.0.0.1") and its key."""
        _openssl("req", "-newkey", "rsa:2048", "-nodes", "-keyout", f"{name}.key", "-out", f"{name}.csr",
                 "-subj", f"/CN={name}", cwd=self.dir)  # fmt: skip
        ext = self.dir / f"{name}.cnf"
        lines = [f"subjectAltName={sans}"] if sans else []
        lines += ["basicConstraints=CA:FALSE", "keyUsage=digitalSignature,keyEncipherment", f"extendedKeyUsage={usage}"]
        ext.write_text("\n".join(lines) + "\n")
        _openssl("x509", "-req", "-in", f"{name}.csr", "-CA", "ca.crt", "-CAkey", "ca.key", "-CAcreateserial",
                 "-out", f"{name}.crt", "-days", "2", "-extfile", ext.name, cwd=self.dir)  # fmt: skip
        return self.dir / f"{name}.crt", self.dir / f"{name}.key"


@dataclass
class TLSServer:
    """redis-server with a TLS port (tls_port) and a plaintext one (plain.port)."""

    plain: RedisServer
    tls_port: int
    ca: Path

    def url(self, host: str = "localhost", **query: str) -> str:
        q = "&".join(f"{k}={v}" for k, v in query.items())
        return f"rediss://{host}:{self.tls_port}/0" + (f"?{q}" if q else "")

    def connections(self) -> int:
        """How many connections the server has accepted so far (both ports)."""
        return int(self.plain.client().info("stats")["total_connections_received"])

    def stop(self) -> None:
        self.plain.stop()


def start_tls_redis(pki: Pki, name: str, sans: str, auth_clients: str = "no") -> TLSServer:
    """redis-server presenting a certificate for ``sans``; auth_clients "yes" requires a
    client certificate signed by the CA, "optional" checks one if sent."""
    if shutil.which("redis-server") is None:
        pytest.fail("redis-server is needed (make test installs it)")
    cert, key = pki.leaf(name, sans)
    port = free_port()
    server = start_redis(
        "--tls-port", str(port), "--tls-cert-file", str(cert), "--tls-key-file", str(key),
        "--tls-ca-cert-file", str(pki.ca), "--tls-auth-clients", auth_clients,
    )  # fmt: skip
    return TLSServer(server, port, pki.ca)


@dataclass
class TLSSentinel:
    """A TLS primary and one TLS sentinel monitoring it over TLS."""

    primary: TLSServer
    proc: subprocess.Popen[bytes]
    port: int
    workdir: Path

    def url(self, **query: str) -> str:
        q = "&".join(f"{k}={v}" for k, v in query.items())
        return f"rediss+sentinel://localhost:{self.port}/{SERVICE}" + (f"?{q}" if q else "")

    def stop(self) -> None:
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self.primary.stop()


SERVICE = "tlsprimary"


def start_tls_sentinel(pki: Pki, password: str | None = None) -> TLSSentinel:
    """A primary and a sentinel, both TLS only for clients, with certificates for
    DNS:localhost and IP:127.0.0.1 (the sentinel announces the primary as 127.0.0.1)."""
    exe = shutil.which("redis-sentinel")
    if exe is None:
        pytest.fail("redis-sentinel is needed (make test installs it)")
    primary = start_tls_redis(pki, "sprimary", "DNS:localhost,IP:127.0.0.1")
    cert, key = pki.leaf("sentinel", "DNS:localhost,IP:127.0.0.1", usage="serverAuth,clientAuth")
    port = free_port()
    workdir = pki.dir / f"sentinel-{port}"
    workdir.mkdir()
    conf = workdir / "sentinel.conf"
    conf.write_text(
        f"port 0\ntls-port {port}\nbind 127.0.0.1\ndaemonize no\ndir {workdir}\nlogfile {workdir}/sentinel.log\n"
        f"tls-cert-file {cert}\ntls-key-file {key}\ntls-ca-cert-file {pki.ca}\n"
        # TLS to the primary it monitors, too.
        "tls-replication yes\ntls-auth-clients no\n"
        f"sentinel monitor {SERVICE} 127.0.0.1 {primary.tls_port} 1\n"
        + (f"requirepass {password}\n" if password else "")
    )
    proc = subprocess.Popen([exe, str(conf)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    sentinel = TLSSentinel(primary, proc, port, workdir)
    deadline = time.monotonic() + 15
    context = ssl.create_default_context(cafile=str(pki.ca))
    while True:
        try:
            found = _ask("localhost", port, SERVICE, 2.0, context, password)
            if found == ("127.0.0.1", primary.tls_port):
                return sentinel
        except OSError:
            pass
        if proc.poll() is not None or time.monotonic() > deadline:
            log = (workdir / "sentinel.log").read_text() if (workdir / "sentinel.log").exists() else ""
            sentinel.stop()
            pytest.fail(f"the TLS sentinel did not come up: {log[-2000:]}")
        time.sleep(0.05)


@dataclass
class TLSCluster:
    """Cluster nodes with TLS for clients and on the cluster bus (plaintext ports kept for
    looking from the side)."""

    nodes: list[TLSServer]
    ca: Path

    def url(self, **query: str) -> str:
        q = "&".join(f"{k}={v}" for k, v in query.items())
        seeds = ",".join(f"127.0.0.1:{n.tls_port}" for n in self.nodes[:2])
        return f"rediss+cluster://{seeds}" + (f"?{q}" if q else "")

    def stop(self) -> None:
        for node in self.nodes:
            node.stop()


def start_tls_cluster(pki: Pki, primaries: int = 3, sans: str = "IP:127.0.0.1") -> TLSCluster:
    """Nodes announced (and seeded) as 127.0.0.1, their certificate for ``sans``."""
    cli = shutil.which("redis-cli")
    if cli is None:
        pytest.fail("redis-cli is needed (make test installs it)")
    cert, key = pki.leaf("node", sans, usage="serverAuth,clientAuth")
    nodes: list[TLSServer] = []
    try:
        for _ in range(primaries):
            port = free_port()
            plain = start_redis(
                "--tls-port", str(port), "--tls-cert-file", str(cert), "--tls-key-file", str(key),
                "--tls-ca-cert-file", str(pki.ca), "--tls-auth-clients", "no", "--tls-cluster", "yes",
                "--tls-replication", "yes", "--cluster-enabled", "yes", "--cluster-port", str(free_port()),
                "--cluster-node-timeout", "2000", "--cluster-require-full-coverage", "no",
            )  # fmt: skip
            nodes.append(TLSServer(plain, port, pki.ca))
        created = subprocess.run(
            [cli, "--tls", "--cacert", str(pki.ca), "--cluster", "create",
             *(f"127.0.0.1:{n.tls_port}" for n in nodes), "--cluster-replicas", "0", "--cluster-yes"],
            capture_output=True, timeout=60,
        )  # fmt: skip
        if created.returncode != 0:
            pytest.fail(f"redis-cli --cluster create failed: {created.stdout[-2000:]!r} {created.stderr[-2000:]!r}")
        deadline = time.monotonic() + 30
        while not all(n.plain.client().cluster("info")["cluster_state"] == "ok" for n in nodes):
            if time.monotonic() > deadline:
                pytest.fail("the TLS cluster did not reach cluster_state:ok")
            time.sleep(0.1)
    except BaseException:
        for node in nodes:
            node.stop()
        raise
    return TLSCluster(nodes, pki.ca)
