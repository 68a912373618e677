"""Where a result came from: the source checkout a benchmark record names.

Its own module, below everything that writes records (``bench``, ``tools.data_bench``,
``benchmarks/``), so that the data pipeline's benchmark need not import the trainer's.
"""
from __future__ import annotations

import subprocess
from pathlib import Path


def git_commit() -> str:
    """The checkout's commit, or "unknown" outside a git tree."""
    try:
        return subprocess.run(["git", "rev-parse", "--short=12", "HEAD"], capture_output=True, text=True,
                              cwd=Path(__file__).resolve().parent, timeout=10).stdout.strip() or "unknown"
    except (OSError, subprocess.SubprocessError):
        return "unknown"
