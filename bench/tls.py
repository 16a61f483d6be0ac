"""TLS figures: ``python -m bench.tls [--split | --one-core] [--runs N] [--ops N]``.

A TLS redis-server started here (a throwaway CA and a certificate for DNS:localhost, made
with openssl), and, interleaved round by round in fresh processes pinned like the rest of
the bench:

- hotlock native over rediss:// (hotlock._native_tls),
- hotlock on its redis-py path over rediss:// (connect(backend="redis-py")),
- redis-py's Lock over rediss:// (its defaults, the CA in ssl_ca_certs),
- the C hiredis loop over TLS (bench/ceiling.c built with -DCEILING_TLS on the pinned
  hiredis sources and their ssl.c, vendor/hiredis/),
- and, for reference, hotlock native and the C loop on the server's plaintext port,

for cycle (acquire + release of a fresh key) and extend. Each figure is the median over
the rounds of the rate and the client CPU per operation (getrusage of the client process
over the timed part). The targets: the native TLS cycle's rate >= 0.9x the C TLS loop's,
its client CPU <= 1.2x the C TLS loop's and <= 0.5x redis-py Lock's over TLS.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from . import ceiling
from .server import free_port, pinning, start_redis

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
VENDOR = ROOT / "vendor" / "hiredis"

# The child: N operations, a Python call each, as bench.abcpu's; prints CPU us/op and ops/s.
CHILD = r"""
import itertools, resource, sys, time
def cpu():
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime
who, url, what, n, tag, ca = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4]), sys.argv[5], sys.argv[6]
serial = itertools.count()
if who == "redis-py Lock":
    import redis
    r = redis.Redis.from_url(url, ssl_ca_certs=ca) if url.startswith("rediss") else redis.Redis.from_url(url)
    if what == "extend":
        held = r.lock(f"tls:held:{tag}", timeout=30)
        assert held.acquire(blocking=False)
        op = lambda: held.extend(30, replace_ttl=True)
    else:
        def op():
            lock = r.lock(f"tls:{tag}:{next(serial)}", timeout=30)
            assert lock.acquire(blocking=False)
            lock.release()
else:
    import hotlock
    backend = "native" if who.startswith("native") else "redis-py"
    cache = hotlock.connect(url, backend=backend)
    assert cache.backend == backend
    if what == "extend":
        held = cache.lock(f"tls:held:{tag}", 30)
        op = lambda: held.extend(30)
    else:
        op = lambda: cache.lock(f"tls:{tag}:{next(serial)}", 30).unlock()
