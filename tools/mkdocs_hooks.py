"""MkDocs hooks for `make docs`: the benchmark results in bench/ become pages of the site.

They are generated next to the code that measures them (python -m bench.report), so the
site takes them from there rather than keeping copies under docs/ that would go stale.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from mkdocs.structure.files import File, Files

ROOT = Path(__file__).resolve().parent.parent
BENCH = [
    "bench/README.md",
    "bench/results.md",
    "bench/results.png",
    "bench/one-core/results.md",
    "bench/one-core/results.png",
    "bench/results-cluster.md",
    "bench/results-reshard.md",
    "bench/results-servercost.md",
    "bench/renewal.md",
    "bench/profile_notes.md",
]


def on_files(files: Files, config: Any) -> Files:
    for path in BENCH:
        files.append(File(path, str(ROOT), config["site_dir"], config["use_directory_urls"]))
    return files
