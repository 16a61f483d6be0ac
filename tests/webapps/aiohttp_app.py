"""The aiohttp app tests/test_asgi.py runs in a process of its own:
``python -m tests.webapps.aiohttp_app PORT`` (CACHE_URL, CHECKER as for asgi_app)."""

from __future__ import annotations

import asyncio
import os
import sys

from aiohttp import web

from hotlock.asgi import Locker

from .checker import FileChecker

locker = Locker()
checker = FileChecker(os.environ["CHECKER"])


@locker.aiohttp("aio:{name}", ttl=5)
async def work(request: web.Request) -> web.StreamResponse:
    key = f"aio:{request.match_info['name']}"
    checker.enter(key)
    try:
        await asyncio.sleep(float(request.query.get("hold", "0.1")))
    finally:
        checker.exit(key)
    return web.json_response({"pid": os.getpid()})


@locker.aiohttp("aiostream:{name}", ttl=5)
async def stream(request: web.Request) -> web.StreamResponse:
    key = f"aiostream:{request.match_info['name']}"
    response = web.StreamResponse()
    await response.prepare(request)
    checker.enter(key)
    try:
        for i in range(5):
            await response.write(f"{i}\n".encode())
            await asyncio.sleep(0.1)
    finally:
        checker.exit(key)
    return response


app = web.Application()
app.router.add_get("/work/{name}", work)
app.router.add_get("/stream/{name}", stream)

if __name__ == "__main__":
    web.run_app(app, host="127.0.0.1", port=int(sys.argv[1]), print=None)
