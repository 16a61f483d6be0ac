"""hotlock.django with Django's own tools, as real processes: Django's test runner over
tests/webapps/django_site (a live server in one process, runserver in another, one Redis),
and ``manage.py check --deploy`` against servers configured right and wrong."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

pytest.importorskip("django")
pytest.importorskip("httpx")

from .conftest import RedisServer, free_port, start_redis

ROOT = Path(__file__).resolve().parent.parent
SETTINGS = "tests.webapps.django_site.settings"


@pytest.fixture(scope="module")
def server() -> Iterator[RedisServer]:
    redis_server = start_redis()
    yield redis_server
    redis_server.stop()


def django(args: list[str], env: dict[str, str], timeout: float = 90) -> subprocess.CompletedProcess[str]:
    full = {**os.environ, "DJANGO_SETTINGS_MODULE": SETTINGS, **env}
    return subprocess.run(
        [sys.executable, "-m", "django", *args], cwd=ROOT, env=full, capture_output=True, text=True, timeout=timeout
    )


def test_django_test_runner_live_servers(server: RedisServer, tmp_path: Path) -> None:
    done = django(
        ["test", "tests.webapps.django_site.tests", "-v", "2", "--noinput"],
        {"CACHE_URL": server.url, "CHECKER": str(tmp_path / "checker.json")},
    )
    out = done.stdout + done.stderr
    assert done.returncode == 0, out[-4000:]
    ran = re.search(r"Ran (\d+) tests", out)
    assert ran is not None and int(ran.group(1)) == 12, out[-2000:]
    assert "OK" in out
    # What the runs measured, for the record (-s shows it).
    for line in out.splitlines():
        if line.startswith("django "):
            print(line)


def check_deploy(server_url: str | None, tmp_path: Path, hotlock: dict[str, object] | None = None) -> str:
    env = {"CHECKER": str(tmp_path / "checker.json"), "CACHE_URL": server_url or ""}
    if hotlock is not None:
        env["HOTLOCK_JSON"] = json.dumps(hotlock)
    done = django(["check", "--deploy", "--fail-level", "ERROR"], env)
    return f"rc={done.returncode}\n{done.stdout}{done.stderr}"


def test_check_deploy_flags_an_evicting_server(tmp_path: Path) -> None:
    evicting = start_redis("--maxmemory", "64mb", "--maxmemory-policy", "allkeys-lru")
    try:
        out = check_deploy(evicting.url, tmp_path)
    finally:
        evicting.stop()
    assert "rc=1" in out, out
    assert "(hotlock.E002) eviction: maxmemory-policy allkeys-lru" in out, out
    assert "(hotlock.W003) persistence" in out, out  # no AOF, no RDB on the test server


def test_check_deploy_passes_a_safe_server(tmp_path: Path) -> None:
    safe = start_redis("--appendonly", "yes")
    try:
        out = check_deploy(safe.url, tmp_path)
    finally:
        safe.stop()
    assert "hotlock." not in out, out  # Django's own deploy warnings may remain


def test_check_deploy_without_a_cache_or_server(tmp_path: Path) -> None:
    out = check_deploy(None, tmp_path)
    assert "(hotlock.W001) no cache configured" in out, out
    out = check_deploy(f"redis://127.0.0.1:{free_port()}/0", tmp_path, {"TIMEOUT": 0.5})
    assert "(hotlock.W002) cannot check the lock server" in out, out


def test_check_flags_a_bad_setting_without_deploy(tmp_path: Path) -> None:
    done = django(
        ["check"],
        {"CHECKER": str(tmp_path / "c.json"), "HOTLOCK_JSON": json.dumps({"URL": "redis://x/0", "TIMEOUT": -1})},
    )
    assert done.returncode == 1
    assert "(hotlock.E001) HOTLOCK: timeout must be at least" in done.stderr, done.stderr
