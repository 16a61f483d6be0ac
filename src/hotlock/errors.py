"""The exceptions hotlock raises: one tree, each naming the key and the server.

No message ever contains a token or a password: tokens are bearer secrets and
servers are shown with their credentials stripped (see ``ServerConfig.display``).

Below the public tree, the two exceptions every Redis backend raises inside itself (never
to the caller): ReplyError, an error reply, and LinkLost, a reply that may never come. The
backends turn them into CacheError with cache_error(), or act on them (a redirection, one
retry with the same token). A third, Unreplicated, goes from a backend to the lease: an
extend too few replicas confirmed under wait_replicas, which the lease turns into its loss.
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
    """Another holder has the key (a try-once conflict, or a wait deadline passed): a 409.

    ``retry_after`` is the holder's remaining TTL in seconds as the failed acquire found it
    (with ``limit=N``: until the first permit frees), an upper bound on how long the key
    stays held unless its holder extends it; None when the server could not say (a key
    without a TTL, a key held as the other kind of lock).
    """

    def __init__(
        self,
        message: str,
        *,
        key: str | None = None,
        server: str | None = None,
        retry_after: float | None = None,
    ) -> None:
        super().__init__(message, key=key, server=server)
        self.retry_after = retry_after


class LockLost(HotlockError):
    """The key no longer holds this lock's token: it expired, was taken over, or was deleted."""


class CacheError(HotlockError):
    """Redis is unreachable, timed out, or answered with an error. Never means "held elsewhere"."""


def cache_error(what: str, server: str, key: bytes | None = None) -> CacheError:
    """A CacheError naming the operation, the key (as stored, prefix included) and the server."""
    shown = None if key is None else key.decode("utf-8", "backslashreplace")
    where = f" on key {shown!r}" if shown is not None else ""
    return CacheError(f"{what}{where} (server {server})", key=shown, server=server)


def unreplicated(what: str, got: int, wanted: int, wait_ms: int, where: str = "") -> str:
    """Under wait_replicas: why a write too few replicas confirmed was undone (an acquire's
    CacheError, an extend's loss), in the same words on every backend. ``where`` names the
    node on a cluster (" of host:port")."""
    return f"{what} undone: {got} of {wanted} replicas{where} confirmed it within {wait_ms} ms (wait_replicas)"


class Unreplicated(Exception):
    """Under wait_replicas: extends the primary made that fewer replicas than asked
    confirmed within the wait (a primary cut off from its replicas would otherwise go on
    renewing a lock that a promoted replica has let expire). The backend has released
    those keys, as it undoes an unconfirmed acquire, so nobody waits out a lease no one
    holds; the lease records the loss and tells the work (LockLost, ``lock.lost``).

    ``results`` is every extend's outcome in the caller's order, False for the unconfirmed
    ones; ``why`` gives, by index, why each unconfirmed one's lease is lost.
    """

    def __init__(self, results: list[bool], why: dict[int, str]) -> None:
        super().__init__(next(iter(why.values()), "unreplicated"))
        self.results = results
        self.why = why


def unconfirmed_extends(
    what: str, results: list[bool], got: int, wanted: int, wait_ms: int, where: str = ""
) -> Unreplicated:
    """The Unreplicated for a batch of extends behind one WAIT that confirmed ``got``:
    every extend that ran (True) is unconfirmed. Its callers release those keys."""
    text = f"is lost: {unreplicated(what, got, wanted, wait_ms, where)}"
    return Unreplicated([False] * len(results), {i: text for i, ok in enumerate(results) if ok})


class ReplyError(Exception):
    """An error reply, with the server's own text ("MOVED 3999 127.0.0.1:7002")."""

    # The key of the call it came to, when it ends a batch: the call's error names it.
    key: bytes | None = None

    @property
    def code(self) -> str:
        return str(self).split(" ", 1)[0]


class LinkLost(Exception):
    """The request may or may not have reached the node: an I/O error or a timeout."""
