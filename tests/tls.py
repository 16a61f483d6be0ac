"""Throwaway TLS material and TLS servers for the tests: a CA made here, certificates it
signs, and redis-server listening on a TLS port (plus a plaintext one, for looking at the
server from the side).

    pki = Pki.make(tmpdir)                       # ca.crt, and leaf() for any SANs
    server = start_tls_redis(pki, sans="DNS:localhost", auth_clients="no")
    server.tls_port, server.ca  ...  server.stop()
"""

from __future__ import annotations

import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

import pytest

from .conftest import RedisServer, free_port, start_redis

__all__ = ["Pki", "TLSServer", "start_tls_redis"]


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
