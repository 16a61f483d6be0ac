"""Credentials: connect(credential_provider=..., reauth_interval=...) checked, the provider
asked, and the AUTH command built, in one place for every backend (sync and async, native
and redis-py, cluster nodes, Sentinel primaries and the wake-up subscribers).

A provider is any object with ``get_credentials()`` returning ``(username, password)`` or
``(password,)``: redis-py's ``CredentialProvider`` shape, so its providers and
redis-entraid's are taken as they are. It is asked at every new connection (and, with
``reauth_interval``, again on live ones), so a token that rotates (AWS IAM tokens live 15
minutes, Entra ID and Memorystore tokens must be re-sent before they expire) never needs
a restart. Asking is cheap for the providers that matter (they cache their token and
refresh it in the background, or sign locally), and its cost is paid only on a connect.

Its own failure (a token service down, a bug in it) is a CacheError that names the
provider, chained to what it raised: Redis is unreachable for the same reason, and the
caller can tell which part failed.
"""

from __future__ import annotations

import logging
import math
from typing import Any, Protocol

from .errors import CacheError, cache_error

__all__ = [
    "CredentialProvider",
    "ask",
    "ask_async",
    "auth_args",
    "auth_command",
    "auth_command_async",
    "check_credentials",
    "is_auth_refusal",
    "reauth_command",
    "reauth_command_async",
]


log = logging.getLogger("hotlock")


class CredentialProvider(Protocol):
    """What connect(credential_provider=...) takes (redis-py's CredentialProvider shape)."""

    def get_credentials(self) -> tuple[str] | tuple[str, str]: ...


class Credentialed(Protocol):
    """What auth_command reads of a hotlock._config.ServerConfig (named by its shape: the
    config module imports this one)."""

    @property
    def credential_provider(self) -> CredentialProvider | None: ...
    @property
    def username(self) -> str | None: ...
    @property
    def password(self) -> str | None: ...
    @property
    def display(self) -> str: ...


# The error replies that say this connection is not (or no longer) authenticated: the
# command did not run, so it may be sent again on a new connection, which asks the
# provider again. NOAUTH: the connection was never authenticated, or the server forgot it
# (a restart behind a proxy that kept the client's socket). WRONGPASS: a re-sent AUTH
# was refused (the password was rotated away).
AUTH_REFUSALS = ("NOAUTH", "WRONGPASS")


def is_auth_refusal(text: str) -> bool:
    """Whether an error reply's text says the connection is not authenticated."""
    return text.startswith(AUTH_REFUSALS)


def check_credentials(
    provider: object, reauth_interval: object, username: str | None, password: str | None
) -> tuple[CredentialProvider | None, float]:
    """connect()'s ``credential_provider`` and ``reauth_interval``, checked before any I/O:
    the provider (or None) and the interval in seconds (0.0: never re-sent)."""
    if provider is not None:
        ask_fn = getattr(provider, "get_credentials", None)
        if not callable(ask_fn):
            raise TypeError(
                "credential_provider must have a get_credentials() method returning (username, password) "
                f"or (password,), as redis-py's CredentialProvider does; {type(provider).__name__} has none"
            )
        if username is not None or password is not None:
            # Two sources of one secret: which would win is a guess, so neither does.
            raise ValueError("give the credentials either in the url or as credential_provider, not both")
    if reauth_interval is None:
        return provider, 0.0  # type: ignore[return-value]
    if isinstance(reauth_interval, bool) or not isinstance(reauth_interval, (int, float)):
        raise TypeError(f"reauth_interval must be seconds (int or float), not {type(reauth_interval).__name__}")
    if not (math.isfinite(reauth_interval) and reauth_interval > 0):
        raise ValueError(f"reauth_interval must be a positive number of seconds, not {reauth_interval!r}")
    if provider is None:
        # Re-sending the url's fixed password would change nothing.
        raise ValueError("reauth_interval needs a credential_provider (a fixed password needs no re-sending)")
    return provider, float(reauth_interval)  # type: ignore[return-value]


def _named(provider: object) -> str:
    return f"credential_provider {type(provider).__name__}"


