"""Argument checks, once for every backend and for sync and async alike.

Each check raises TypeError/ValueError naming the argument, before any byte is sent,
and turns seconds (int, float or timedelta) into the integer milliseconds backends speak.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from datetime import timedelta
from typing import Any

__all__ = [
    "DEFAULT_TTL",
    "MAX_KEY_BYTES",
    "MAX_LIMIT",
    "MAX_TTL_MS",
    "MIN_AUTO_TTL_MS",
    "Seconds",
    "amount_int",
    "auto_extend_ms",
    "key_bytes",
    "key_list",
    "ttl_ms",
    "value_bytes",
    "wait_ms",
]

Seconds = int | float | timedelta

DEFAULT_TTL = 30
MAX_KEY_BYTES = 1024
# "It always expires" must mean something: a week is the longest lease we grant.
MAX_TTL_MS = 7 * 24 * 3600 * 1000


def key_bytes(key: object, name: str = "key") -> bytes:
    if isinstance(key, str):
        try:
            raw = key.encode("utf-8")
        except UnicodeEncodeError as exc:
            raise ValueError(f"{name} cannot be encoded as UTF-8: {exc.reason}") from None
    elif isinstance(key, bytes):
        raw = key
    else:
        raise TypeError(f"{name} must be str or bytes, not {type(key).__name__}")
    if not raw:
        raise ValueError(f"{name} must not be empty")
    if len(raw) > MAX_KEY_BYTES:
        raise ValueError(f"{name} is {len(raw)} bytes; at most {MAX_KEY_BYTES} are allowed")
    return raw


def key_list(keys: object, name: str = "keys") -> tuple[list[Any], list[bytes]]:
    """The keys as given (a list) and as bytes."""
    # A lone str/bytes is iterable too, and would silently become one lock per character.
    if isinstance(keys, (str, bytes)) or not isinstance(keys, Iterable):
        raise TypeError(f"{name} must be an iterable of str or bytes keys, not {type(keys).__name__}")
    given = list(keys)
    raw = [key_bytes(k, f"{name}[{i}]") for i, k in enumerate(given)]
    if len(set(raw)) != len(raw):
        raise ValueError(f"{name} contains the same key twice")
    return given, raw


def _seconds(value: object, name: str) -> float:
    if isinstance(value, timedelta):
        return value.total_seconds()
    # bool is an int subclass; ttl=True is a bug, not one second.
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{name} must be seconds (int or float) or a timedelta, not {type(value).__name__}")
    if not math.isfinite(value):
        raise ValueError(f"{name} must be finite, not {value!r}")
    return float(value)


def ttl_ms(ttl: object, name: str = "ttl") -> int:
    # The common case, whole seconds in range, skips the general checks: this is the hot path.
    if type(ttl) is int and 0 < ttl <= MAX_TTL_MS // 1000:
        return ttl * 1000
    seconds = _seconds(ttl, name)
    ms = round(seconds * 1000)
    if ms <= 0:
        raise ValueError(f"{name} must be at least 1 ms, not {seconds!r} s")
    if ms > MAX_TTL_MS:
        raise ValueError(f"{name} of {seconds!r} s exceeds the 7-day maximum")
    return ms


def wait_ms(wait: object, name: str = "wait") -> int:
    seconds = _seconds(wait, name)
    if seconds < 0:
        raise ValueError(f"{name} must not be negative, not {seconds!r} s")
    ms = round(seconds * 1000)
    if ms > MAX_TTL_MS:
        raise ValueError(f"{name} of {seconds!r} s exceeds the 7-day maximum")
    return ms


# auto_extend renews every ttl/3: below this the renewer would do little else.
MIN_AUTO_TTL_MS = 100


def auto_extend_ms(auto_extend: object, max_hold: object, ttl: int) -> int | None:
    """Check ``auto_extend`` and ``max_hold`` (given ``ttl`` in ms); max_hold in ms, or None.

    The common case, no auto_extend and no max_hold, costs two identity checks.
    """
    if auto_extend is False and max_hold is None:
        return None
    if not isinstance(auto_extend, bool):
        raise TypeError(f"auto_extend must be True or False, not {type(auto_extend).__name__}")
    if not auto_extend:
        raise ValueError("max_hold needs auto_extend=True: a lock without it is never extended for you")
    if ttl < MIN_AUTO_TTL_MS:
        raise ValueError(
            f"auto_extend needs a ttl of at least {MIN_AUTO_TTL_MS / 1000:g} s (it renews every ttl/3), "
            f"not {ttl / 1000:g} s"
        )
    if max_hold is None:
        return None
    seconds = _seconds(max_hold, "max_hold")
    ms = round(seconds * 1000)
    if ms <= 0:
        raise ValueError(f"max_hold must be at least 1 ms, not {seconds!r} s")
    return ms


MAX_LIMIT = 2**31 - 1


def limit_int(limit: object) -> int:
    """A concurrency limit: an int >= 1 (1, the default, is a plain lock)."""
    if type(limit) is int and limit == 1:  # the hot path: one type test
        return 1
    if isinstance(limit, bool) or not isinstance(limit, int):
        raise TypeError(f"limit must be an int (the most holders at once), not {type(limit).__name__}")
    if limit < 1:
        raise ValueError(f"limit must be at least 1, not {limit}")
    if limit > MAX_LIMIT:
        raise ValueError(f"limit must be below 2**31, not {limit}")
    return limit


def value_bytes(value: object, name: str = "value") -> bytes:
    if isinstance(value, str):
        return value.encode("utf-8")
    if isinstance(value, bytes):
        return value
    if isinstance(value, int) and not isinstance(value, bool):
        return str(value).encode()
    raise TypeError(f"{name} must be str, bytes or int, not {type(value).__name__}")


def amount_int(amount: object, name: str = "amount") -> int:
    if isinstance(amount, bool) or not isinstance(amount, int):
        raise TypeError(f"{name} must be an int, not {type(amount).__name__}")
    if not -(2**63) <= amount < 2**63:
        raise ValueError(f"{name} must fit in a signed 64-bit integer")
    return amount
