"""The FastAPI app tests/test_asgi.py serves with ``uvicorn --workers 2``.

CACHE_URL names the test's Redis; CHECKER the overlap checker's state file. Each protected
route marks its section in the checker, so overlaps between the two worker processes show.
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import AsyncIterator
from typing import Annotated, Any

from fastapi import Depends, FastAPI
from fastapi.responses import StreamingResponse
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from hotlock.aio import AsyncLock
from hotlock.asgi import Locker

from .checker import FileChecker

app = FastAPI()
locker = Locker()  # CACHE_URL, connected at the first request in each worker
down = Locker(os.environ["DOWN_URL"], connect_timeout=0.5, timeout=0.5)  # nothing listens there
checker = FileChecker(os.environ["CHECKER"])


async def section(key: str, hold: float, allowed: int = 1) -> dict[str, Any]:
    checker.enter(key, allowed)
    try:
        await asyncio.sleep(hold)
    finally:
        checker.exit(key)
    return {"pid": os.getpid()}


# The lock itself, for its fence: the Annotated form of a dependency.
WorkLock = Annotated[AsyncLock, Depends(locker("work:{name}", ttl=5))]


@app.get("/work/{name}")
async def work(name: str, lock: WorkLock, hold: float = 0.1) -> dict[str, Any]:
    return {**await section(f"work:{name}", hold), "fence": lock.fence}


@app.get("/unlocked/{name}")
async def unlocked(name: str, hold: float = 0.1) -> dict[str, Any]:
    return await section(f"unlocked:{name}", hold)


@app.get("/limited/{name}", dependencies=[Depends(locker("limited:{name}", ttl=5, limit=2))])
async def limited(name: str, hold: float = 0.1) -> dict[str, Any]:
    return await section(f"limited:{name}", hold, allowed=2)


@app.get("/waits/{name}", dependencies=[Depends(locker("waits:{name}", ttl=5, wait=5))])
async def waits(name: str, hold: float = 0.05) -> dict[str, Any]:
    return await section(f"waits:{name}", hold)


@app.get("/stream/{name}", dependencies=[Depends(locker("stream:{name}", ttl=5))])
async def stream(name: str, chunks: int = 5, gap: float = 0.1) -> StreamingResponse:
    async def body() -> AsyncIterator[bytes]:
        # The section is the body's sending: the lock must cover it, not only the endpoint.
        checker.enter(f"stream:{name}")
        try:
            for i in range(chunks):
                yield f"{i}\n".encode()
                await asyncio.sleep(gap)
        finally:
            checker.exit(f"stream:{name}")

    return StreamingResponse(body(), media_type="text/plain")


@app.get("/down/{name}", dependencies=[Depends(down("down:{name}"))])
async def outage(name: str) -> dict[str, Any]:
    return {"pid": os.getpid()}


# Starlette's own form: an endpoint decorator, on a route of the same app.
@locker.endpoint("plain:{name}", ttl=5)
async def plain(request: Request) -> Response:
    await section(f"plain:{request.path_params['name']}", float(request.query_params.get("hold", 0.1)))
    return JSONResponse({"pid": os.getpid()})


app.add_route("/plain/{name}", plain)
