"""Builds hotlock._native from ext/, on the pinned hiredis C sources when they are present.

vendor/hiredis/ holds the C sources of hiredis 1.x as the `hiredis` package's sdist carries
them (`make vendor` fetches that sdist, pinned and hash-checked; hotlock's sdist ships them).
From them two builds of the same extension are compiled, each with hiredis linked in
statically and its symbols hidden (-fvisibility=hidden: only PyInit_* is exported), so
they never clash with hiredis-py's copy or a system libhiredis in the same process:

- hotlock._native, plaintext only;
- hotlock._native_tls, with hiredis's TLS layer, linking the system libssl (never bundled:
  one OpenSSL per process). hotlock.backends.native loads it only when Python's ssl module runs
  on that same libssl.

A checkout without vendor/hiredis/ fetches them first, as `make vendor` does (pinned and
hash-checked by tools/fetch_hiredis.py; HOTLOCK_NO_FETCH=1 skips it). Only without them
(no network, or sources that carry neither them nor the tool) is hotlock._native built
against the system libhiredis found by pkg-config, with no TLS; said once, with why.

HOTLOCK_NO_EXTENSIONS=1 skips the build; HOTLOCK_REQUIRE_EXTENSIONS=1 makes a failed
build an error (make test and CI set it); HOTLOCK_REQUIRE_TLS=1 (make compile, make dist)
also requires the pinned sources and the TLS build. Otherwise a missing compiler, Cython or
libhiredis gives a pure-Python install and one clear line saying why.

HOTLOCK_SANITIZE=1 (make test-asan) compiles both builds, vendored hiredis included, with
AddressSanitizer and UndefinedBehaviorSanitizer and CPython's asserts on;
HOTLOCK_SANITIZE=fuzz (make fuzz, with CC=clang) adds libFuzzer's coverage instrumentation
for Atheris. Both are for a separate build tree (--build-lib), never the installed package.
"""

from __future__ import annotations

import glob
import os
import shutil
import subprocess
import sys

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext

REQUIRE = os.environ.get("HOTLOCK_REQUIRE_EXTENSIONS") == "1"
REQUIRE_TLS = os.environ.get("HOTLOCK_REQUIRE_TLS") == "1"
VENDOR = os.path.join("vendor", "hiredis")
FETCH_TOOL = os.path.join("tools", "fetch_hiredis.py")
# hiredis's library as its own Makefile builds it (async.c too: hiredis.c calls into
# it, though hotlock's asyncio protocol does its own I/O), and the TLS layer for the second build.
CORE_SOURCES = ("alloc", "async", "hiredis", "net", "read", "sds", "sockcompat")
TLS_SOURCES = ("ssl",)
SKIP = os.environ.get("HOTLOCK_NO_EXTENSIONS") == "1"
SANITIZE = os.environ.get("HOTLOCK_SANITIZE", "")
if SANITIZE not in ("", "0", "1", "fuzz"):
    raise SystemExit(f"hotlock: HOTLOCK_SANITIZE is 1 or fuzz, not {SANITIZE!r}")
# -O1 and frame pointers keep the sanitizers' stack traces whole; -UNDEBUG turns on the
# assert()s in CPython's headers (PyTuple_GET_ITEM's type and bounds checks...), which
# sysconfig's -DNDEBUG turns off (extra_compile_args come after it); a UBSan report aborts
# instead of printing and going on.
SANITIZE_FLAGS = ["-O1", "-g", "-fno-omit-frame-pointer", "-UNDEBUG", "-fno-sanitize-recover=undefined"]
if SANITIZE == "1":
    SANITIZE_FLAGS.append("-fsanitize=address,undefined")
elif SANITIZE == "fuzz":
    # fuzzer-no-link: the coverage counters libFuzzer (in Atheris) reads, without its main().
    SANITIZE_FLAGS.append("-fsanitize=address,undefined,fuzzer-no-link")
else:
    SANITIZE_FLAGS = []
SANITIZE_LINK = [f for f in SANITIZE_FLAGS if f.startswith("-fsanitize=")]
# pip runs this file once per build hook: twice for the metadata (egg_info, dist_info), then
# once to build. Only a build says why the extension is left out, so the line appears once.
BUILD_COMMANDS = ("build", "build_ext", "bdist_wheel", "editable_wheel", "install", "develop")
BUILDING = any(cmd in sys.argv[1:] for cmd in BUILD_COMMANDS)
# A checkout fetches the pinned hiredis sources for a build or an sdist, not for metadata.
FETCHING = BUILDING or "sdist" in sys.argv[1:]


def say(message: str) -> None:
    if BUILDING:
        print(f"hotlock: {message}", file=sys.stderr)


