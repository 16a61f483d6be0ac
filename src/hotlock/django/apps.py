"""The Django app: INSTALLED_APPS = [..., "hotlock.django"] registers the system checks."""

from __future__ import annotations

from django.apps import AppConfig


class HotlockConfig(AppConfig):  # type: ignore[misc]  # AppConfig is Any without stubs
    name = "hotlock.django"
    label = "hotlock"
    verbose_name = "hotlock"

    def ready(self) -> None:
        from . import checks  # noqa: F401  (registers them)
