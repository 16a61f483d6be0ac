"""Fetch the hiredis C sources that hotlock's extension is built on, pinned and hash-checked.

The `hiredis` package's sdist on PyPI carries hiredis 1.x's C sources (TLS layer included)
in vendor/hiredis/. This finds that sdist at the version given on the package index (PEP 691's
JSON simple API: PIP_INDEX_URL, else PyPI's), downloads it, checks its sha256, and unpacks
only vendor/hiredis/ (C sources, headers, licence) into DEST/hiredis/. The
sources are never committed to hotlock's repository; `make dist` ships them in the sdist.
`make vendor` runs it, and so does setup.py in a checkout that lacks them.

    python tools/fetch_hiredis.py DEST                  # the pin below
    python tools/fetch_hiredis.py VERSION SHA256 DEST   # another one
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import shutil
import sys
import tarfile
import urllib.request
from pathlib import Path
from urllib.parse import urljoin

# The pin: hiredis-py 3.5.0's sdist, which carries hiredis 1.5.0.
VERSION = "3.5.0"
SHA256 = "c227592cc56b7df247abe4755c26723965be68972be2149fa441ac33d82131ba"
TIMEOUT_S = 30


def download(version: str) -> bytes:
    """hiredis-VERSION.tar.gz from the index (not pip: a build's isolated environment may
    have none, and pip would prepare the sdist's metadata just to download it)."""
    index = os.environ.get("PIP_INDEX_URL", "https://pypi.org/simple/").rstrip("/") + "/hiredis/"
    accept = {"Accept": "application/vnd.pypi.simple.v1+json"}
    with urllib.request.urlopen(urllib.request.Request(index, headers=accept), timeout=TIMEOUT_S) as reply:
        files = json.load(reply)["files"]
    name = f"hiredis-{version}.tar.gz"
    url = next((f["url"] for f in files if f["filename"] == name), None)
    if url is None:
        raise LookupError(f"{index} lists no {name}")
    with urllib.request.urlopen(urljoin(index, url), timeout=TIMEOUT_S) as reply:
        return bytes(reply.read())


def main(version: str, sha256: str, dest: Path) -> int:
    target = dest / "hiredis"
    stamp = target / ".pinned"
    wanted = f"hiredis=={version} sha256:{sha256}\n"
    if stamp.exists() and stamp.read_text() == wanted:
        stamp.touch()  # make compares its time with the Makefile's
        return 0
    try:
        data = download(version)
    except (OSError, ValueError, LookupError) as exc:
        print(f"fetch_hiredis: could not download hiredis {version}'s sdist: {exc}", file=sys.stderr)
        return 1
    digest = hashlib.sha256(data).hexdigest()
    if digest != sha256:
        print(f"fetch_hiredis: hiredis-{version}.tar.gz has sha256 {digest}, expected {sha256}", file=sys.stderr)
        return 1
    prefix = f"hiredis-{version}/vendor/hiredis/"
    if target.exists():
        shutil.rmtree(target)
    target.mkdir(parents=True)
    with tarfile.open(fileobj=io.BytesIO(data), mode="r:gz") as tar:
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
    if len(sys.argv) == 2:
        sys.exit(main(VERSION, SHA256, Path(sys.argv[1])))
    if len(sys.argv) == 4:
        sys.exit(main(sys.argv[1], sys.argv[2], Path(sys.argv[3])))
    print(__doc__, file=sys.stderr)
    sys.exit(2)
