"""The exceptions hotlock raises: one tree, each naming the key and the server.

No message ever contains a token or a password: tokens are bearer secrets and
servers are shown with their credentials stripped (see ``_backend.display_url``).
"""

from __future__ import annotations

__all__ = ["CacheError", "HotlockError", "LockLost", "LockNotAcquired"]


class HotlockError(Exception):
    """Base of everything hotlock raises on purpose."""

    def __init__(self, message: str, *, key: str | None = None, server: str | None = None) -> None:
        super().__init__(message)
        self.key = key
        self.server = server


class LockNotAcquired(HotlockError):
    """Another holder has the key (a try-once conflict, or a wait deadline passed): a 409."""


class LockLost(HotlockError):
    """The key no longer holds this lock's token: it expired, was taken over, or was deleted."""


class CacheError(HotlockError):
    """Redis is unreachable, timed out, or answered with an error. Never means "held elsewhere"."""
