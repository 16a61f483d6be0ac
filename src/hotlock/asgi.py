"""hotlock.asgi: a request holds a lock while it runs and until its response is sent.

FastAPI (a dependency), Starlette (an endpoint decorator) and aiohttp (a handler decorator)::

    from fastapi import Depends, FastAPI
    from hotlock.asgi import Locker

    app = FastAPI()
    locker = Locker()        # CACHE_URL; connects at the first request, in that worker's loop

    @app.post("/invoices/{invoice_id}/settle")
    async def settle(invoice_id: str, lock=Depends(locker("settle:{invoice_id}", ttl=60))):
        ...                  # lock is the hotlock.aio.AsyncLock (lock.fence for the database)

A request whose key is held elsewhere is answered 409 with ``Retry-After`` (the holder's
remaining TTL, whole seconds); a cache outage 503 (``Retry-After: 1``); neither runs the
endpoint. ``limit=N`` lets N requests hold the key at once; ``wait=S`` waits up to S seconds
before the 409. The key is a template over the route's path parameters, or a function of the
request. The lock is released once the response is sent (a streaming body included), or
however the request ends.

FastAPI: 0.118 and later (the extra requires it). The release is in the dependency's exit
code, which FastAPI runs after the response is sent from 0.118 on; from 0.106 to 0.117 it
ran before the response was sent (so a streaming body ran unprotected), and before 0.106
after it, as now. docs/integrations.md has the details.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import TYPE_CHECKING, Any

from . import aio
from ._validate import DEFAULT_TTL, Seconds, auto_extend_ms, limit_int, ttl_ms, wait_ms
from ._web import KeyOf, key_maker, refusal
from .errors import CacheError, LockNotAcquired

if TYPE_CHECKING:
    from aiohttp import web
    from starlette.requests import Request
    from starlette.responses import Response
    from starlette.types import Receive, Scope, Send

    from .aio import AsyncCache, AsyncLock

__all__ = ["Locker", "Refused"]

log = logging.getLogger("hotlock")


class Refused(Exception):
    """A request refused before its handler ran: ``status`` 409 (held elsewhere) or 503
    (the cache is down), with the ``headers`` (Retry-After) to answer it with."""

    def __init__(self, status: int, detail: str, headers: dict[str, str], cause: HotlockWebError) -> None:
        super().__init__(detail)
        self.status = status
        self.detail = detail
        self.headers = headers
        self.cause = cause


HotlockWebError = LockNotAcquired | CacheError


class Locker:
    """Per-request locks on one hotlock.aio cache, for FastAPI, Starlette and aiohttp.

    ``Locker(cache)`` uses an AsyncCache you made; ``Locker(url, **connect_options)`` (url
    None: CACHE_URL) makes one with ``hotlock.aio.connect(..., lazy=True)`` at the first
    request, in the event loop that serves it: each worker process has its own, made after
    the fork, and nothing connects at import.
    """

    def __init__(self, cache: AsyncCache | str | None = None, **connect_options: Any) -> None:
        self._cache: AsyncCache | None = None
        self._url: str | None = None
        self._options = connect_options
        if isinstance(cache, aio.AsyncCache):
            if connect_options:
                raise TypeError("connect options go with a url, not with a cache already made")
            self._cache = cache
        elif cache is None or isinstance(cache, str):
            self._url = cache
        else:
            raise TypeError(f"cache must be a hotlock.aio.AsyncCache, a url or None, not {type(cache).__name__}")

    async def cache(self) -> AsyncCache:
        """The cache (made at the first call when the Locker was given a url)."""
        if self._cache is None:
            # lazy=True: no await inside suspends, so two first requests make one cache.
            self._cache = await aio.connect(self._url, lazy=True, **self._options)
        return self._cache

    async def acquire(
        self,
        key: str,
        ttl: Seconds = DEFAULT_TTL,
        *,
        wait: Seconds | None = None,
        limit: int = 1,
        auto_extend: bool = False,
        max_hold: Seconds | None = None,
    ) -> AsyncLock:
        """The lock on ``key``, or Refused (409 or 503) for the request to answer with."""
        cache = await self.cache()
        try:
            if wait is None:
                return await cache.lock(key, ttl, limit=limit, auto_extend=auto_extend, max_hold=max_hold)
            return await cache.lock_wait(key, ttl, wait, limit=limit, auto_extend=auto_extend, max_hold=max_hold)
        except (LockNotAcquired, CacheError) as error:
            status, detail, headers = refusal(error)
            if isinstance(error, CacheError):
                log.warning("refused a request with %d: %s", status, error)
            raise Refused(status, detail, headers, error) from error

    @staticmethod
    async def release(lock: AsyncLock) -> None:
        """Release after the response: an outage here is logged, the key expires by its TTL."""
        try:
            await lock.unlock()
        except CacheError as error:
            log.warning("release after the response failed; the lock expires by its TTL: %s", error)

    def _options_checked(
        self, ttl: Seconds, wait: Seconds | None, limit: int, auto_extend: bool, max_hold: Seconds | None
    ) -> None:
        # Every argument checked when the route is declared, not at its first request.
        ms = ttl_ms(ttl)
        if wait is not None:
            wait_ms(wait)
        limit_int(limit)
        auto_extend_ms(auto_extend, max_hold, ms)

    # -- FastAPI ---------------------------------------------------------------------------

    def __call__(
        self,
        key: KeyOf,
        ttl: Seconds = DEFAULT_TTL,
        *,
        wait: Seconds | None = None,
        limit: int = 1,
        auto_extend: bool = False,
        max_hold: Seconds | None = None,
    ) -> Callable[[Request], AsyncIterator[AsyncLock]]:
        """A FastAPI dependency holding the lock on ``key`` from before the endpoint runs
        until the response is sent: ``Depends(locker("settle:{invoice_id}", ttl=60))``.
        Refused requests raise starlette's HTTPException (409/503 with Retry-After)."""
        from starlette.exceptions import HTTPException
        from starlette.requests import Request

        key_of = key_maker(key)
        self._options_checked(ttl, wait, limit, auto_extend, max_hold)

        async def hotlock_lock(request: Request) -> AsyncIterator[AsyncLock]:
            name = key_of(request, request.path_params)
            try:
                lock = await self.acquire(name, ttl, wait=wait, limit=limit, auto_extend=auto_extend, max_hold=max_hold)
            except Refused as refused:
                raise HTTPException(refused.status, refused.detail, refused.headers) from None
            try:
                yield lock
            finally:
                await self.release(lock)

        # FastAPI reads the dependency's signature, and this module's annotations are
        # strings (Request is imported here only): give it the class itself.
        hotlock_lock.__annotations__ = {"request": Request}
        return hotlock_lock

    # -- Starlette -------------------------------------------------------------------------

    def endpoint(
        self,
        key: KeyOf,
        ttl: Seconds = DEFAULT_TTL,
        *,
        wait: Seconds | None = None,
        limit: int = 1,
        auto_extend: bool = False,
        max_hold: Seconds | None = None,
    ) -> Callable[[Callable[[Request], Awaitable[Response]]], Callable[[Request], Awaitable[Any]]]:
        """A decorator for a Starlette endpoint ``async def endpoint(request) -> Response``:
        the lock is held while it runs and while its response is sent; refused requests get
        a plain-text 409/503 with Retry-After."""
        from starlette.responses import PlainTextResponse

        key_of = key_maker(key)
        self._options_checked(ttl, wait, limit, auto_extend, max_hold)

        def decorate(fn: Callable[[Request], Awaitable[Response]]) -> Callable[[Request], Awaitable[Any]]:
            @functools.wraps(fn)
            async def locked_endpoint(request: Request) -> Any:
                name = key_of(request, request.path_params)
                try:
                    lock = await self.acquire(
                        name, ttl, wait=wait, limit=limit, auto_extend=auto_extend, max_hold=max_hold
                    )
                except Refused as refused:
                    return PlainTextResponse(refused.detail, refused.status, refused.headers)
                try:
                    response = await fn(request)
                except BaseException:
                    await self.release(lock)
                    raise
                return _ReleasedAfter(response, lock, self)

            return locked_endpoint

        return decorate

    # -- aiohttp ---------------------------------------------------------------------------

    def aiohttp(
        self,
        key: KeyOf,
        ttl: Seconds = DEFAULT_TTL,
        *,
        wait: Seconds | None = None,
        limit: int = 1,
        auto_extend: bool = False,
        max_hold: Seconds | None = None,
    ) -> Callable[
        [Callable[[web.Request], Awaitable[web.StreamResponse]]], Callable[[web.Request], Awaitable[web.StreamResponse]]
    ]:
        """A decorator for an aiohttp handler ``async def handler(request)``: the key's
        template reads ``request.match_info``; the lock is held while the handler runs and
        until its response is written out; refused requests get 409/503 with Retry-After."""
        from aiohttp import web

        key_of = key_maker(key)
        self._options_checked(ttl, wait, limit, auto_extend, max_hold)

        def decorate(
            fn: Callable[[web.Request], Awaitable[web.StreamResponse]],
        ) -> Callable[[web.Request], Awaitable[web.StreamResponse]]:
            @functools.wraps(fn)
            async def locked_handler(request: web.Request) -> web.StreamResponse:
                name = key_of(request, request.match_info)
                try:
                    lock = await self.acquire(
                        name, ttl, wait=wait, limit=limit, auto_extend=auto_extend, max_hold=max_hold
                    )
                except Refused as refused:
                    return web.Response(status=refused.status, text=refused.detail, headers=refused.headers)
                try:
                    response = await fn(request)
                    # Written out here, under the lock: aiohttp then finds it sent (prepare and
                    # write_eof are idempotent) and only finishes the request.
                    await response.prepare(request)
                    await response.write_eof()
                    return response
                finally:
                    await self.release(lock)

            return locked_handler

        return decorate

    def __repr__(self) -> str:
        return f"<hotlock.asgi.Locker cache={self._cache!r}>"


class _ReleasedAfter:
    """A Starlette response that releases its lock once it has been sent (or failed)."""

    def __init__(self, response: Response, lock: AsyncLock, locker: Locker) -> None:
        self.response = response
        self.lock = lock
        self.locker = locker

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await self.response(scope, receive, send)
        finally:
            await self.locker.release(self.lock)
