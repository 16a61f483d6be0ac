"""Fetch the hiredis C sources that hotlock's extension is built on, pinned and hash-checked.

The `hiredis` package's sdist on PyPI carries hiredis 1.x's C sources (TLS layer included)
in vendor/hiredis/. This takes that sdist at the version and sha256 given, checks the hash,
and unpacks only vendor/hiredis/ (C sources, headers, licence) into DEST/hiredis/. The
sources are never committed to hotlock's repository; `make dist` ships them in the sdist.

    python tools/fetch_hiredis.py VERSION SHA256 DEST
"""

from __future__ import annotations

import hashlib
import shutil
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path


def main(version: str, sha256: str, dest: Path) -> int:
    target = dest / "hiredis"
    stamp = target / ".pinned"
    wanted = f"hiredis=={version} sha256:{sha256}\n"
    if stamp.exists() and stamp.read_text() == wanted:
        stamp.touch()  # make compares its time with the Makefile's
        return 0
    with tempfile.TemporaryDirectory(prefix="hotlock-hiredis-") as tmp:
        # --no-binary: the sdist, which carries the C sources (a wheel has only the compiled
        # parser); --no-build-isolation: pip must not fetch hiredis's build tools just to
        # read its metadata.
        subprocess.run(
            [sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--no-binary", ":all:",
             "--no-build-isolation", "-d", tmp, f"hiredis=={version}"],
            check=True,
        )  # fmt: skip
        archives = list(Path(tmp).glob(f"hiredis-{version}.tar.gz"))
        if len(archives) != 1:
            print(f"fetch_hiredis: pip left no hiredis-{version}.tar.gz in {tmp}", file=sys.stderr)
            return 1
        archive = archives[0]
        digest = hashlib.sha256(archive.read_bytes()).hexdigest()
        if digest != sha256:
            print(f"fetch_hiredis: {archive.name} has sha256 {digest}, expected {sha256}", file=sys.stderr)
            return 1
        prefix = f"hiredis-{version}/vendor/hiredis/"
        if target.exists():
            shutil.rmtree(target)
        target.mkdir(parents=True)
        with tarfile.open(archive) as tar:
            for member in tar.getmembers():
                name = member.name
                if not member.isfile() or not name.startswith(prefix) or "/" in name[len(prefix) :]:
                    continue
                base = name[len(prefix) :]
                # The library's sources and headers and its licence; not its test program.
                if base == "test.c" or not (base.endswith((".c", ".h")) or base == "COPYING"):
                    continue
                src = tar.extractfile(member)
                assert src is not None
                (target / base).write_bytes(src.read())
    if not (target / "hiredis.c").exists() or not (target / "ssl.c").exists():
        print(f"fetch_hiredis: hiredis {version}'s sdist has no hiredis.c or ssl.c", file=sys.stderr)
        return 1
    stamp.write_text(wanted)
    print(f"fetch_hiredis: hiredis {version} (sha256 {sha256[:12]}...) unpacked into {target}")
    return 0


if __name__ == "__main__":
    if len(sys.argv) != 4:
        print(__doc__, file=sys.stderr)
        sys.exit(2)
    sys.exit(main(sys.argv[1], sys.argv[2], Path(sys.argv[3])))
