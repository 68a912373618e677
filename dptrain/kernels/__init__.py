"""Fused update kernels: one specification per rule, three backends, one dispatch.

* :mod:`.spec` defines each rule (its state, its scalar rounding, its per-element math)
  and the torch reference that every backend must reproduce, with one argument type,
  :class:`UpdateArgs`.
* :mod:`.cpu` runs it on CPU tensors, as in-place passes (default) or as one pass
  compiled by inductor (``solver.cpu_fused_update``).
* :mod:`.cuda` runs ``dptrain/csrc/update.cu`` on CUDA tensors, compiled by NVRTC
  (:mod:`.nvrtc`) and launched through CuPy; :mod:`.selfcheck` compares it with the
  reference the first time a process uses it on a device.

Adding a rule touches ``spec.py`` (its math and scalars), ``cpu.py`` (its in-place body),
``update.cu`` (its kernel) and nothing else.

Dispatch (:func:`kernel_backend`), by the ``DPTRAIN_KERNELS`` environment variable:
"auto" (default) sends CPU tensors to :mod:`.cpu` and CUDA tensors to the CuPy kernels
when CuPy imports and the self-check passes, else (one warning naming why) to the
reference; "torch" forces the reference everywhere; "cupy" makes any reason not to use
the CuPy kernels on CUDA tensors an error. Nothing here reads a device value on the
host: the skip decision is taken on the device.
"""
from __future__ import annotations

import functools
import logging
import os
from typing import Literal

import torch

from dptrain.errors import ConfigError, SetupError, first_line
from dptrain.kernels import cpu, cuda
from dptrain.kernels.spec import RULES, Hyper, UpdateArgs, grad_norm_reference, reference

__all__ = ["KERNELS_ENV", "RULES", "Hyper", "UpdateArgs", "grad_norm", "grad_norm_reference", "kernel_backend",
           "reference", "update"]

log = logging.getLogger(__name__)

KERNELS_ENV = "DPTRAIN_KERNELS"
"""Environment variable: "auto" (default), "torch" (always the reference) or "cupy"."""
_CHOICES = ("auto", "torch", "cupy")
INSTALL_HINT = ("pip install 'dptrain[cuda13]' for a CUDA 13 torch (cupy-cuda13x) or 'dptrain[cuda12]' for a "
                "CUDA 12 one (cupy-cuda12x)")


def _choice() -> str:
    choice = os.environ.get(KERNELS_ENV, "auto")
    if choice not in _CHOICES:
        raise ConfigError(f"{KERNELS_ENV}={choice!r} is not one of {_CHOICES}; unset it or pick one of those")
    return choice


@functools.cache
def cuda_unusable(device_index: int) -> str | None:
    """Why the CuPy kernels cannot be used on this device, or None when they passed the
    self-check; computed once per process and device (compiling takes a few seconds)."""
    if cuda.cupy_module() is None:
        return f"CuPy is not importable ({INSTALL_HINT})"
    from dptrain.kernels import selfcheck

    try:
        return selfcheck.run(device_index)
    except Exception as e:  # noqa: BLE001 - compile, load or launch failure: any of them means "not usable"
        return f"{type(e).__name__}: {first_line(e)}"


@functools.cache
def _warn_fallback(device_index: int, why: str) -> None:
    log.warning("cuda:%d: the CuPy update kernels are not used (%s); training continues with the torch reference "
                "updates, which move several times more bytes. Set %s=torch to choose that silently, or %s=cupy to "
                "make this an error", device_index, why, KERNELS_ENV, KERNELS_ENV)


def kernel_backend(*tensors: torch.Tensor) -> Literal["cupy", "torch", "cpu"]:
    """Which implementation :func:`update`/:func:`grad_norm` use for these tensors.

    "cpu" (:mod:`.cpu`) when every tensor is on the CPU and ``DPTRAIN_KERNELS`` is "auto";
    "cupy" when every tensor is on CUDA and the kernels passed their self-check there;
    otherwise "torch" (the reference). Reads the environment on every call, so tests and
    benchmarks can switch per call.
    """
    choice = _choice()
    if choice == "auto" and not any(t.is_cuda for t in tensors):
        return "cpu"
    if choice == "torch" or not all(t.is_cuda for t in tensors):
        return "torch"
    index = tensors[0].device.index or 0
    why = cuda_unusable(index)
    if why is None:
        return "cupy"
    if choice == "cupy":
        raise SetupError(f"{KERNELS_ENV}=cupy but the CuPy update kernels cannot run on cuda:{index}: {why}; "
                         f"fix that or set {KERNELS_ENV}=auto")
    _warn_fallback(index, why)
    return "torch"


def update(a: UpdateArgs, *, cpu_fused: bool = False) -> None:
    """Apply ``a``'s rule with the backend :func:`kernel_backend` picks; same bits as :func:`reference`.

    On the CPU, ``cpu_fused`` selects the compiled pass over the in-place ones. The one
    difference between backends: on a skipped step the kernels write nothing but the
    zeroed gradient, while the reference re-derives ``params`` from ``master``; the two
    agree whenever ``params`` already holds ``master`` rounded to the storage dtype, which
    the flat buffers and every update keep true.
    """
    backend = kernel_backend(*a.tensors())
    if backend == "cpu":
        (cpu.update_compiled if cpu_fused else cpu.update_inplace)(a)
    elif backend == "torch":
        reference(a)
    else:
        cuda.update(a)


def grad_norm(grads: torch.Tensor) -> torch.Tensor:
    """L2 norm of one flat gradient buffer in fp32 ([] on its device); the CUDA kernel sums
    per block, then the block sums, so it equals the reference up to fp32 summation order."""
    if kernel_backend(grads) == "cupy":
        return cuda.grad_norm(grads)
    return grad_norm_reference(grads)
