"""Shared test setup: no launcher's environment leaks in (the helper modules are importable through
pyproject.toml's pytest ``pythonpath``)."""
from __future__ import annotations

import os

for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE"):  # never inherit a launcher's env
    os.environ.pop(var, None)
