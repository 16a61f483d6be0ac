"""What the web integrations (hotlock.django, hotlock.asgi) share: the key template checked
once, the key built from a request's route parameters, and the answer to a refused request.

    409 Conflict             LockNotAcquired: someone else holds the key. Retry-After: the
                             holder's remaining TTL, rounded up to whole seconds (at least 1).
    503 Service Unavailable  CacheError: the cache is down, so nobody can know who holds it.
                             Retry-After: 1.
"""

from __future__ import annotations

import math
import string
from collections.abc import Callable, Mapping
from typing import Any

from ._decorate import _field_names
from .errors import CacheError, LockNotAcquired

__all__ = ["CONFLICT", "UNAVAILABLE", "KeyOf", "key_maker", "refusal", "retry_after_header"]

CONFLICT = 409
UNAVAILABLE = 503
# Retry-After when the holder's TTL is unknown, and on an outage: soon, not at once.
DEFAULT_RETRY_AFTER = 1

# A key: a template over the route's parameters, or a function of the request.
KeyOf = str | Callable[[Any], str]


def key_maker(key: KeyOf) -> Callable[[Any, Mapping[str, Any]], str]:
    """``key`` checked now (at decoration), as a function ``(request, params) -> key``.

    A template's fields name route parameters (``"settle:{invoice_id}"``); positional fields
    are refused, as for ``Cache.locked``. A callable is given the request.
    """
    if callable(key):
        fn = key
        return lambda request, params: _checked(fn(request))
    if not isinstance(key, str):
        raise TypeError(f"key must be a template str or a function of the request, not {type(key).__name__}")
    names = set(_field_names(key, key))
    formatter = string.Formatter()

    def from_params(request: Any, params: Mapping[str, Any]) -> str:
        missing = names - set(params)
        if missing:
            raise LookupError(
                f"lock key template {key!r} names {', '.join(sorted(missing))}, "
                f"not a parameter of this route (it has {', '.join(sorted(params)) or 'none'})"
            )
        return formatter.vformat(key, (), params)

    return from_params


def _checked(key: object) -> str:
    if not isinstance(key, str):
        raise TypeError(f"the key function must return a str, not {type(key).__name__}")
    return key


def retry_after_header(error: LockNotAcquired | CacheError) -> str:
    """Retry-After in whole seconds: the holder's remaining TTL rounded up, else 1."""
    after = getattr(error, "retry_after", None)
    if after is None or isinstance(error, CacheError):
        return str(DEFAULT_RETRY_AFTER)
    return str(max(DEFAULT_RETRY_AFTER, math.ceil(after)))


def refusal(error: LockNotAcquired | CacheError) -> tuple[int, str, dict[str, str]]:
    """The status, body text and headers that answer a request refused by ``error``."""
    headers = {"Retry-After": retry_after_header(error)}
    if isinstance(error, LockNotAcquired):
        return CONFLICT, "This resource is busy: another request holds its lock.", headers
    return UNAVAILABLE, "The lock service is unavailable.", headers
