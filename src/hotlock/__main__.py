"""``python -m hotlock``: the ``hotlock`` command line (see hotlock._cli)."""

from __future__ import annotations

import sys

from ._cli import main

if __name__ == "__main__":
    sys.exit(main())
