"""One parameter list for a call spelt twice (a def and an async def): the twin is given the other's.

Python has no syntax for two functions sharing a parameter list, so the twin's body is
written taking the arguments by name, and the function callers see is made here from the
model's list: the model's parameters, kinds and defaults, as Python binds them (its
TypeErrors included), each argument then handed to the body by keyword. ``inspect.signature``
and help() read that list, type checkers read it through the ParamSpec of the decorator,
the API reference (which reads the source) through tools/griffe_twins.py. Made from source
at import, as dataclasses makes ``__init__``: one plain call more per call, where
``inspect.Signature.bind`` would cost as much as the async lock() itself. The model stays a
plain function: nothing here runs when it is called.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable
from typing import Any, Concatenate, ParamSpec, TypeVar

__all__ = ["forwards", "takes", "takes_method"]

P = ParamSpec("P")
R = TypeVar("R")
S = TypeVar("S")


def takes(model: Callable[P, object]) -> Callable[[Callable[..., R]], Callable[P, R]]:
    """A function's decorator: it takes what ``model`` takes (its body each by keyword)."""
    return lambda body: _twin(model, body, 0)


def takes_method(
    model: Callable[Concatenate[Any, P], object],
) -> Callable[[Callable[Concatenate[S, ...], R]], Callable[Concatenate[S, P], R]]:
    """A method's decorator: after its own ``self``, it takes what the method ``model`` takes."""
    return lambda body: _twin(model, body, 1)


def forwards(model: Callable[Concatenate[S, P], R]) -> Callable[[Callable[..., Any]], Callable[Concatenate[S, P], R]]:
    """The decorator of a function that calls its first argument's method ``model``: it
    takes, and returns, what that method does (its type variables kept)."""
    return lambda body: _twin(model, body, 1)


def _twin(model: Callable[..., object], body: Callable[..., Any], lead: int) -> Any:
    """``body``'s first ``lead`` parameters (a method's self), then the model's after as
    many, and body's return annotation; the body is called with the model's by keyword."""
    own = list(inspect.signature(body).parameters.values())[:lead]
    rest = list(inspect.signature(model).parameters.values())[lead:]
    # A body that does not take every argument fails here, at import, not at a call.
    inspect.signature(body).bind(*[p.name for p in own], **{p.name: None for p in rest})
    spelt = [p.name for p in own]
    for p in rest:
        if p.kind is p.KEYWORD_ONLY and "*" not in spelt:
            spelt.append("*")
        elif p.kind not in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY):
            raise TypeError(f"{model.__qualname__}: parameter {p.name!r} is {p.kind.description}, not supported")
        spelt.append(p.name if p.default is p.empty else f"{p.name}=defaults[{p.name!r}]")
    handed = ", ".join([p.name for p in own] + [f"{p.name}={p.name}" for p in rest])
    coroutine = inspect.iscoroutinefunction(body)
    source = (
        f"{'async ' if coroutine else ''}def {body.__name__}({', '.join(spelt)}):\n"
        f"    return {'await ' if coroutine else ''}body({handed})\n"
    )
    namespace: dict[str, Any] = {"body": body, "defaults": {p.name: p.default for p in rest}}
    exec(source, namespace)
    made = namespace[body.__name__]
    functools.update_wrapper(made, body)
    if hasattr(made.__code__, "co_qualname"):  # Python 3.11+: its TypeErrors name it as before
        made.__code__ = made.__code__.replace(co_qualname=body.__qualname__)
    signature = inspect.signature(body).replace(parameters=[*own, *rest])
    made.__signature__ = signature
    made.__annotations__ = {
        **{p.name: p.annotation for p in signature.parameters.values() if p.annotation is not p.empty},
        "return": signature.return_annotation,
    }
    return made
