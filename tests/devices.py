"""Device parameters for tests/gpu: each test's logic runs on the CPU in `make test` and on CUDA under `pytest -m gpu`.

A test that takes ``device`` from :data:`DEVICES` runs twice: "cpu" (no mark, so CI's
``-m "not gpu"`` runs it) and "cuda" (marked ``gpu``, skipped with a reason where no GPU is
visible). A test whose logic needs CUDA itself (stream ordering, sync-debug mode, NCCL,
the CuPy kernels) takes :func:`gpu_only`. tests/gpu/conftest.py checks these rules at
collection; tests/gpu/README.md lists what stays GPU-only and why.
"""
from __future__ import annotations

import importlib.util
from collections.abc import Callable
from typing import TypeVar

import pytest
import torch

F = TypeVar("F", bound=Callable[..., object])

CUDA_COUNT = torch.cuda.device_count() if torch.cuda.is_available() else 0


def requires_gpus(n: int) -> pytest.MarkDecorator:
    """Skip unless ``n`` CUDA devices are visible, saying how many are."""
    return pytest.mark.skipif(CUDA_COUNT < n, reason=f"needs {n} GPU{'s' if n > 1 else ''}, found {CUDA_COUNT}")


def requires_cupy() -> pytest.MarkDecorator:
    """Skip unless CuPy imports (the CUDA kernels are loaded and launched through it)."""
    return pytest.mark.skipif(importlib.util.find_spec("cupy") is None,
                              reason="needs CuPy (pip install dptrain[cuda13] or [cuda12]) for the CUDA kernels")


def cuda_param(*marks: pytest.MarkDecorator) -> object:
    """The "cuda" value of a device parameter: marked ``gpu``, skipped without a GPU (and ``marks``)."""
    return pytest.param("cuda", marks=[pytest.mark.gpu, requires_gpus(1), *marks], id="cuda")


DEVICES = ["cpu", cuda_param()]
"""``@pytest.mark.parametrize("device", DEVICES)``: the CPU always, CUDA where there is one."""


def gpu_only(*marks: pytest.MarkDecorator) -> Callable[[F], F]:
    """Mark a test whose logic needs CUDA: ``gpu``, skipped without one GPU, plus ``marks``."""
    def apply(fn: F) -> F:
        for mark in (pytest.mark.gpu, requires_gpus(1), *marks):
            fn = mark(fn)
        return fn
    return apply


def device_mark_error(nodeid: str, device: str | None, has_gpu_mark: bool) -> str | None:
    """Why a tests/gpu item's marks break the rules above, or None when they keep them:
    a "cpu" case must not carry ``gpu`` (CI would never run it), a "cuda" case and a test
    with no device parameter (GPU-only) must (CI would fail on it)."""
    if device == "cpu" and has_gpu_mark:
        return f"{nodeid}: a cpu case carries the gpu mark, so `make test` (-m 'not gpu') never runs it"
    if device != "cpu" and not has_gpu_mark:
        return (f"{nodeid}: a {device or 'GPU-only'} case lacks the gpu mark; use devices.DEVICES for the device "
                "parameter or devices.gpu_only for a test whose logic needs CUDA")
    return None
