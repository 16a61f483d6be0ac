"""Run by Django's test runner (tests/test_django.py starts it): a live server in this process
and ``runserver`` in another, both serving the views of this site over one Redis."""

from __future__ import annotations

import asyncio
import os
import socket
import subprocess
import sys
import time

import httpx
from django.test import LiveServerTestCase, SimpleTestCase, override_settings

import hotlock
from hotlock.django import DjangoLock, get_cache, lock

from ..checker import FileChecker

checker = FileChecker(os.environ["CHECKER"])


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def burst(urls: list[str], n: int, rounds: int = 1) -> list[httpx.Response]:
    """``n`` requests at once, spread over ``urls``, ``rounds`` times over."""

    async def main() -> list[httpx.Response]:
        got: list[httpx.Response] = []
        async with httpx.AsyncClient(timeout=30, limits=httpx.Limits(max_connections=n)) as client:
            for _ in range(rounds):
                got += await asyncio.gather(*(client.get(urls[i % len(urls)]) for i in range(n)))
        return got

    return asyncio.run(main())


def counts(responses: list[httpx.Response]) -> dict[int, int]:
    found: dict[int, int] = {}
    for r in responses:
        found[r.status_code] = found.get(r.status_code, 0) + 1
    return found


class TwoServers(LiveServerTestCase):
    """The live server (threads, this process) and runserver (another process)."""

    other: subprocess.Popen[bytes]
    other_url: str

    @classmethod
    def setUpClass(cls) -> None:
        super().setUpClass()
        port = _free_port()
        cls.other_url = f"http://127.0.0.1:{port}"
        cls.other = subprocess.Popen(
            [sys.executable, "-m", "django", "runserver", f"127.0.0.1:{port}", "--noreload", "--skip-checks"],
            env={**os.environ, "DJANGO_SETTINGS_MODULE": "tests.webapps.django_site.settings"},
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        deadline = time.monotonic() + 30
        while True:
            try:
                httpx.get(f"{cls.other_url}/nothing/", timeout=1)
                break
            except httpx.TransportError:
                if cls.other.poll() is not None or time.monotonic() > deadline:
                    raise AssertionError("runserver did not start") from None
                time.sleep(0.1)

    @classmethod
    def tearDownClass(cls) -> None:
        cls.other.terminate()
        cls.other.wait(15)
        super().tearDownClass()

    def urls(self, path: str) -> list[str]:
        return [f"{self.live_server_url}{path}", f"{self.other_url}{path}"]

    def test_one_holder_across_two_processes(self) -> None:
        responses = burst(self.urls("/work/a/?hold=0.15"), 12, rounds=5)
        found = counts(responses)
        self.assertLessEqual(set(found), {200, 409})
        self.assertGreaterEqual(found.get(200, 0), 5)
        self.assertGreaterEqual(found.get(409, 0), 5 * 6)
        for r in responses:
            if r.status_code == 409:
                self.assertIn(int(r.headers["Retry-After"]), range(1, 6))
        sections, overlaps, most = checker.of("work:a")
        self.assertEqual((sections, overlaps, most), (found[200], 0, 1))

        # Across the processes, deterministically: held through one, refused by the other.
        async def across() -> tuple[int, int, int]:
            async with httpx.AsyncClient(timeout=30) as client:
                slow = asyncio.ensure_future(client.get(f"{self.live_server_url}/work/x/?hold=0.6"))
                await asyncio.sleep(0.3)
                busy = await client.get(f"{self.other_url}/work/x/?hold=0")
                first = await slow
                after = await client.get(f"{self.other_url}/work/x/?hold=0")
                return first.status_code, busy.status_code, after.status_code

        self.assertEqual(asyncio.run(across()), (200, 409, 200))
        print(f"\ndjango one holder: {found} over 2 processes, {overlaps} overlaps", file=sys.stderr)

    def test_the_checker_catches_overlaps_without_the_lock(self) -> None:
        self.assertEqual(counts(burst(self.urls("/unlocked/a/?hold=0.15"), 8)), {200: 8})
        _, overlaps, most = checker.of("unlocked:a")
        self.assertGreater(overlaps, 0)
        self.assertGreater(most, 1)
        print(f"\ndjango without the lock: {overlaps} overlaps", file=sys.stderr)

    def test_limit_lets_two_in(self) -> None:
        found = counts(burst(self.urls("/limited/a/?hold=0.2"), 8, rounds=3))
        self.assertGreater(found.get(409, 0), 0)
        _, overlaps, most = checker.of("limited:a")
        self.assertEqual((overlaps, most), (0, 2))

    def test_wait_serializes(self) -> None:
        self.assertEqual(counts(burst(self.urls("/waits/a/?hold=0.05"), 6)), {200: 6})
        self.assertEqual(checker.of("waits:a"), (6, 0, 1))

    def test_streaming_body_is_covered(self) -> None:
        with httpx.Client(timeout=30) as client:
            with client.stream("GET", f"{self.live_server_url}/stream/a/") as streaming:
                lines = streaming.iter_lines()
                self.assertEqual(next(lines), "0")
                self.assertEqual(client.get(f"{self.other_url}/stream/a/").status_code, 409)
                self.assertEqual(list(lines), ["1", "2", "3", "4"])
            deadline = time.monotonic() + 3
            while client.get(f"{self.other_url}/stream/a/").status_code == 409:
                self.assertLess(time.monotonic(), deadline, "not released after the body was sent")
                time.sleep(0.02)
        self.assertEqual(checker.of("stream:a")[1], 0)

    def test_outage_is_503(self) -> None:
        dead = f"redis://127.0.0.1:{_free_port()}/0"
        with override_settings(HOTLOCK={"URL": dead, "TIMEOUT": 0.5, "CONNECT_TIMEOUT": 0.5}):
            r = httpx.get(f"{self.live_server_url}/work/down/", timeout=10)
        self.assertEqual(r.status_code, 503)
        self.assertEqual(r.headers["Retry-After"], "1")
        # The setting restored: the next cache is the real one again.
        self.assertEqual(httpx.get(f"{self.live_server_url}/work/down/?hold=0", timeout=10).status_code, 200)


class DropIn(SimpleTestCase):
    """hotlock.django.lock: django-redis's cache.lock(name, timeout=, blocking_timeout=) shape."""

    def test_defaults_expire_and_do_not_wait_forever(self) -> None:
        first = lock("drop:a")  # timeout defaults to 30 s, never "no TTL"
        self.assertTrue(first.acquire(blocking=False))
        self.assertGreater(first._lock.ttl, 0)  # type: ignore[union-attr]
        second = lock("drop:a", timeout=5, blocking_timeout=0.2)
        started = time.monotonic()
        self.assertFalse(second.acquire())
        self.assertLess(time.monotonic() - started, 2.0)
        self.assertTrue(first.locked() and first.owned() and not second.owned())
        first.release()
        self.assertFalse(first.locked())

    def test_with_block_and_fence(self) -> None:
        with lock("drop:b", timeout=5, blocking_timeout=1) as held:
            self.assertIsInstance(held.fence, int)
            with self.assertRaises(hotlock.LockNotAcquired) as busy, lock("drop:b", timeout=5, blocking=False):
                pass
            self.assertIsNotNone(busy.exception.retry_after)
        self.assertTrue(lock("drop:b", blocking=False).acquire())

    def test_release_after_expiry_is_quiet_and_extend_never_reacquires(self) -> None:
        short = DjangoLock("drop:c", timeout=0.1, cache=get_cache())
        self.assertTrue(short.acquire())
        time.sleep(0.25)
        self.assertFalse(short.owned())
        taker = lock("drop:c", timeout=5)
        self.assertTrue(taker.acquire(blocking=False))
        with self.assertRaises(hotlock.LockLost):
            short.extend(5)
        short.release()  # quiet: it was no longer ours, and the taker keeps it
        self.assertTrue(taker.owned() and taker.locked())
        taker.release()

    def test_extend_adds_by_default(self) -> None:
        held = lock("drop:d", timeout=2)
        self.assertTrue(held.acquire())
        held.extend(10)
        self.assertGreater(held._lock.valid_for(), 10)  # type: ignore[union-attr]
        held.extend(3, replace_ttl=True)
        self.assertLess(held._lock.valid_for(), 3.01)  # type: ignore[union-attr]
        held.release()

    def test_cache_lock_of_the_cache_backend(self) -> None:
        from django.core.cache import cache

        cache.set("plain", "value")  # the rest is Django's own Redis cache
        self.assertEqual(cache.get("plain"), "value")
        with cache.lock("drop:f", timeout=5, blocking_timeout=0.1) as held:
            self.assertIsInstance(held, DjangoLock)
            self.assertFalse(cache.lock("drop:f", timeout=5).acquire(blocking=False))
        self.assertTrue(cache.lock("drop:f").acquire(blocking=False))

    def test_bad_arguments_before_any_io(self) -> None:
        with self.assertRaises(ValueError):
            lock("drop:e", timeout=0)
        with self.assertRaises(ValueError):
            lock("drop:e", blocking_timeout=-1)
