"""Output: the table and duration formats every subcommand shares."""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from typing import Any, TextIO

__all__ = ["duration", "print_json", "status_word", "table"]


def duration(seconds: float) -> str:
    """12.345s, 12m05s, 3h12m, 6d23h: exact enough to read, short enough for a column."""
    if seconds < 60:
        return f"{seconds:.3f}s"
    whole = int(seconds)
    if whole < 3600:
        return f"{whole // 60}m{whole % 60:02d}s"
    if whole < 86400:
        return f"{whole // 3600}h{whole % 3600 // 60:02d}m"
    return f"{whole // 86400}d{whole % 86400 // 3600:02d}h"


def table(out: TextIO, header: Sequence[str], rows: Sequence[Sequence[str]]) -> None:
    """Left-aligned columns two spaces apart; the last column is not padded."""
    widths = [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(header)]
    for row in (header, *rows):
        cells = [c.ljust(w) for c, w in zip(row[:-1], widths, strict=False)] + [row[-1]]
        out.write("  ".join(cells).rstrip() + "\n")


def print_json(out: TextIO, data: Any) -> None:
    out.write(json.dumps(data, indent=2, ensure_ascii=False) + "\n")


_COLORS = {"ok": "\x1b[32m", "warn": "\x1b[33m", "fail": "\x1b[31m"}


def status_word(out: TextIO, status: str) -> str:
    """The status padded to a column, colored on a terminal unless NO_COLOR is set."""
    word = f"{status:<4}"
    if out.isatty() and not os.environ.get("NO_COLOR") and status in _COLORS:
        return f"{_COLORS[status]}{word}\x1b[0m"
    return word
