"""The harness fails a test that leaves a task pending or a resource unclosed (conftest.py).

Run in a pytest of its own (a subprocess) with the suite's conftest hook, so the failures
asked for here are that run's, not this one's."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

CASES = """
import asyncio

import pytest

import uvloop


def run(coro, loop):
    factory = uvloop.new_event_loop if loop == "uvloop" else None
    with asyncio.Runner(loop_factory=factory) as runner:
        return runner.run(coro)


@pytest.fixture(params=["asyncio", "uvloop"])
def loop(request):
    return request.param


def test_a_task_left_pending(loop):
    async def main():
        asyncio.ensure_future(asyncio.sleep(30))

    run(main(), loop)


def test_a_task_left_pending_by_asyncio_run():
    async def main():
        asyncio.ensure_future(asyncio.sleep(30))

    asyncio.run(main())


def test_an_unclosed_file_dropped_in_a_cycle(loop):
    async def main():
        held = [open(__file__)]
        held.append(held)  # only the gc frees it, after the test's own code

    run(main(), loop)


def test_an_unclosed_transport():
    # (asyncio's loop: uvloop's close() hangs on the open server connection left here.)
    async def main():
        server = await asyncio.start_server(lambda r, w: None, "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        server.close()
        holder = [writer, reader]
        holder.append(holder)

    run(main(), "asyncio")


KEPT = []


def test_a_task_started_as_the_runner_cancels(loop):
    async def main():
        async def cleanup():
            await asyncio.sleep(30)

        async def wait():
            try:
                await asyncio.sleep(30)
            finally:  # cancelled by the runner's close: this task never runs to its end
                KEPT.append(asyncio.get_running_loop().create_task(cleanup()))

        asyncio.ensure_future(wait())

    run(main(), loop)


def test_a_task_awaited_is_fine(loop):
    async def main():
        task = asyncio.ensure_future(asyncio.sleep(0.01))
        await task
        server = await asyncio.start_server(lambda r, w: w.close(), "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.close()
        await writer.wait_closed()
        server.close()
        await server.wait_closed()

    run(main(), loop)


def test_a_failing_test_keeps_its_own_failure(loop):
    async def main():
        asyncio.ensure_future(asyncio.sleep(30))
        raise KeyError("its own")

    run(main(), loop)


def test_a_sync_test_is_untouched():
    assert True
"""

CONFTEST = """
from tests.conftest import pytest_runtest_call  # noqa: F401  (the hook under test)
"""


def test_leftovers_fail_the_test_that_left_them(tmp_path: Path) -> None:
    (tmp_path / "test_cases.py").write_text(textwrap.dedent(CASES))
    (tmp_path / "conftest.py").write_text(CONFTEST)
    (tmp_path / "pytest.ini").write_text("[pytest]\nfilterwarnings = error\n")
    env = {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    env.pop("PYTEST_XDIST_WORKER", None)
    run = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-rA", "-p", "no:cacheprovider", "-p", "no:valkey", "-p", "no:xdist"],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    out = run.stdout + run.stderr
    outcome = {}
    for line in out.splitlines():
        word, _, rest = line.partition(" ")
        if word in ("PASSED", "FAILED", "ERROR") and "::" in rest:
            outcome.setdefault(rest.split("::")[1].split(" ")[0], word)
    expected = {
        "test_a_task_left_pending[asyncio]": "FAILED",
        "test_a_task_left_pending[uvloop]": "FAILED",
        "test_a_task_left_pending_by_asyncio_run": "FAILED",
        "test_an_unclosed_file_dropped_in_a_cycle[asyncio]": "FAILED",
        "test_an_unclosed_file_dropped_in_a_cycle[uvloop]": "FAILED",
        "test_an_unclosed_transport": "FAILED",
        "test_a_task_started_as_the_runner_cancels[asyncio]": "FAILED",
        "test_a_task_started_as_the_runner_cancels[uvloop]": "FAILED",
        "test_a_task_awaited_is_fine[asyncio]": "PASSED",
        "test_a_task_awaited_is_fine[uvloop]": "PASSED",
        "test_a_failing_test_keeps_its_own_failure[asyncio]": "FAILED",
        "test_a_failing_test_keeps_its_own_failure[uvloop]": "FAILED",
        "test_a_sync_test_is_untouched": "PASSED",
    }
    assert outcome == expected, out
    # Each kind of report is there. How many of each varies with timing (inside a loaded
    # suite, a task started as the runner cancels may be seen at the close or only after
    # it), so the outcomes above, test by test, are the proof; these name the reasons.
    assert "a task left pending when its loop closed" in out, out
    assert re.search(r"a task (left|still) pending .*cleanup\(\)", out), out
    assert "ResourceWarning" in out, out
    assert "KeyError: 'its own'" in out, out
