"""An overlap checker for mutual-exclusion tests, itself tested against a broken lock.

Workers (threads or processes) call ``enter(key)``/``exit(key)`` around their critical
sections; the checker counts how many workers are inside each key's section at once
through shared memory, so it sees overlaps whatever the lock under test does.
"""

from __future__ import annotations

import multiprocessing as mp
import os
from multiprocessing.sharedctypes import Synchronized


class OverlapChecker:
    """``allowed``: how many may be inside one key's section at once (a concurrency limit);
    one more is an overlap."""

    def __init__(self, keys: int, allowed: int = 1) -> None:
        ctx = mp.get_context("fork")
        self._allowed = allowed
        self._most: Synchronized[int] = ctx.Value("i", 0, lock=False)
        self._guard = ctx.Lock()  # the checker's own instrument, not the lock under test
        self._inside: list[Synchronized[int]] = [ctx.Value("i", 0, lock=False) for _ in range(keys)]
        self._overlaps: Synchronized[int] = ctx.Value("i", 0, lock=False)
        self._sections: Synchronized[int] = ctx.Value("i", 0, lock=False)

    def enter(self, key: int) -> None:
        with self._guard:
            self._inside[key].value += 1
            self._most.value = max(self._most.value, self._inside[key].value)
            if self._inside[key].value > self._allowed:
                self._overlaps.value += 1

    def exit(self, key: int) -> None:
        with self._guard:
            self._inside[key].value -= 1
            self._sections.value += 1

    @property
    def overlaps(self) -> int:
        return int(self._overlaps.value)

    @property
    def most(self) -> int:
        """The most ever inside one key's section at once."""
        return int(self._most.value)

    @property
    def sections(self) -> int:
        return int(self._sections.value)


class FileOverlapLog:
    """The same count across processes that share no memory (Celery workers, beats): each
    section's entry and exit are appended to one file as a line, in one O_APPEND write,
    so the file's order is the order the kernel took them in; ``count`` replays it.

    A section writes its entry after taking the lock and its exit before releasing it,
    so under a working lock no entry lands between another's entry and exit."""

    def __init__(self, path: str, allowed: int = 1) -> None:
        self.path = path
        self._allowed = allowed

    def _write(self, line: str) -> None:
        fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        try:
            os.write(fd, line.encode())
        finally:
            os.close(fd)

    def enter(self, key: object) -> None:
        self._write(f"enter {key} {os.getpid()}\n")

    def exit(self, key: object) -> None:
        self._write(f"exit {key} {os.getpid()}\n")

    def count(self) -> tuple[int, int, int]:
        """(overlaps, the most inside one key at once, sections completed)."""
        inside: dict[str, int] = {}
        overlaps = most = sections = 0
        try:
            with open(self.path) as f:
                lines = f.read().splitlines()
        except FileNotFoundError:
            lines = []
        for line in lines:
            what, key, _ = line.split(" ")
            if what == "enter":
                inside[key] = inside.get(key, 0) + 1
                most = max(most, inside[key])
                overlaps += inside[key] > self._allowed
            else:
                inside[key] -= 1
                sections += 1
        return overlaps, most, sections
