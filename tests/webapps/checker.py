"""An overlap checker across processes: a JSON state file updated under flock.

Each request calls ``enter(key, allowed)`` when its protected section starts and ``exit(key)``
when it ends; an ``enter`` that finds ``allowed`` already inside counts an overlap. The file
lock is the checker's own instrument, never the lock under test. The tests show it counts
overlaps on a route without the lock, so "0 overlaps" under the lock means something.
"""

from __future__ import annotations

import fcntl
import json
import os
from collections.abc import Callable
from typing import Any


class FileChecker:
    def __init__(self, path: str) -> None:
        self.path = path

    def _update(self, change: Callable[[dict[str, Any]], None]) -> dict[str, Any]:
        with open(self.path + ".lock", "a") as guard:
            fcntl.flock(guard, fcntl.LOCK_EX)
            try:
                with open(self.path) as f:
                    state: dict[str, Any] = json.load(f)
            except (FileNotFoundError, json.JSONDecodeError):
                state = {"inside": {}, "most": {}, "overlaps": {}, "sections": {}, "pids": []}
            change(state)
            tmp = f"{self.path}.{os.getpid()}"
            with open(tmp, "w") as f:
                json.dump(state, f)
            os.replace(tmp, self.path)
            return state

    def enter(self, key: str, allowed: int = 1) -> None:
        def change(state: dict[str, Any]) -> None:
            inside = state["inside"].get(key, 0) + 1
            state["inside"][key] = inside
            state["most"][key] = max(state["most"].get(key, 0), inside)
            if inside > allowed:
                state["overlaps"][key] = state["overlaps"].get(key, 0) + 1
            if os.getpid() not in state["pids"]:
                state["pids"].append(os.getpid())

        self._update(change)

    def exit(self, key: str) -> None:
        def change(state: dict[str, Any]) -> None:
            state["inside"][key] -= 1
            state["sections"][key] = state["sections"].get(key, 0) + 1

        self._update(change)

    def read(self) -> dict[str, Any]:
        return self._update(lambda state: None)

    def of(self, key: str) -> tuple[int, int, int]:
        """``key``'s (sections completed, overlaps, most inside at once)."""
        state = self.read()
        return state["sections"].get(key, 0), state["overlaps"].get(key, 0), state["most"].get(key, 0)
