"""`make demo` runs examples/settle_invoices.py: it must settle every invoice exactly once."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

DEMO = Path(__file__).resolve().parent.parent / "examples" / "settle_invoices.py"


def test_demo_settles_every_invoice_exactly_once(redis_url: str) -> None:
    env = {**os.environ, "CACHE_URL": redis_url, "HOTLOCK_DEMO_INVOICES": "300"}
    out = subprocess.run([sys.executable, str(DEMO)], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "300/300 invoices settled exactly once" in out.stdout
    assert "sections/s" in out.stdout
