"""The docs: every public name has an entry in the API reference, and the README, the front
door, stays short and links only to what exists.

The API reference (docs/api/*.md) is generated from the docstrings by mkdocstrings, one
``::: dotted.name`` directive per object; `make docs` builds it with --strict, which fails
on a directive it cannot resolve. This checks the other direction: that no name in
``hotlock.__all__`` or ``hotlock.aio.__all__`` is missing from it. When the site has been
built (site/objects.inv, as `make test` does before the suite), the inventory mkdocstrings
wrote is checked too, so each name is known to have rendered.
"""

from __future__ import annotations

import re
import zlib
from pathlib import Path

import pytest

import hotlock
import hotlock.aio

ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"
API = DOCS / "api"
INVENTORY = ROOT / "site" / "objects.inv"

PUBLIC = [f"hotlock.{name}" for name in hotlock.__all__] + [f"hotlock.aio.{name}" for name in hotlock.aio.__all__]


def directives() -> set[str]:
    """The objects the API reference documents: the ``::: name`` lines of docs/api/*.md."""
    found = set()
    for page in API.glob("*.md"):
        found |= set(re.findall(r"^:::\s+([\w.]+)\s*$", page.read_text(), re.MULTILINE))
    return found


def inventory() -> set[str]:
    """The names in the built site's Sphinx-style inventory (a 4-line header, then zlib)."""
    data = INVENTORY.read_bytes()
    start = 0
    for _ in range(4):
        start = data.index(b"\n", start) + 1
    return {line.split(" ", 1)[0] for line in zlib.decompress(data[start:]).decode().splitlines() if line}


def test_the_api_reference_has_pages() -> None:
    assert sorted(p.name for p in API.glob("*.md")) == ["aio.md", "errors.md", "hotlock.md", "metrics.md"]


@pytest.mark.parametrize("name", PUBLIC)
def test_every_public_name_has_an_api_entry(name: str) -> None:
    assert name in directives(), f"{name} is in __all__ but no docs/api page has '::: {name}'"


def test_every_public_name_rendered_in_the_built_site() -> None:
    if not INVENTORY.exists():
        pytest.skip("site/ not built (make docs builds it; make test runs it first)")
    missing = sorted(set(PUBLIC) - inventory())
    assert not missing, f"not in site/objects.inv (rebuild with make docs): {missing}"


def test_the_metrics_module_is_documented() -> None:
    assert "hotlock.metrics" in directives()


def test_the_readme_is_a_front_door() -> None:
    lines = (ROOT / "README.md").read_text().splitlines()
    assert len(lines) <= 300, f"README.md has {len(lines)} lines: the manual belongs in docs/"


def test_the_readme_links_to_files_that_exist() -> None:
    text = (ROOT / "README.md").read_text()
    links = re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", text)
    local = [link for link in links if not re.match(r"[a-z]+://", link)]
    assert local, "the README links into the docs"
    missing = [link for link in local if not (ROOT / link).exists()]
    assert not missing, missing


def test_the_docs_cite_no_tracker_or_design_notes() -> None:
    # A maintainer who clones the repository has neither: the docs stand alone.
    cited = re.compile(r"DESIGN ?(\.md)? ?§?[0-9]+|STYLE(\.md)? habit|\bissue ?#?[0-9]+", re.IGNORECASE)
    pages = [*DOCS.rglob("*.md"), ROOT / "README.md"]
    found = [f"{p.relative_to(ROOT)}: {m.group(0)}" for p in pages for m in cited.finditer(p.read_text())]
    assert not found, found


def test_the_documented_acl_lists_are_the_tested_ones() -> None:
    # tests/test_security.py proves each list enough and each entry needed; the operator
    # checklist is where an operator copies them from.
    from .test_security import SCRIPT_PATH, VALKEY_LUA_FREE

    text = (DOCS / "operations.md").read_text()
    blocks = re.findall(r"ACL SETUSER hotlock on >PASSWORD resetkeys ~hotlock:\* resetchannels -@all \\\n\s*(.+)", text)
    assert [block.split() for block in blocks] == [SCRIPT_PATH, VALKEY_LUA_FREE]
