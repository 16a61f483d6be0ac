"""The HOTLOCK setting, read and checked in one place.

HOTLOCK = {
    "URL": "redis://10.0.0.5:6379/0",   # default: CACHE_URL, else the in-process fallback
    "PREFIX": "hotlock:",
    "TIMEOUT": 2.0,                      # every reply, seconds
    "CONNECT_TIMEOUT": 2.0,
    "OPTIONS": {},                       # any other hotlock.connect() keyword (metrics, backend, ...)
}
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any

__all__ = ["Settings", "SettingsError", "read_settings"]

_KEYS = {"URL", "PREFIX", "TIMEOUT", "CONNECT_TIMEOUT", "OPTIONS"}


class SettingsError(ValueError):
    """The HOTLOCK setting is malformed."""


@dataclass(frozen=True)
class Settings:
    url: str | None
    prefix: str | bytes = "hotlock:"
    timeout: float = 2.0
    connect_timeout: float = 2.0
    options: dict[str, Any] = field(default_factory=dict)

    @property
    def prefix_bytes(self) -> bytes:
        return self.prefix.encode() if isinstance(self.prefix, str) else self.prefix

    def connect_kwargs(self) -> dict[str, Any]:
        return {
            "prefix": self.prefix,
            "timeout": self.timeout,
            "connect_timeout": self.connect_timeout,
            **self.options,
        }


def read_settings() -> Settings:
    from django.conf import settings

    given = getattr(settings, "HOTLOCK", {})
    if not isinstance(given, dict):
        raise SettingsError(f"HOTLOCK must be a dict, not {type(given).__name__}")
    unknown = set(given) - _KEYS
    if unknown:
        raise SettingsError(f"HOTLOCK has unknown keys {sorted(unknown)}; it takes {sorted(_KEYS)}")
    url = given.get("URL") or os.environ.get("CACHE_URL") or None
    if url is not None and not isinstance(url, str):
        raise SettingsError(f"HOTLOCK['URL'] must be a str, not {type(url).__name__}")
    options = given.get("OPTIONS", {})
    if not isinstance(options, dict):
        raise SettingsError(f"HOTLOCK['OPTIONS'] must be a dict, not {type(options).__name__}")
    if "lazy" in options or "url" in options:
        raise SettingsError("HOTLOCK['OPTIONS'] must not set url or lazy: the URL goes in HOTLOCK['URL']")
    found = Settings(
        url=url,
        prefix=given.get("PREFIX", "hotlock:"),
        timeout=given.get("TIMEOUT", 2.0),
        connect_timeout=given.get("CONNECT_TIMEOUT", 2.0),
        options=dict(options),
    )
    # The library's own checks of every argument, with no I/O (lazy=True connects nothing);
    # without a URL, connect() would only say "no cache configured" once more.
    if found.url is None:
        return found
    import hotlock

    try:
        hotlock.connect(found.url, lazy=True, **found.connect_kwargs()).close()
    except (TypeError, ValueError) as error:
        raise SettingsError(f"HOTLOCK: {error}") from None
    return found
