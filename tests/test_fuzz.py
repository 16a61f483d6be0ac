"""The short run of the Atheris fuzz targets (tools/fuzz_native.py); make fuzz runs the long one.

Each target runs in a child process (libFuzzer exits the process it runs in, and a crash
must fail this test, not end the run) from the committed seed corpus, with a fixed seed
and a fixed number of executions, so the same inputs are tried every time. Here the build
is the normal one and the guidance is Python coverage; make fuzz instruments the C code.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("atheris")

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
