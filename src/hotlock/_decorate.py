"""What Cache.locked and AsyncCache.locked share: the arguments checked once, when the
function is decorated, and the key built from each call's arguments."""

from __future__ import annotations

import inspect
import re
import string
from collections.abc import Callable
from typing import Any

from ._validate import auto_extend_ms, limit_int, ttl_ms, wait_ms

__all__ = ["Locking"]


def _field_names(template: str, fields: str) -> list[str]:
    """The parameter names the fields of ``fields`` (``template`` or a format spec nested in it) use."""
    try:
        parsed = list(string.Formatter().parse(fields))
    except ValueError as error:
        raise ValueError(f"template {template!r} is not a format string: {error}") from None
    names = []
    for _, field, spec, conversion in parsed:
        if field is None:
            continue
        # The parameter is the first name part: "tenant" in {tenant.id}, "ids" in {ids[0]}.
        first = re.split(r"[.\[]", field, maxsplit=1)[0]
        # "{}" and "{0}" would be filled from positional arguments, which depend on how
        # the caller passed them: a key must read the same however the function is called.
        if not first or first.isdecimal():
            raise ValueError(
                f"template {template!r} has the positional field {{{field}}}: name a parameter instead, "
                f"as in '{{invoice_id}}'"
            )
        if conversion not in (None, "r", "s", "a"):
            raise ValueError(f"template {template!r} has an unknown conversion !{conversion} in {{{field}}}")
        names.append(first)
        if spec:
            names += _field_names(template, spec)  # a nested field, as in {amount:{width}}
    return names


class Locking:
    """locked()'s arguments, checked as lock() and lock_wait() would check them."""

    __slots__ = ("fields", "options", "template", "ttl", "wait")

    def __init__(
        self, template: object, ttl: Any, wait: Any, limit: object, auto_extend: object, max_hold: Any
    ) -> None:
        if not isinstance(template, str):
            raise TypeError(f"template must be a str, not {type(template).__name__}")
        self.fields = _field_names(template, template)
        ms = ttl_ms(ttl)
        if wait is not None:
            wait_ms(wait)
        auto_extend_ms(auto_extend, max_hold, ms)
        limit = limit_int(limit)
        self.template = template
        # As given: each call passes them on to lock() or lock_wait().
        self.ttl = ttl
        self.wait = wait
        # lock()'s keywords, only where they differ from its defaults: the common case then
        # stays on lock()'s one-call native path.
        given = (("auto_extend", auto_extend, False), ("max_hold", max_hold, None), ("limit", limit, 1))
        self.options: dict[str, Any] = {name: value for name, value, default in given if value != default}

    def keys(self, fn: object, coroutine: bool) -> Callable[[tuple[Any, ...], dict[str, Any]], str]:
        """The key of a call of ``fn`` from its (args, kwargs); TypeError or ValueError when
        ``fn`` cannot be decorated: its kind (a coroutine function or not, as ``coroutine``
        asks) or a template field that names none of its parameters."""
        where = "hotlock.aio.AsyncCache.locked" if coroutine else "hotlock.Cache.locked"
        if isinstance(fn, (staticmethod, classmethod)):
            # The wrapper would be a plain function in the class body, and get self.
            kind = type(fn).__name__
            raise TypeError(f"{where}() goes below @{kind}: write @{kind} above it, so it wraps the function")
        if not callable(fn):
            raise TypeError(f"{where}() decorates a function, not {type(fn).__name__}")
        name = getattr(fn, "__qualname__", repr(fn))
        # The lock would be released as the generator is made, before its body runs.
        if inspect.isgeneratorfunction(fn) or inspect.isasyncgenfunction(fn):
            raise TypeError(
                f"{where}() cannot hold a lock across a generator's iterations: {name} is a generator function"
            )
        if inspect.iscoroutinefunction(fn) != coroutine:
            if coroutine:
                raise TypeError(
                    f"{where}() decorates coroutine functions, and {name} is not one: use hotlock.Cache.locked()"
                )
            raise TypeError(
                f"{where}() decorates plain functions, and {name} is a coroutine function: "
                "use hotlock.aio.AsyncCache.locked()"
            )
        signature = inspect.signature(fn)
        for field in self.fields:
            if field not in signature.parameters:
                raise ValueError(
                    f"template {self.template!r} names {field!r}, which is not a parameter of {name}{signature}"
                )
        template = self.template

        def key(args: tuple[Any, ...], kwargs: dict[str, Any]) -> str:
            # A call that does not fit the signature raises the TypeError here, before any
            # lock is taken; the defaults fill the fields the call left out.
            bound = signature.bind(*args, **kwargs)
            bound.apply_defaults()
            return template.format_map(bound.arguments)

        return key
