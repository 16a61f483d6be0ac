"""The views: each protected one marks its section in the overlap checker."""

from __future__ import annotations

import os
import time
from collections.abc import Iterator

from django.http import HttpRequest, HttpResponse, JsonResponse, StreamingHttpResponse

from hotlock.django import locked

from ..checker import FileChecker

checker = FileChecker(os.environ["CHECKER"])


def section(key: str, request: HttpRequest, allowed: int = 1) -> JsonResponse:
    checker.enter(key, allowed)
    try:
        time.sleep(float(request.GET.get("hold", "0.1")))
    finally:
        checker.exit(key)
    return JsonResponse({"pid": os.getpid()})


@locked("work:{name}", ttl=5)
def work(request: HttpRequest, name: str) -> HttpResponse:
    return section(f"work:{name}", request)


def unlocked(request: HttpRequest, name: str) -> HttpResponse:
    return section(f"unlocked:{name}", request)


@locked("limited:{name}", ttl=5, limit=2)
def limited(request: HttpRequest, name: str) -> HttpResponse:
    return section(f"limited:{name}", request, allowed=2)


@locked("waits:{name}", ttl=5, wait=10)
def waits(request: HttpRequest, name: str) -> HttpResponse:
    return section(f"waits:{name}", request)


@locked("stream:{name}", ttl=5)
def stream(request: HttpRequest, name: str) -> HttpResponse:
    def body() -> Iterator[bytes]:
        checker.enter(f"stream:{name}")
        try:
            for i in range(5):
                yield f"{i}\n".encode()
                time.sleep(0.1)
        finally:
            checker.exit(f"stream:{name}")

    return StreamingHttpResponse(body(), content_type="text/plain")
