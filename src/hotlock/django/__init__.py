"""hotlock.django: the HOTLOCK setting, a lazily connected cache, system checks, a view
decorator answering 409 with Retry-After, and a drop-in for django-redis's ``cache.lock``.

    # settings.py
    INSTALLED_APPS = [..., "hotlock.django"]        # the system checks
    HOTLOCK = {"URL": "redis://10.0.0.5:6379/0"}    # or CACHE_URL

    # views.py
    from hotlock.django import locked

    @locked("settle:{invoice_id}", ttl=60)          # the URL's kwargs fill the template
    def settle(request, invoice_id): ...            # a held key answers 409 + Retry-After

    # anywhere
    from hotlock.django import get_cache, lock
    with lock("import:tenant-7", timeout=120, blocking_timeout=5):   # django-redis's shape
        ...

docs/integrations.md has the whole of it.
"""

from __future__ import annotations

import functools
import inspect
import logging
import threading
from collections.abc import Callable, Iterator
from types import TracebackType
from typing import TYPE_CHECKING, Any, TypeVar

from django.http import HttpResponse, StreamingHttpResponse

import hotlock

from .._validate import DEFAULT_TTL, Seconds, auto_extend_ms, limit_int, ttl_ms, wait_ms
from .._web import KeyOf, key_maker, refusal
from ..errors import CacheError, LockNotAcquired
from ._settings import read_settings

if TYPE_CHECKING:
    from django.http import HttpRequest

__all__ = ["DjangoLock", "get_cache", "lock", "locked", "reset"]

log = logging.getLogger("hotlock")

V = TypeVar("V", bound=Callable[..., Any])

_cache: hotlock.Cache | None = None
_made = threading.Lock()


def get_cache() -> hotlock.Cache:
    """This process's hotlock cache, made from the HOTLOCK setting at the first call with
    ``connect(..., lazy=True)``: nothing connects at import or at startup, and the first
    call that needs the server connects (a failure then is a CacheError). The native
    backend is fork-safe, so a server that forks its workers after loading the app is fine."""
    global _cache
    if _cache is None:
        with _made:
            if _cache is None:
                settings = read_settings()
                _cache = hotlock.connect(settings.url, lazy=True, **settings.connect_kwargs())
    return _cache


def reset() -> None:
    """Close and forget the cache (the next get_cache() reads the setting again): for
    tests that change HOTLOCK. Connected to Django's setting_changed signal."""
    global _cache
    with _made:
        cache, _cache = _cache, None
    if cache is not None:
        cache.close()


def _on_setting_changed(*, setting: str, **kwargs: Any) -> None:
    if setting == "HOTLOCK":
        reset()


def _connect_signal() -> None:
    from django.core.signals import setting_changed

    setting_changed.connect(_on_setting_changed, dispatch_uid="hotlock.django.reset")


_connect_signal()


# -- the view decorator ---------------------------------------------------------------------


def locked(
    key: KeyOf,
    ttl: Seconds = DEFAULT_TTL,
    *,
    wait: Seconds | None = None,
    limit: int = 1,
    auto_extend: bool = False,
    max_hold: Seconds | None = None,
) -> Callable[[V], V]:
    """A view decorator: the view runs holding the lock on ``key``, a template over the
    URL's keyword arguments (``"settle:{invoice_id}"``) or a function of the request.

    Held elsewhere: 409 with Retry-After (the holder's remaining TTL, whole seconds), the
    view not run. The cache down: 503 with Retry-After: 1. ``wait=S`` waits up to S seconds
    first; ``limit=N`` lets N requests in at once. The lock is released when the view
    returns, or, for a StreamingHttpResponse, once its body has been sent (or the client
    went away). For class-based views: ``method_decorator(locked(...), name="post")``.
    """
    key_of = key_maker(key)
    ms = ttl_ms(ttl)
    if wait is not None:
        wait_ms(wait)
    limit_int(limit)
    auto_extend_ms(auto_extend, max_hold, ms)

    def decorate(view: V) -> V:
        if inspect.iscoroutinefunction(view):
            raise TypeError(f"{view.__qualname__} is a coroutine function: hotlock.django.locked takes sync views")

        @functools.wraps(view)
        def locked_view(request: HttpRequest, *args: Any, **kwargs: Any) -> Any:
            cache = get_cache()
            name = key_of(request, kwargs)
            try:
                if wait is None:
                    held = cache.lock(name, ttl, limit=limit, auto_extend=auto_extend, max_hold=max_hold)
                else:
                    held = cache.lock_wait(name, ttl, wait, limit=limit, auto_extend=auto_extend, max_hold=max_hold)
            except (LockNotAcquired, CacheError) as error:
                if isinstance(error, CacheError):
                    log.warning("refused a request with 503: %s", error)
                status, detail, headers = refusal(error)
                return HttpResponse(detail, status=status, headers=headers, content_type="text/plain")
            try:
                response = view(request, *args, **kwargs)
            except BaseException:
                _release(held)
                raise
            if isinstance(response, StreamingHttpResponse):
                # The body is sent after the view returns: hold the lock until it is.
                response.streaming_content = _released_after(response.streaming_content, held)
            else:
                _release(held)
            return response

        return locked_view  # type: ignore[return-value]

    return decorate


def _release(held: hotlock.Lock) -> None:
    try:
        held.unlock()
    except CacheError as error:
        log.warning("release failed; the lock expires by its TTL: %s", error)


