"""The Django app: INSTALLED_APPS = [..., "hotlock.django"] registers hotlock's system checks.

Always (``manage.py check``): the HOTLOCK setting reads (a bad URL or option is an Error
before anything runs). With ``--deploy``: a cache is configured (else locks exclude nothing
outside one process), and the server answers with ``maxmemory-policy noeviction`` (an
evicted lock is granted twice) and with persistence (a restart without it frees every lock
while its holders run). These are the checks of ``hotlock doctor``, run on the configured
server. (Here rather than in a module of their own: the package's import graph stays low.)
"""

from __future__ import annotations

from typing import Any

from django.apps import AppConfig
from django.core import checks

from .._cli._doctor import FAIL, OK, Check, check_eviction, check_persistence
from .._cli._target import CliError, open_target
from ._settings import SettingsError, read_settings

__all__ = ["HotlockConfig", "check_server", "check_settings"]


@checks.register(checks.Tags.caches)  # type: ignore[untyped-decorator]
def check_settings(app_configs: Any = None, **kwargs: Any) -> list[checks.CheckMessage]:
    try:
        read_settings()
    except SettingsError as error:
        return [checks.Error(str(error), hint="see docs/integrations.md", id="hotlock.E001")]
    return []


def _message(found: Check, ident: str) -> checks.CheckMessage:
    kind = checks.Error if found.status == FAIL else checks.Warning
    return kind(f"{found.check}: {found.detail}", hint=found.advice, id=ident)


@checks.register(checks.Tags.caches, deploy=True)  # type: ignore[untyped-decorator]
def check_server(app_configs: Any = None, **kwargs: Any) -> list[checks.CheckMessage]:
    try:
        settings = read_settings()
    except SettingsError:
        return []  # check_settings says it
    if settings.url is None:
        return [
            checks.Warning(
                "no cache configured (HOTLOCK['URL'] and CACHE_URL are unset): locks exclude nothing "
                "outside each process",
                hint="set HOTLOCK = {'URL': 'redis://...'} or CACHE_URL",
                id="hotlock.W001",
            )
        ]
    try:
        target = open_target(settings.url, settings.prefix_bytes, settings.timeout)
    except CliError as error:
        return [checks.Warning(f"cannot check the lock server: {error}", id="hotlock.W002")]
    try:
        found: list[checks.CheckMessage] = []
        # (the check, its id when it fails, its id when it warns)
        for check, failed, warned in (
            (check_eviction, "hotlock.E002", "hotlock.W004"),
            (check_persistence, "hotlock.E003", "hotlock.W003"),
        ):
            found += [_message(c, failed if c.status == FAIL else warned) for c in check(target) if c.status != OK]
        return found
    finally:
        target.close()


class HotlockConfig(AppConfig):  # type: ignore[misc]  # AppConfig is Any without stubs
    name = "hotlock.django"
    label = "hotlock"
    verbose_name = "hotlock"
