"""A Django cache backend whose ``cache.lock(...)`` is hotlock's: for code written against
django-redis's ``cache.lock``, moved to Django's own Redis cache.

    CACHES = {"default": {"BACKEND": "hotlock.django.cache.RedisCache", "LOCATION": "redis://..."}}

    from django.core.cache import cache
    with cache.lock("import:tenant-7", timeout=120, blocking_timeout=5): ...

Everything but ``lock`` is Django's ``django.core.cache.backends.redis.RedisCache``. The
locks go to the server of the HOTLOCK setting (hotlock.django.get_cache()), which is
usually the same Redis.
"""

from __future__ import annotations

from django.core.cache.backends.redis import RedisCache as DjangoRedisCache

from .._validate import DEFAULT_TTL, Seconds
from . import DjangoLock

__all__ = ["RedisCache"]


class RedisCache(DjangoRedisCache):  # type: ignore[misc]  # Any without Django's stubs
    def lock(
        self,
        key: str,
        timeout: Seconds | None = DEFAULT_TTL,
        sleep: float = 0.1,
        blocking: bool = True,
        blocking_timeout: Seconds | None = 10.0,
        thread_local: bool = True,
    ) -> DjangoLock:
        """django-redis's ``cache.lock`` signature, on hotlock (hotlock.django.DjangoLock)."""
        return DjangoLock(key, timeout, sleep, blocking, blocking_timeout, thread_local)
