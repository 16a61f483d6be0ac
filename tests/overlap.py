"""An overlap checker for mutual-exclusion tests, itself tested against a broken lock.

Workers (threads or processes) call ``enter(key)``/``exit(key)`` around their critical
sections; the checker counts how many workers are inside each key's section at once
through shared memory, so it sees overlaps whatever the lock under test does.
"""

from __future__ import annotations

import multiprocessing as mp
from multiprocessing.sharedctypes import Synchronized


class OverlapChecker:
    def __init__(self, keys: int) -> None:
        ctx = mp.get_context("fork")
        self._guard = ctx.Lock()  # the checker's own instrument, not the lock under test
        self._inside: list[Synchronized[int]] = [ctx.Value("i", 0, lock=False) for _ in range(keys)]
        self._overlaps: Synchronized[int] = ctx.Value("i", 0, lock=False)
        self._sections: Synchronized[int] = ctx.Value("i", 0, lock=False)

    def enter(self, key: int) -> None:
        with self._guard:
            self._inside[key].value += 1
            if self._inside[key].value > 1:
                self._overlaps.value += 1

    def exit(self, key: int) -> None:
        with self._guard:
            self._inside[key].value -= 1
            self._sections.value += 1

    @property
    def overlaps(self) -> int:
        return int(self._overlaps.value)

    @property
    def sections(self) -> int:
        return int(self._sections.value)