def failure(exc: BaseException) -> str:
    """Why the compile failed, in a few words: setuptools' error carries the whole command line."""
    seen: BaseException | None = exc
    while seen is not None:
        if isinstance(seen, FileNotFoundError) and seen.filename:
            return f"no C compiler: {seen.filename} not found"
        if isinstance(seen, subprocess.CalledProcessError) and isinstance(seen.cmd, list | tuple):
            return f"compiling failed: {seen.cmd[0]} exited with status {seen.returncode}"
        seen = seen.__cause__ or seen.__context__
    return str(exc)


def hiredis_flags() -> dict[str, list[str]] | None:
    """Compiler and linker flags for libhiredis from pkg-config, or None when it is absent."""
    if shutil.which("pkg-config") is None:
        return None
    try:
        cflags = subprocess.run(["pkg-config", "--cflags", "hiredis"], check=True, capture_output=True, text=True)
        libs = subprocess.run(["pkg-config", "--libs", "hiredis"], check=True, capture_output=True, text=True)
    except subprocess.CalledProcessError:
        return None
    flags: dict[str, list[str]] = {"include_dirs": [], "library_dirs": [], "libraries": [], "defines": []}
    for token in (cflags.stdout + " " + libs.stdout).split():
        if token.startswith("-I"):
            flags["include_dirs"].append(token[2:])
            # The sources include <hiredis/hiredis.h>; hiredis 0.14's .pc points inside
            # that directory and 1.x's at its parent, so give the compiler both.
            if token.rstrip("/").endswith("/hiredis"):
                flags["include_dirs"].append(os.path.dirname(token[2:].rstrip("/")))
        elif token.startswith("-D"):
            flags["defines"].append(token)  # 1.x asks for -D_FILE_OFFSET_BITS=64, as the library was built
        elif token.startswith("-L"):
            flags["library_dirs"].append(token[2:])
        elif token.startswith("-l"):
            flags["libraries"].append(token[2:])
    return flags


def openssl_flags() -> dict[str, list[str]] | None:
    """Flags to compile against the system OpenSSL (headers and libssl), or None without them."""
    if shutil.which("pkg-config") is not None:
        try:
            out = subprocess.run(
                ["pkg-config", "--cflags", "--libs", "openssl"], check=True, capture_output=True, text=True
            ).stdout
        except subprocess.CalledProcessError:
            out = None
        if out is not None:
            flags: dict[str, list[str]] = {"include_dirs": [], "library_dirs": [], "libraries": []}
            for token in out.split():
                if token.startswith("-I"):
                    flags["include_dirs"].append(token[2:])
                elif token.startswith("-L"):
                    flags["library_dirs"].append(token[2:])
                elif token.startswith("-l"):
                    flags["libraries"].append(token[2:])
            return flags
    if os.path.exists("/usr/include/openssl/ssl.h"):
        return {"include_dirs": [], "library_dirs": [], "libraries": ["ssl", "crypto"]}
    return None


def vendored_extensions() -> list[Extension]:
    """hotlock._native and hotlock._native_tls from ext/ plus the pinned hiredis sources."""
    core = [os.path.join(VENDOR, f"{name}.c") for name in CORE_SOURCES]
    depends = sorted(glob.glob("ext/*.pxi") + glob.glob("ext/*.pxd") + glob.glob("ext/*.h"))
    depends += sorted(glob.glob(os.path.join(VENDOR, "*.h")))
    # -fvisibility=hidden: hiredis's functions become local to the .so (PyMODINIT_FUNC
    # exports PyInit_* explicitly), so another hiredis loaded in the process, hiredis-py's
    # or the system's, neither resolves to ours nor we to it.
    cflags = ["-O2", "-fvisibility=hidden", *SANITIZE_FLAGS]
    plain = Extension(
        "hotlock._native",
        ["ext/_native.pyx", *core],
        include_dirs=["ext", "vendor"],
        define_macros=[("HOTLOCK_TLS", "0")],
        extra_compile_args=cflags,
        extra_link_args=SANITIZE_LINK,
        depends=depends,
    )
    built = [plain]
    ssl = openssl_flags()
    if ssl is None:
        message = "no OpenSSL headers (apt-get install libssl-dev): the native client is built without TLS"
        if REQUIRE_TLS:
            raise SystemExit(f"hotlock: HOTLOCK_REQUIRE_TLS=1 but {message}")
        say(message)
    else:
        built.append(
            Extension(
                "hotlock._native_tls",
                ["ext/_native_tls.pyx", *core, *(os.path.join(VENDOR, f"{name}.c") for name in TLS_SOURCES)],
                include_dirs=["ext", "vendor", *ssl["include_dirs"]],
                library_dirs=ssl["library_dirs"],
                libraries=ssl["libraries"],
                define_macros=[("HOTLOCK_TLS", "1")],
                extra_compile_args=cflags,
                extra_link_args=SANITIZE_LINK,
                depends=depends,
            )
        )
    return built


