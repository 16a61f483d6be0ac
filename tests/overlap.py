"""An overlap checker for mutual-exclusion tests, itself tested against a broken lock.

Workers (threads or processes) call ``enter(key)``/``exit(key)`` around their critical
sections; the checker counts how many workers are inside each key's section at once
through shared memory, so it sees overlaps whatever the lock under test does.
"""

from __future__ import annotations

import multiprocessing as mp
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
