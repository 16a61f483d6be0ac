"""The module graph is a tree from the public modules down: no import circles.

Read from the sources (every import counts, lazy and TYPE_CHECKING ones included), so a
newcomer can read the package bottom-up and no import order can half-initialise a module.
"""

from __future__ import annotations

import ast
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