def system_extensions() -> list[Extension] | None:
    """hotlock._native against the system libhiredis (no TLS), or None when it is absent."""
    flags = hiredis_flags()
    if flags is None:
        return None
    return [
        Extension(
            "hotlock._native",
            ["ext/_native.pyx"],
            include_dirs=["ext", *flags["include_dirs"]],
            library_dirs=flags["library_dirs"],
            libraries=flags["libraries"],
            extra_compile_args=["-O2", *flags["defines"]],
            # Rebuild when a part changes, not only the .pyx (compat.h is C, unseen by Cython).
            depends=sorted(glob.glob("ext/*.pxi") + glob.glob("ext/*.pxd") + glob.glob("ext/*.h")),
        )
    ]


def fetch_vendor() -> str:
    """Fetch the pinned hiredis sources into vendor/hiredis/: "" when they are there now,
    else why not (one line)."""
    if not os.path.exists(FETCH_TOOL) or not FETCHING:
        return "make vendor fetches them"
    if os.environ.get("HOTLOCK_NO_FETCH") == "1":
        return "HOTLOCK_NO_FETCH=1"
    try:
        proc = subprocess.run(
            [sys.executable, FETCH_TOOL, "vendor"], capture_output=True, text=True, timeout=300, check=False
        )
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"could not fetch them: {exc}"
    if proc.returncode != 0 or not os.path.exists(os.path.join(VENDOR, "hiredis.c")):
        lines = [x.strip() for x in (proc.stderr or proc.stdout).splitlines() if x.strip()]
        return f"could not fetch them: {lines[-1][:300] if lines else f'exit status {proc.returncode}'}"
    say(proc.stdout.strip().splitlines()[-1])
    return ""


def extensions() -> list[Extension]:
    if SKIP:
        say("HOTLOCK_NO_EXTENSIONS=1: building the pure-Python package")
        return []
    if not os.path.exists(os.path.join("ext", "_native.pyx")):
        return []
    fetched = "" if os.path.exists(os.path.join(VENDOR, "hiredis.c")) else fetch_vendor()
    if not fetched:
        exts = vendored_extensions()
    elif SANITIZE_FLAGS:
        raise SystemExit(f"hotlock: HOTLOCK_SANITIZE is set but there are no hiredis sources in {VENDOR}/")
    else:
        why = f"no hiredis sources in {VENDOR}/ ({fetched})"
        if REQUIRE_TLS:
            raise SystemExit(f"hotlock: HOTLOCK_REQUIRE_TLS=1 but {why}")
        found = system_extensions()
        if found is None:
            message = f"{why}, and no libhiredis found by pkg-config (apt-get install libhiredis-dev): pure Python"
            if REQUIRE:
                raise SystemExit(f"hotlock: HOTLOCK_REQUIRE_EXTENSIONS=1 but {message}")
            say(message)
            return []
        say(f"{why}: building on the system libhiredis, without TLS (rediss:// will run on redis-py)")
        exts = found
    try:
        from Cython.Build import cythonize
    except ImportError:
        if REQUIRE:
            raise SystemExit("hotlock: HOTLOCK_REQUIRE_EXTENSIONS=1 but Cython is not installed") from None
        say("Cython not installed: pure-Python install")
        return []
    built = cythonize(exts, compiler_directives={"language_level": "3"}, include_path=["ext"])
    # cythonize() drops `optional`, so set it afterwards: a failed compile then degrades
    # to a pure-Python install (pip install -e . included) unless the build is required.
    for e in built:
        e.optional = not REQUIRE
    return built


class BuildExt(build_ext):
    """Says in one line when the optional extension did not build."""

    plain_failed = False

    def run(self) -> None:
        try:
            super().run()
        except Exception as exc:
            if REQUIRE:
                raise
            say(f"the native extension did not build ({failure(exc)}): pure-Python install")

    def build_extension(self, ext: Extension) -> None:
        tls = ext.name == "hotlock._native_tls"
        if tls and self.plain_failed:
            return  # the same sources and compiler: the one line about the plain build says it
        try:
            super().build_extension(ext)
        except Exception as exc:
            if not tls:
                BuildExt.plain_failed = True
            if REQUIRE or (tls and REQUIRE_TLS) or not getattr(ext, "optional", False):
                raise
            if tls:
                say(f"the TLS build did not compile ({failure(exc)}): rediss:// will run on redis-py")
            else:
                say(f"the native extension did not build ({failure(exc)}): pure-Python install")


setup(ext_modules=extensions(), cmdclass={"build_ext": BuildExt})
