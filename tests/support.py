"""Paths and subprocess helpers shared by the tests (imported as ``support``; conftest modules are not
importable by name once tests/gpu has its own)."""

from __future__ import annotations

import os
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
SRC = REPO / "src"
PYTHON = sys.executable


def subprocess_env() -> dict[str, str]:
    """Environment for a child Python that imports this checkout's package (src layout)."""
    env = dict(os.environ)
    env["PYTHONPATH"] = str(SRC) + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    env["PYTHONUNBUFFERED"] = "1"
    return env

