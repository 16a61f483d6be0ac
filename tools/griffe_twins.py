"""Griffe extension for `make docs`: a twin made by hotlock._twin is shown with its model's parameters.

The API reference reads the source without running it, where such a twin's body takes its
arguments by name (``connect(**given)``); callers see the model's list (``inspect.signature``,
help(), type checkers), and so does the reference once this puts it there.
"""

from __future__ import annotations

from typing import Any

import griffe

# Each decorator of hotlock._twin, and how many of the body's own parameters it keeps first.
LEADS = {"hotlock._twin.takes": 0, "hotlock._twin.takes_method": 1, "hotlock._twin.forwards": 1}


class Twins(griffe.Extension):
    def on_package(self, *, pkg: griffe.Module, **kwargs: Any) -> None:
        for function in functions(pkg):
            for decorator in function.decorators:
                lead = LEADS.get(decorator.callable_path)
                if lead is None:
                    continue
                assert isinstance(decorator.value, griffe.ExprCall)
                model = pkg.modules_collection[decorator.value.arguments[0].canonical_path]
                own, given = list(function.parameters)[:lead], list(model.parameters)[lead:]
                function.parameters = griffe.Parameters(*own, *given)


def functions(obj: griffe.Object) -> list[griffe.Function]:
    found = []
    for member in obj.members.values():
        if member.is_alias:
            continue
        if isinstance(member, griffe.Function):
            found.append(member)
        elif isinstance(member, (griffe.Module, griffe.Class)):
            found.extend(functions(member))
    return found
