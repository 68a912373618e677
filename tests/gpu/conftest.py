"""tests/gpu: every case is either a "cpu" one without the gpu mark or a CUDA one with it (see tests/devices.py)."""
from __future__ import annotations

from pathlib import Path

import pytest

from devices import device_mark_error

HERE = Path(__file__).resolve().parent


@pytest.hookimpl(tryfirst=True)  # before -m deselects anything: every case is checked on every run
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    errors = []
    for item in items:
        if HERE not in Path(item.path).resolve().parents:
            continue
        callspec = getattr(item, "callspec", None)
        device = callspec.params.get("device") if callspec is not None else None
        why = device_mark_error(item.nodeid, device, item.get_closest_marker("gpu") is not None)
        if why is not None:
            errors.append(why)
    if errors:
        raise pytest.UsageError("tests/gpu marks:\n" + "\n".join(errors))
