"""One measurement in a process of its own: ``python -m bench.run '<json spec>'`` prints one JSON line.

The comparison run starts this under taskset on the client core, once per contestant
per workload per round, so no run inherits another's connections, caches or loop, and
getrusage covers this client alone.
"""

from __future__ import annotations

import json
import sys
from typing import Any

from . import workloads
from .contestants import open_sync


def measure(spec: dict[str, Any]) -> dict[str, Any]:
    kind, name, url, tag = spec["kind"], spec["contestant"], spec["url"], spec["tag"]
    if kind == "sync":
        c = open_sync(name, url)
        try:
            return workloads.timed(workloads.sync_op(c, spec["workload"], tag), spec["seconds"])
        finally:
            c.close()
    if kind == "async":
        return workloads.run_async(
            lambda: workloads.async_cycles(name, url, tag, spec["tasks"], spec["seconds"]), spec["loop"]
        )
    if kind == "contention" and spec["mode"] == "threads":
        c = open_sync(name, url)
        try:
            return workloads.contention_threads(c, tag, spec["workers"], spec["keys"], spec["seconds"])
        finally:
            c.close()
    if kind == "contention":
        return workloads.contention_processes(name, url, tag, spec["workers"], spec["keys"], spec["seconds"])
    if kind == "handoff":
        return workloads.handoff(name, url, tag, spec["rounds"])
    raise ValueError(f"unknown kind {kind!r}")


def main() -> int:
    spec = json.loads(sys.argv[1])
    result = measure(spec)
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