def _released_after(body: Any, held: hotlock.Lock) -> Iterator[Any]:
    # A generator: Django closes it when the response is closed, sent or not, so the
    # finally runs once the server is done with the body.
    try:
        yield from body
    finally:
        _release(held)


# -- a drop-in for django-redis's cache.lock ----------------------------------------------


class DjangoLock:
    """django-redis's ``cache.lock(...)`` object (redis-py's Lock shape) on hotlock.

    What differs, on purpose: the lock always expires (``timeout`` defaults to 30 s, never
    None); waiting is bounded (``blocking_timeout`` defaults to 10 s, never forever); the
    token belongs to this object, not to a thread; ``release()`` of a lock that expired or
    was taken over returns quietly instead of raising (``owned()`` tells); and ``extend``
    never re-acquires a lost lock (it raises hotlock.LockLost). Entering a ``with`` block
    that cannot acquire raises hotlock.LockNotAcquired (``retry_after`` tells how long).
    """

    def __init__(
        self,
        name: str | bytes,
        timeout: Seconds | None = DEFAULT_TTL,
        sleep: float = 0.1,
        blocking: bool = True,
        blocking_timeout: Seconds | None = 10.0,
        thread_local: bool = True,
        *,
        cache: hotlock.Cache | None = None,
    ) -> None:
        # sleep and thread_local are accepted for the signature's sake: hotlock's wait backs
        # off by itself, and its token never lives in a thread-local.
        self.name = name
        self.timeout: Seconds = DEFAULT_TTL if timeout is None else timeout
        ttl_ms(self.timeout)
        self.blocking = blocking
        self.blocking_timeout = blocking_timeout
        if blocking_timeout is not None:
            wait_ms(blocking_timeout)
        self._cache = cache
        self._lock: hotlock.Lock | None = None

    @property
    def cache(self) -> hotlock.Cache:
        return self._cache if self._cache is not None else get_cache()

    def acquire(self, blocking: bool | None = None, blocking_timeout: Seconds | None = None) -> bool:
        """True when acquired; False when held elsewhere (after waiting, when blocking)."""
        if self._lock is not None and not self._lock.lost and self._lock.valid_for() > 0:
            raise RuntimeError(f"lock {self.name!r} is already held by this object")
        block = self.blocking if blocking is None else blocking
        wait = self.blocking_timeout if blocking_timeout is None else blocking_timeout
        try:
            if block:
                self._lock = self.cache.lock_wait(self.name, self.timeout, 10.0 if wait is None else wait)
            else:
                self._lock = self.cache.lock(self.name, self.timeout)
        except LockNotAcquired:
            return False
        return True

    def release(self) -> None:
        """Release; quiet when the lock was no longer ours."""
        held, self._lock = self._lock, None
        if held is not None:
            held.unlock()

    def owned(self) -> bool:
        """Held by this object, as far as the local deadline says (no round trip)."""
        return self._lock is not None and not self._lock.lost and self._lock.valid_for() > 0

    def locked(self) -> bool:
        """Whether anyone holds it: a try to take it, given back at once."""
        if self.owned():
            return True
        try:
            self.cache.lock(self.name, 0.05).unlock()
        except LockNotAcquired:
            return True
        return False

    def extend(self, additional_time: Seconds, replace_ttl: bool = False) -> bool:
        """Add ``additional_time`` to what is left (redis-py's default), or set it as the new
        TTL (``replace_ttl=True``). Raises hotlock.LockLost if the lock was lost."""
        if self._lock is None:
            raise hotlock.LockLost(f"lock {self.name!r} is not held by this object")
        ttl_ms(additional_time)
        extra = additional_time.total_seconds() if not isinstance(additional_time, (int, float)) else additional_time
        self._lock.extend(extra if replace_ttl else max(self._lock.valid_for(), 0) + extra)
        return True

    def reacquire(self) -> bool:
        """Reset the TTL to ``timeout``."""
        if self._lock is None:
            raise hotlock.LockLost(f"lock {self.name!r} is not held by this object")
        self._lock.extend(self.timeout)
        return True

    @property
    def fence(self) -> int | None:
        """The held lock's fencing token (hotlock's), or None."""
        return None if self._lock is None else self._lock.fence

    def __enter__(self) -> DjangoLock:
        block = self.blocking
        wait = 10.0 if self.blocking_timeout is None else self.blocking_timeout
        # Raise hotlock's own LockNotAcquired (with retry_after), not a bare False.
        self._lock = (
            self.cache.lock_wait(self.name, self.timeout, wait) if block else self.cache.lock(self.name, self.timeout)
        )
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        held, self._lock = self._lock, None
        if held is not None:
            held.__exit__(exc_type, exc, tb)

    def __repr__(self) -> str:
        return f"<hotlock.django.DjangoLock name={self.name!r} owned={self.owned()}>"


def lock(
    name: str | bytes,
    timeout: Seconds | None = DEFAULT_TTL,
    sleep: float = 0.1,
    blocking: bool = True,
    blocking_timeout: Seconds | None = 10.0,
    thread_local: bool = True,
) -> DjangoLock:
    """``cache.lock(name, timeout=..., blocking_timeout=...)`` as django-redis spells it, on
    hotlock (see DjangoLock for what differs)."""
    return DjangoLock(name, timeout, sleep, blocking, blocking_timeout, thread_local)
