"""The short run of the Atheris fuzz targets (tools/fuzz_native.py); make fuzz runs the long one.

Each target runs in a child process (libFuzzer exits the process it runs in, and a crash
must fail this test, not end the run) from the committed seed corpus, with a fixed seed
and a fixed number of executions, so the same inputs are tried every time. Here the build
is the normal one and the guidance is Python coverage; make fuzz instruments the C code.
"""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from hotlock.backends.native import native_module

pytest.importorskip("atheris")
if native_module()[0] is None:
    pytest.skip(f"the native extension is not live: {native_module()[1]}", allow_module_level=True)

ROOT = Path(__file__).resolve().parent.parent
TOOL = ROOT / "tools" / "fuzz_native.py"
SEEDS = ROOT / "tests" / "fuzz" / "seeds"
DICT = ROOT / "tests" / "fuzz" / "resp.dict"


@pytest.mark.timeout(180)
@pytest.mark.parametrize(("target", "runs"), [("aio", 20_000), ("sync", 4_000)])
def test_fuzz_short_run(tmp_path: Path, target: str, runs: int) -> None:
    corpus = tmp_path / "corpus"  # new inputs go to the first directory, never into the seeds
    corpus.mkdir()
    cmd = [
        sys.executable,
        str(TOOL),
        target,
        f"-runs={runs}",
        "-seed=1",
        f"-dict={DICT}",
        "-max_total_time=120",
        f"-artifact_prefix={tmp_path}/",
        str(corpus),
        str(SEEDS),
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=170, cwd=tmp_path, env=dict(os.environ))
    tail = proc.stderr[-4000:]
    assert proc.returncode == 0, tail
    assert f"Done {runs} runs" in proc.stderr, tail
    assert not list(tmp_path.glob("crash-*")), tail


# -- the aio target's checks catch a broken protocol ------------------------------------------


def _checker() -> Any:
    sys.path.insert(0, str(ROOT / "tools"))
    try:
        import fuzz_native
    finally:
        sys.path.remove(str(ROOT / "tools"))
    return fuzz_native


class _Swapped:
    """AioProtocol with the futures of each pair of commands handed out the wrong way round."""

    def __init__(self, loop: asyncio.AbstractEventLoop, *args: Any) -> None:
        native, _ = native_module()
        assert native is not None
        self._inner = native.AioProtocol(loop, *args)
        self._loop = loop
        self._real: list[asyncio.Future[Any]] = []
        self._mine: list[asyncio.Future[Any]] = []

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)

    def execute(self, *args: Any) -> asyncio.Future[Any]:
        self._real.append(self._inner.execute(*args))
        self._mine.append(self._loop.create_future())
        if len(self._real) % 2 == 0:
            self._link(self._real[-2], self._mine[-1])
            self._link(self._real[-1], self._mine[-2])
        return self._mine[-1]

    @staticmethod
    def _link(real: asyncio.Future[Any], mine: asyncio.Future[Any]) -> None:
        def done(fut: asyncio.Future[Any]) -> None:
            if fut.cancelled() or mine.done():
                return
            exc = fut.exception()
            if exc is not None:
                mine.set_exception(exc)
            else:
                mine.set_result(fut.result())

        real.add_done_callback(done)


class _Deaf(_Swapped):
    """AioProtocol that never reads a reply."""

    def execute(self, *args: Any) -> asyncio.Future[Any]:
        return self._inner.execute(*args)  # type: ignore[no-any-return]

    def data_received(self, data: bytes) -> None:
        pass


def test_the_aio_checks_pass_the_real_protocol_and_catch_broken_ones() -> None:
    checker = _checker()
    stream = b":1\r\n$2\r\nhi\r\n"
    checker.check_aio([0, 0], [3], stream)  # the real one: each reply to its own command
    with pytest.raises(AssertionError, match="waiter got"):
        checker.check_aio([0, 0], [3], stream, protocol=_Swapped)
    with pytest.raises(AssertionError, match="a complete reply was not delivered"):
        checker.check_aio([0, 0], [3], stream, protocol=_Deaf)
    # A reply nobody asked for must drop the connection: the real protocol does.
    checker.check_aio([0], [64], b":1\r\n:2\r\n")
    # RESP3's false is a reply, not "no reply yet" (a false finding of the model, once).
    checker.check_aio([1], [12], b"#\x00\r\n#t\r\n2")