def _checked(provider: object, found: Any, server: str) -> tuple[str | None, str | None]:
    """The provider's answer as (username or None, password or None)."""
    if (
        isinstance(found, (tuple, list))
        and len(found) in (1, 2)
        and all(isinstance(x, (str, type(None))) for x in found)
    ):
        if len(found) == 1:
            return None, found[0]
        return found[0] or None, found[1]
    # Only its shape is shown: it may hold the secret.
    shape = type(found).__name__
    if isinstance(found, (tuple, list)):
        shape += f" of {len(found)} ({', '.join(type(x).__name__ for x in found[:3])})"
    raise cache_error(
        f"{_named(provider)}.get_credentials() returned a {shape}, not (username, password) or (password,) of str",
        server,
    )


def ask(provider: CredentialProvider, server: str) -> tuple[str | None, str | None]:
    """Ask ``provider`` for (username or None, password or None); its failure a CacheError."""
    try:
        found = provider.get_credentials()
    except CacheError:
        raise
    except Exception as exc:
        raise cache_error(f"{_named(provider)}.get_credentials() failed: {type(exc).__name__}: {exc}", server) from exc
    return _checked(provider, found, server)


async def ask_async(provider: CredentialProvider, server: str) -> tuple[str | None, str | None]:
    """ask() in a coroutine: ``get_credentials_async()`` when the provider has its own
    (redis-entraid's, say), else ``get_credentials()``, as redis.asyncio does. redis-py's
    base class has a default one that only logs a warning and calls the sync one: that one
    is skipped for the sync one directly."""
    method = getattr(type(provider), "get_credentials_async", None)
    if method is None or getattr(method, "__qualname__", "") == "CredentialProvider.get_credentials_async":
        return ask(provider, server)
    try:
        found = await provider.get_credentials_async()  # type: ignore[attr-defined]
    except CacheError:
        raise
    except Exception as exc:
        raise cache_error(
            f"{_named(provider)}.get_credentials_async() failed: {type(exc).__name__}: {exc}", server
        ) from exc
    return _checked(provider, found, server)


def auth_args(username: str | None, password: str | None) -> tuple[bytes, ...] | None:
    """The AUTH command for these credentials, or None (no credentials: nothing sent).

    A username without a password is sent as that user with an empty password (an ACL
    user with ``nopass`` accepts any), never dropped: dropping it would connect as
    ``default``, another user with other rights."""
    if username:
        return (b"AUTH", username.encode(), (password or "").encode())
    if password is not None:
        return (b"AUTH", password.encode())
    return None


def auth_command(config: Credentialed) -> tuple[bytes, ...] | None:
    """The AUTH command a new connection sends now: the provider asked at this moment,
    else the url's credentials."""
    if config.credential_provider is not None:
        return auth_args(*ask(config.credential_provider, config.display))
    return auth_args(config.username, config.password)


async def auth_command_async(config: Credentialed) -> tuple[bytes, ...] | None:
    """auth_command() in a coroutine (the provider's own async method when it has one)."""
    if config.credential_provider is not None:
        return auth_args(*await ask_async(config.credential_provider, config.display))
    return auth_args(config.username, config.password)


def reauth_command(config: Credentialed) -> tuple[bytes, ...] | None:
    """The AUTH command to send again on a live connection (reauth_interval), or None.

    The provider failing here fails no call: the connection is still authenticated with
    what it was given before, so the call goes on, and the failure is logged (a WARNING)
    and tried again at the next interval. A new connection cannot do without the
    provider's answer: there its failure is the call's CacheError (auth_command)."""
    try:
        return auth_command(config)
    except CacheError as exc:
        log.warning("AUTH not re-sent (the connection keeps its credentials): %s", exc)
        return None


async def reauth_command_async(config: Credentialed) -> tuple[bytes, ...] | None:
    """reauth_command() in a coroutine."""
    try:
        return await auth_command_async(config)
    except CacheError as exc:
        log.warning("AUTH not re-sent (the connection keeps its credentials): %s", exc)
        return None
