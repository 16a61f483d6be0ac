"""The module graph is a tree from the public modules down: no import circles.

Read from the sources (every import counts, lazy and TYPE_CHECKING ones included), so a
newcomer can read the package bottom-up and no import order can half-initialise a module.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import hotlock

PACKAGE = Path(hotlock.__file__).parent


def module_names() -> dict[str, Path]:
    names = {}
    for path in PACKAGE.rglob("*.py*"):
        if path.suffix not in (".py", ".pyi"):
            continue
        parts = ["hotlock", *path.relative_to(PACKAGE).with_suffix("").parts]
        if parts[-1] == "__init__":
            parts.pop()
        names.setdefault(".".join(parts), path)
    return names


def import_graph() -> dict[str, set[str]]:
    modules = module_names()
    graph: dict[str, set[str]] = {name: set() for name in modules}
    for name, path in modules.items():
        package = name if path.stem == "__init__" else name.rpartition(".")[0]
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom):
                base = package.split(".")[: len(package.split(".")) - node.level + 1] if node.level else []
                target = ".".join([*base, *([node.module] if node.module else [])])
                # `from . import _ident` imports the submodule, not the package.
                subs = {f"{target}.{alias.name}" for alias in node.names} & modules.keys()
                graph[name] |= subs if len(subs) == len(node.names) else {target} & modules.keys()
            elif isinstance(node, ast.Import):
                graph[name] |= {alias.name for alias in node.names} & modules.keys()
        graph[name].discard(name)
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}  # 1 on the path, 2 done
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                return [*path[path.index(nxt) :], nxt]
            if nxt not in state and (found := visit(nxt)):
                return found
        path.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state and (found := visit(node)):
            return found
    return None


def test_the_checker_finds_a_circle() -> None:
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None


def test_the_module_graph_has_no_circles() -> None:
    graph = import_graph()
    assert "hotlock._config" in graph and "hotlock.aio._cache" in graph
    assert find_cycle(graph) is None, " -> ".join(find_cycle(graph) or [])


# -- floors ----------------------------------------------------------------------------
#
# The house drawn from its imports: a room stands one floor above the highest room it
# imports (lazy imports count, TYPE_CHECKING ones do not: they never run). The extension
# is a room too, and its imports are the Python ones of ext/ (its .pyi stubs import for
# types only). The protocol pieces stand at the bottom, the public face near the top.

ROOT = PACKAGE.parent.parent
EXT = ROOT / "ext"
EXTENSION_ROOMS = ("hotlock._native", "hotlock._native_tls")
MAX_FLOORS = 10


def _runtime_imports(tree: ast.AST) -> list[ast.Import | ast.ImportFrom]:
    """The import statements that run: those under `if TYPE_CHECKING:` left out."""
    skipped: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            skipped.update(id(inner) for stmt in node.body for inner in ast.walk(stmt))
    return [n for n in ast.walk(tree) if isinstance(n, (ast.Import, ast.ImportFrom)) and id(n) not in skipped]


def runtime_graph() -> dict[str, set[str]]:
    """hotlock's and bench's rooms and the rooms each imports when it runs."""
    files: dict[str, Path] = {}
    for base, package in ((PACKAGE, "hotlock"), (ROOT / "bench", "bench")):
        for path in sorted(base.rglob("*.py")):
            parts = [package, *path.relative_to(base).with_suffix("").parts]
            if parts[-1] == "__init__":
                parts.pop()
            files[".".join(parts)] = path
    rooms = set(files) | set(EXTENSION_ROOMS)
    graph: dict[str, set[str]] = {}
    for name, path in files.items():
        package = name if path.stem == "__init__" else name.rpartition(".")[0]
        deps: set[str] = set()
        for node in _runtime_imports(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom):
                base = package.split(".")[: len(package.split(".")) - node.level + 1] if node.level else []
                target = ".".join([*base, *([node.module] if node.module else [])])
                subs = {f"{target}.{alias.name}" for alias in node.names} & rooms
                deps |= subs if len(subs) == len(node.names) else subs | ({target} & rooms)
            else:
                deps |= {alias.name for alias in node.names} & rooms
        graph[name] = deps
    # The extension: ext/_native.pyx and the .pxi files it includes; _native_tls includes it.
    ext_deps: set[str] = set()
    for path in sorted([*EXT.glob("*.pyx"), *EXT.glob("*.pxi")]):
        for match in re.finditer(r"^from (hotlock[\w.]*) import ([\w, ]+)", path.read_text(), re.M):
            module, names = match[1], [n.strip().split(" ")[0] for n in match[2].split(",")]
            subs = {f"{module}.{n}" for n in names} & rooms
            ext_deps |= subs | ({module} & rooms if len(subs) < len(names) else set())
    graph["hotlock._native"] = set(ext_deps)
    graph["hotlock._native_tls"] = set(ext_deps)
    # Importing a.b.c runs a and a.b first.
    for name, deps in graph.items():
        for dep in list(deps):
            parts = dep.split(".")
            deps |= {".".join(parts[:i]) for i in range(1, len(parts))} & rooms
        deps -= {name}
        deps -= {p for p in deps if name.startswith(p + ".")}  # a module's own package is running already
    return graph


def floors(graph: dict[str, set[str]]) -> dict[str, int]:
    found: dict[str, int] = {}

    def floor(room: str) -> int:
        if room not in found:
            found[room] = 0  # a circle reads as floor 0, and find_cycle names it
            found[room] = 1 + max((floor(dep) for dep in graph[room]), default=0)
        return found[room]

    for room in graph:
        floor(room)
    return found


def drawn(found: dict[str, int]) -> str:
    top = max(found.values())
    return "\n".join(f"{k:2} {' '.join(sorted(r for r, f in found.items() if f == k))}" for k in range(top, 0, -1))


def test_the_floor_counter_counts() -> None:
    assert floors({"a": {"b"}, "b": {"c"}, "c": set(), "d": {"c"}}) == {"a": 3, "b": 2, "c": 1, "d": 2}


def test_the_running_imports_have_no_circles_and_the_library_at_most_ten_floors() -> None:
    graph = runtime_graph()
    assert graph["hotlock._native"] >= {"hotlock.errors", "hotlock._scripts"}, graph["hotlock._native"]
    assert find_cycle(graph) is None, " -> ".join(find_cycle(graph) or [])
    found = floors(graph)
    library = {room: floor for room, floor in found.items() if room.startswith("hotlock")}
    assert max(library.values()) <= MAX_FLOORS, drawn(found)
    # The protocol pieces at the bottom, below every backend; the public face above them.
    protocol = (
        "hotlock.errors",
        "hotlock._keys",
        "hotlock._ident",
        "hotlock._scripts",
        "hotlock._dialect",
        "hotlock._config",
    )
    backends = [room for room in library if room.startswith("hotlock.backends.")]
    assert max(found[p] for p in protocol) < min(found[b] for b in backends), drawn(found)
    assert found["hotlock"] > max(found[b] for b in backends), drawn(found)
