"""Builds hotlock._native from ext/ against the system libhiredis, when it can.

HOTLOCK_NO_EXTENSIONS=1 skips the build; HOTLOCK_REQUIRE_EXTENSIONS=1 makes a failed
build an error (make test and CI set it). Otherwise a missing compiler, Cython or
libhiredis gives a pure-Python install and one clear line saying why.
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
SKIP = os.environ.get("HOTLOCK_NO_EXTENSIONS") == "1"
# pip runs this file once per build hook: twice for the metadata (egg_info, dist_info), then
# once to build. Only a build says why the extension is left out, so the line appears once.
BUILD_COMMANDS = ("build", "build_ext", "bdist_wheel", "editable_wheel", "install", "develop")
BUILDING = any(cmd in sys.argv[1:] for cmd in BUILD_COMMANDS)


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


def extensions() -> list[Extension]:
    if SKIP:
        say("HOTLOCK_NO_EXTENSIONS=1: building the pure-Python package")
        return []
    if not os.path.exists(os.path.join("ext", "_native.pyx")):
        return []
    flags = hiredis_flags()
    if flags is None:
        message = "libhiredis not found by pkg-config (apt-get install libhiredis-dev): pure-Python install"
        if REQUIRE:
            raise SystemExit(f"hotlock: HOTLOCK_REQUIRE_EXTENSIONS=1 but {message}")
        say(message)
        return []
    try:
        from Cython.Build import cythonize
    except ImportError:
        if REQUIRE:
            raise SystemExit("hotlock: HOTLOCK_REQUIRE_EXTENSIONS=1 but Cython is not installed") from None
        say("Cython not installed: pure-Python install")
        return []
    ext = Extension(
        "hotlock._native",
        ["ext/_native.pyx"],
        include_dirs=["ext", *flags["include_dirs"]],
        library_dirs=flags["library_dirs"],
        libraries=flags["libraries"],
        extra_compile_args=["-O2", *flags["defines"]],
        # Rebuild when a part changes, not only the .pyx (compat.h is C, unseen by Cython).
        depends=sorted(glob.glob("ext/*.pxi") + glob.glob("ext/*.pxd") + glob.glob("ext/*.h")),
    )
    built = cythonize([ext], compiler_directives={"language_level": "3"}, include_path=["ext"])
    # cythonize() drops `optional`, so set it afterwards: a failed compile then degrades
    # to a pure-Python install (pip install -e . included) unless the build is required.
    for e in built:
        e.optional = not REQUIRE
    return built


class BuildExt(build_ext):
    """Says in one line when the optional extension did not build."""

    def run(self) -> None:
        try:
            super().run()
        except Exception as exc:
            if REQUIRE:
                raise
            say(f"the native extension did not build ({failure(exc)}): pure-Python install")

    def build_extension(self, ext: Extension) -> None:
        try:
            super().build_extension(ext)
        except Exception as exc:
            if REQUIRE or not getattr(ext, "optional", False):
                raise
            say(f"the native extension did not build ({failure(exc)}): pure-Python install")


setup(ext_modules=extensions(), cmdclass={"build_ext": BuildExt})
