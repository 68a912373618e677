"""Shared test setup: the harness module is importable, and GPU tests skip with a reason."""
from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(__file__))
for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE"):  # never inherit a launcher's env
    os.environ.pop(var, None)
