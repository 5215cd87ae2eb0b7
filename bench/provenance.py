"""Which commit a bench run measured.

The device machine's copy of the tree may carry a stale ``.git`` (or none, or no git at all), so a caller
that knows better names the commit in ``FERRY_COMMIT``; otherwise ``git rev-parse`` answers.
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def commit() -> str:
    named = os.environ.get("FERRY_COMMIT")
    if named:
        return named
    try:
        found = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True, text=True)
    except OSError:
        return "unknown"
    return found.stdout.strip() or "unknown"