for _ in range(n // 10):
    op()
c0, t0 = cpu(), time.perf_counter()
for _ in range(n):
    op()
print((cpu() - c0) / n * 1e6, n / (time.perf_counter() - t0))
"""


def _openssl(*args: str, cwd: Path) -> None:
    subprocess.run(["openssl", *args], cwd=cwd, check=True, capture_output=True, timeout=60)


def make_certs(where: Path) -> tuple[Path, Path, Path]:
    """A CA and a server certificate for DNS:localhost: (ca, cert, key)."""
    _openssl("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", "ca.key", "-out", "ca.crt", "-days", "2",
             "-subj", "/CN=hotlock bench CA", "-addext", "basicConstraints=critical,CA:TRUE",
             "-addext", "keyUsage=critical,keyCertSign,cRLSign", cwd=where)  # fmt: skip
    _openssl("req", "-newkey", "rsa:2048", "-nodes", "-keyout", "server.key", "-out", "server.csr",
             "-subj", "/CN=localhost", cwd=where)  # fmt: skip
    (where / "ext.cnf").write_text("subjectAltName=DNS:localhost\nextendedKeyUsage=serverAuth\n")
    _openssl("x509", "-req", "-in", "server.csr", "-CA", "ca.crt", "-CAkey", "ca.key", "-CAcreateserial",
             "-out", "server.crt", "-days", "2", "-extfile", "ext.cnf", cwd=where)  # fmt: skip
    return where / "ca.crt", where / "server.crt", where / "server.key"


def build_c_tls(out: Path = ceiling.OUT) -> Path:
    """bench/ceiling.c with TLS, on the pinned hiredis sources (make vendor) and the system libssl."""
    if not (VENDOR / "ssl.c").exists():
        raise SystemExit("bench.tls: no hiredis sources in vendor/hiredis/ (make vendor)")
    out.mkdir(parents=True, exist_ok=True)
    exe = out / "ceiling-tls"
    sources = [VENDOR / f"{n}.c" for n in ("alloc", "async", "hiredis", "net", "read", "sds", "sockcompat", "ssl")]
    cmd = [os.environ.get("CC", "cc"), "-O2", "-DCEILING_TLS", f"-I{VENDOR}", "-o", str(exe),
           str(HERE / "ceiling.c"), *map(str, sources), "-lssl", "-lcrypto"]  # fmt: skip
    done = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise SystemExit(f"bench.tls: cc failed: {done.stderr.strip()[-800:]}")
    return exe


def run_c(exe: Path, port: int, mode: str, tag: str, client: list[str], ca: Path | None) -> tuple[float, float]:
    env = dict(os.environ)
    if ca is not None:
        env.update(CEILING_TLS_CA=str(ca), CEILING_TLS_NAME="localhost")
    scripts = ceiling.write_scripts()
    cmd = [*client, str(exe), "localhost" if ca else "127.0.0.1", str(port), mode, "2", str(scripts), tag]
    done = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=60, check=False)
    if done.returncode != 0:
        raise SystemExit(f"bench.tls: C loop failed: {done.stderr.strip()}")
    out = json.loads(done.stdout)
    return (out["user"] + out["sys"]) / out["ops"] * 1e6, out["ops"] / out["seconds"]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.tls", description=__doc__.splitlines()[0])
    ap.add_argument("--one-core", action="store_true", help="server and client on one core (default: split)")
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--ops", type=int, default=20_000)
    ap.add_argument("--json", type=Path, default=ceiling.OUT / "tls.json")
    args = ap.parse_args(argv)
    if shutil.which("openssl") is None:
        raise SystemExit("bench.tls: openssl is not installed")
    import hotlock

    info = hotlock.backend_info()
    if info["tls"] != "native":
        raise SystemExit(f"bench.tls: the native client has no TLS here: {info['tls_reason']}")
    pin = pinning(one_core=args.one_core)
    client = pin.prefix(pin.client)
    # One C program for both C rows, on the same pinned hiredis as the native client.
    c_loop = build_c_tls()
    workdir = Path(tempfile.mkdtemp(prefix="hotlock-bench-tls-"))
    ca, cert, key = make_certs(workdir)
    tls_port = free_port()
    names = [
        "native TLS",
        "redis-py path TLS",
        "redis-py Lock TLS",
        "C loop TLS",
        "native plaintext",
        "C loop plaintext",
    ]
    results: dict[str, dict[str, list[tuple[float, float]]]] = {m: {n: [] for n in names} for m in ("cycle", "extend")}
    try:
        with start_redis(pin.server, "--tls-port", str(tls_port), "--tls-cert-file", str(cert),
                         "--tls-key-file", str(key), "--tls-ca-cert-file", str(ca),
                         "--tls-auth-clients", "no") as server:  # fmt: skip
            tls_url = f"rediss://localhost:{tls_port}/0?ssl_ca_certs={ca}"
            env = dict(os.environ, PYTHONPATH=str(ROOT / "src"))
            for i in range(args.runs):
                for mode in ("cycle", "extend"):
                    for name in names:
                        tag = f"{i}-{mode}-{name.replace(' ', '')}"
                        if name.startswith("C loop"):
                            tls = name.endswith("TLS")
                            got = run_c(
                                c_loop, tls_port if tls else server.port, mode, tag, client, ca if tls else None
                            )
                        else:
                            url = tls_url if name.endswith("TLS") else server.url
                            who = name.rsplit(" ", 1)[0]
                            cmd = [*client, sys.executable, "-c", CHILD, who, url, mode, str(args.ops), tag, str(ca)]
                            done = subprocess.run(cmd, env=env, capture_output=True, text=True, cwd="/", check=False)
                            if done.returncode != 0:
                                raise SystemExit(f"bench.tls: {name}: {done.stderr.strip()[-800:]}")
                            cpu_us, rate = map(float, done.stdout.split())
                            got = (cpu_us, rate)
                        results[mode][name].append(got)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    report: dict[str, Any] = {
        "pinning": pin.note,
        "runs": args.runs,
        "ops": args.ops,
        "backend_info": info,
        "load": os.getloadavg()[0],
        "figures": {},
    }
    print(f"backend: {info['tls']} over TLS ({info['openssl']}), hiredis {info['hiredis']}")
    print(f"pinning: {pin.note}; {args.runs} rounds, {args.ops:,} ops per Python run; load {os.getloadavg()[0]:.2f}")
    for mode, rows in results.items():
        print(f"\n{mode}{'':<26}{'ops/s':>10}{'CPU µs/op':>11}")
        figures = report["figures"][mode] = {}
        for name, values in rows.items():
            if not values:
                continue
            rate = statistics.median(v[1] for v in values)
            cpu = statistics.median(v[0] for v in values)
            figures[name] = {"rate": rate, "cpu_us": cpu}
            print(f"{name:<32}{rate:>10,.0f}{cpu:>11.1f}")
    cyc = report["figures"]["cycle"]
    if "C loop TLS" in cyc:
        n, c, lock = cyc["native TLS"], cyc["C loop TLS"], cyc["redis-py Lock TLS"]
        targets = {
            "rate >= 0.9x C TLS loop": n["rate"] / c["rate"],
            "CPU <= 1.2x C TLS loop": n["cpu_us"] / c["cpu_us"],
            "CPU <= 0.5x redis-py Lock TLS": n["cpu_us"] / lock["cpu_us"],
        }
        report["targets"] = targets
        print("\nnative TLS cycle against the targets:")
        for what, ratio in targets.items():
            print(f"  {what:<32}{ratio:>6.2f}x")
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(report, indent=2) + "\n")
    print(f"\nwritten to {args.json}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
