"""docs/managed.md's examples, checked without the network and without the cloud SDKs they
import: each Python block compiles, each provider class it defines has get_credentials(),
and each connect() call names only arguments connect() has."""

from __future__ import annotations

import ast
import inspect
import re
from pathlib import Path

import pytest

import hotlock
import hotlock.aio

PAGE = Path(__file__).resolve().parent.parent / "docs" / "managed.md"
BLOCKS = re.findall(r"```python\n(.*?)```", PAGE.read_text(), flags=re.DOTALL)


def test_the_page_has_an_example_per_service() -> None:
    text = PAGE.read_text()
    for heading in ("ElastiCache", "Azure", "Memorystore", "Upstash", "Redis Cloud", "least-privilege ACL"):
        assert re.search(rf"^## .*{heading}", text, flags=re.MULTILINE), heading
    assert len(BLOCKS) >= 6


@pytest.mark.parametrize("block", BLOCKS, ids=[f"block{i}" for i in range(len(BLOCKS))])
def test_each_example_compiles_and_calls_connect_as_it_is(block: str) -> None:
    tree = ast.parse(compile(block, str(PAGE), "exec", flags=ast.PyCF_ONLY_AST | ast.PyCF_ALLOW_TOP_LEVEL_AWAIT))
    names = set(inspect.signature(hotlock.connect).parameters) | set(inspect.signature(hotlock.aio.connect).parameters)
    for node in ast.walk(tree):
        if isinstance(node, ast.ClassDef) and node.name.endswith(("Provider", "Secret")):
            methods = {n.name for n in node.body if isinstance(n, ast.FunctionDef)}
            assert "get_credentials" in methods, node.name
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "connect":
            for keyword in node.keywords:
                assert keyword.arg in names, keyword.arg
