"""Fused update kernels: one specification per rule, three backends, one dispatch.

* :mod:`.spec` defines each rule (its state, its scalar rounding, its per-element math)
  and the torch reference that every backend must reproduce, with one argument type,
  :class:`UpdateArgs`.
* ``dptrain/csrc/update.cu`` holds each rule's per-element code once, for both devices:
  :mod:`.cuda` compiles it with NVRTC (:mod:`.nvrtc`) and launches it through CuPy on CUDA
  tensors; :mod:`.native` builds it for the host (``csrc/update_cpu.cc``) and runs it on
  CPU tensors. :mod:`.selfcheck` compares either with the reference, bit for bit, the
  first time a process uses it.
* :mod:`.cpu` runs the rules on CPU tensors as in-place torch passes, where the host
  library cannot be built (no C++ compiler), or as one pass compiled by inductor
  (``solver.cpu_fused_update``).

Adding a rule touches ``spec.py`` (its math and scalars), ``cpu.py`` (its in-place body),
``update.cu`` (its per-element functor and kernel) and nothing else.

Dispatch (:func:`kernel_backend`), by the ``DPTRAIN_KERNELS`` environment variable:
"auto" (default) sends CPU tensors to :mod:`.native` when it builds and passes its
self-check, else (one warning naming why) to :mod:`.cpu`'s in-place passes, and CUDA
tensors to the CuPy kernels when CuPy imports and the self-check passes, else (one warning)
to the reference; "torch" forces the reference everywhere; "cupy" makes any reason not to
use the CuPy kernels on CUDA tensors an error (CPU tensors then use the reference);
"native" makes any reason not to use :mod:`.native` on CPU tensors an error; "inplace"
picks :mod:`.cpu`'s in-place passes for CPU tensors. Nothing here reads a device value on
the host: the skip decision is taken on the device.
"""
from __future__ import annotations

import functools
import logging
import os
from typing import Literal

import torch

from dptrain.errors import ConfigError, SetupError, first_line
from dptrain.kernels import cpu, cuda, native
from dptrain.kernels.spec import RULES, Hyper, UpdateArgs, grad_norm_reference, reference

__all__ = ["KERNELS_ENV", "RULES", "Hyper", "UpdateArgs", "grad_norm", "grad_norm_reference", "kernel_backend",
           "reference", "update", "update_backend"]

log = logging.getLogger(__name__)

KERNELS_ENV = "DPTRAIN_KERNELS"
"""Environment variable: "auto" (default), "torch" (always the reference), "cupy", "native" or "inplace"."""
_CHOICES = ("auto", "torch", "cupy", "native", "inplace")
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


@functools.cache
def _warn_native_fallback(why: str) -> None:
    log.warning("the CPU update library (dptrain/csrc/update_cpu.cc) is not used (%s); training continues with the "
                "in-place torch passes, about 3x slower per update. Set %s=inplace to choose that silently, or "
                "%s=native to make this an error", why, KERNELS_ENV, KERNELS_ENV)


def _cpu_backend(choice: str) -> Literal["native", "inplace", "torch"]:
    if choice in ("torch", "cupy"):
        return "torch"
    if choice == "inplace":
        return "inplace"
    why = native.unusable()
    if why is None:
        return "native"
    if choice == "native":
        raise SetupError(f"{KERNELS_ENV}=native but the CPU update library cannot be used: {why}; fix that or set "
                         f"{KERNELS_ENV}=auto")
    _warn_native_fallback(why)
    return "inplace"


def kernel_backend(*tensors: torch.Tensor) -> Literal["cupy", "torch", "native", "inplace"]:
    """Which implementation :func:`update`/:func:`grad_norm` use for these tensors.

    On the CPU (no tensor on CUDA): "native" (:mod:`.native`) when it passed its self-check,
    else "inplace" (:mod:`.cpu`), or "torch" under ``DPTRAIN_KERNELS`` torch or cupy.
    "cupy" when every tensor is on CUDA and the kernels passed their self-check there;
    otherwise "torch" (the reference). Reads the environment on every call, so tests and
    benchmarks can switch per call.
    """
    choice = _choice()
    if not any(t.is_cuda for t in tensors):
        return _cpu_backend(choice)
    if choice == "torch" or not all(t.is_cuda for t in tensors):
        return "torch"
    return _cuda_backend(tensors, choice)


def _cuda_backend(tensors: tuple[torch.Tensor, ...], choice: str) -> Literal["cupy", "torch"]:
    """"cupy" when the kernels passed their self-check on the tensors' device; else the reference,
    with one warning (an error under ``DPTRAIN_KERNELS=cupy``)."""
    index = tensors[0].device.index or 0
    why = cuda_unusable(index)
    if why is None:
        return "cupy"
    if choice == "cupy":
        raise SetupError(f"{KERNELS_ENV}=cupy but the CuPy update kernels cannot run on cuda:{index}: {why}; "
                         f"fix that or set {KERNELS_ENV}=auto")
    _warn_fallback(index, why)
    return "torch"


def update_backend(*tensors: torch.Tensor, cpu_fused: bool = False) -> str:
    """What :func:`update` runs on these tensors (bench records it): "compiled" on the CPU when
    ``cpu_fused`` asks for inductor's pass (unless ``DPTRAIN_KERNELS`` forces the reference; the
    host library is then neither built nor warned about), else :func:`kernel_backend`'s choice."""
    if cpu_fused and not any(t.is_cuda for t in tensors) and _choice() not in ("torch", "cupy"):
        return "compiled"
    return kernel_backend(*tensors)


_UPDATES = {"compiled": cpu.update_compiled, "native": native.update, "inplace": cpu.update_inplace,
            "torch": reference, "cupy": cuda.update}


def update(a: UpdateArgs, *, cpu_fused: bool = False) -> None:
    """Apply ``a``'s rule with the backend :func:`update_backend` picks; the bits of :func:`reference`
    (the in-place and compiled CPU passes: within a few fp32 ulps of them).

    On the CPU, ``cpu_fused`` selects inductor's compiled pass over the other two. The one
    difference between backends: on a skipped step the kernels write nothing but the
    zeroed gradient, while the reference re-derives ``params`` from ``master``; the two
    agree whenever ``params`` already holds ``master`` rounded to the storage dtype, which
    the flat buffers and every update keep true.
    """
    _UPDATES[update_backend(*a.tensors(), cpu_fused=cpu_fused)](a)


def grad_norm(grads: torch.Tensor) -> torch.Tensor:
    """L2 norm of one flat gradient buffer in fp32 ([] on its device); the CUDA kernel sums
    per block, then the block sums, so it equals the reference up to fp32 summation order."""
    if grads.is_cuda and kernel_backend(grads) == "cupy":  # on the CPU always the reference
        return cuda.grad_norm(grads)
    return grad_norm_reference(grads)
