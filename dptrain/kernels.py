"""Fused update kernels: a CuPy-compiled CUDA kernel per operation, and its torch reference.

The reference functions define the semantics; the CUDA kernels in ``dptrain/csrc`` must
match them (tests compare the two on the same inputs). CPU runs use the references.
Neither reads device values on the host: the skip decision is taken on the device.

Dispatch (:func:`kernel_backend`): CUDA tensors go to the CuPy kernels when CuPy imports,
everything else to the references. ``DPTRAIN_KERNELS=torch`` forces the references (tests,
benchmarks, a machine without the CUDA headers NVRTC needs); ``DPTRAIN_KERNELS=cupy`` makes
a missing CuPy an error instead of a silent fallback. CuPy is imported lazily, so the
package imports without it.

The kernels are compiled once per process by NVRTC (``cupy.RawModule``; CuPy also caches
the binary on disk) and need ``cuda_fp16.h``/``cuda_bf16.h`` from a CUDA toolkit that CuPy
can find (``CUDA_PATH``). They launch on torch's current stream with raw ``data_ptr()``
pointers: no copies, no host sync.
"""
from __future__ import annotations

import functools
import logging
import os
from pathlib import Path
from types import ModuleType
from typing import Literal

import torch

from dptrain.errors import ConfigError, SetupError

log = logging.getLogger(__name__)

KERNELS_ENV = "DPTRAIN_KERNELS"
"""Environment variable: "auto" (default), "torch" (always the references) or "cupy"."""
_BACKENDS = ("auto", "torch", "cupy")

SGD_SOURCE = Path(__file__).resolve().parent / "csrc" / "sgd_update.cu"
NVRTC_OPTIONS = (
    "--std=c++17",
    "--fmad=false",  # no a*b+c contraction: the reference rounds every multiply and add
    "-D__CUDA_NO_HALF_CONVERSIONS__",  # conversions are explicit; also decouples fp16/bf16 headers of
    "-D__CUDA_NO_BFLOAT16_CONVERSIONS__",  # different CUDA versions (CuPy bundles its own cuda_fp16.h)
)
BLOCK_THREADS = 256
"""Threads per block of every kernel; equals ``dpt::kBlockThreads`` in sgd_update.cu."""
VECTOR_ELEMS = 4
"""Elements per vector access when every pointer allows it (flat buffers are 64-element aligned)."""
UPDATE_BLOCKS_PER_SM = 16
"""Cap on the update grid: 16 blocks of 256 threads per SM is two waves at full occupancy;
the grid-stride loop covers the rest."""
NORM_MAX_BLOCKS = 1024
"""Stage-1 blocks of the norm; a function of n only, so the sum order is deterministic."""

_CTYPES = {torch.float32: "float", torch.float16: "__half", torch.bfloat16: "__nv_bfloat16"}
STORAGE_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
MOMENTUM_DTYPES = (torch.float32, torch.float16)


def _sgd_kernel_name(storage: torch.dtype, momentum: torch.dtype, vec: int) -> str:
    return f"dptrain_sgd_update<{_CTYPES[storage]}, {_CTYPES[momentum]}, {vec}>"


def _norm_kernel_name(dtype: torch.dtype, vec: int) -> str:
    return f"dptrain_sumsq_partial<{_CTYPES[dtype]}, {vec}>"


_NORM_FINISH = "dptrain_norm_finish"
SGD_KERNEL_NAMES = tuple(
    _sgd_kernel_name(s, m, v) for s in STORAGE_DTYPES for m in MOMENTUM_DTYPES for v in (VECTOR_ELEMS, 1)
)
NORM_KERNEL_NAMES = tuple(_norm_kernel_name(s, v) for s in STORAGE_DTYPES for v in (VECTOR_ELEMS, 1)) + (
    _NORM_FINISH,
)


def grad_norm_reference(grads: torch.Tensor) -> torch.Tensor:
    """L2 norm of one flat gradient buffer, accumulated in fp32: [] fp32 on the device.

    Non-finite gradients make the norm non-finite, so one pass yields both the overflow
    flag and the clipping norm. (Squares of finite bf16 values above ~1.8e19 overflow
    fp32 too; such a step is then treated as an overflow, which is the safe side.)
    """
    return torch.linalg.vector_norm(grads, dtype=torch.float32)


def sgd_update_reference(
    grads: torch.Tensor,
    master: torch.Tensor,
    params: torch.Tensor,
    momentum: torch.Tensor,
    *,
    lr: float,
    momentum_coef: float,
    weight_decay: float,
    decoupled: bool,
    grad_coef: torch.Tensor,
    found_inf: torch.Tensor,
    lr_scale: torch.Tensor | None = None,
) -> None:
    """One SGD step over flat buffers, in place, then zero ``grads``.

    Arguments (all 1-D, same length n, same layout):
      grads     storage dtype; the summed, loss-scaled gradient. Zeroed on return.
      master    fp32 master weights (may be the same tensor as ``params`` for fp32 storage).
      params    storage dtype; receives ``master`` rounded to the storage dtype.
      momentum  fp32 (Caffe form) or fp16 (lr-factored form) history.
      grad_coef [1] fp32: ``1 / (S * world_size)`` times the clipping factor.
      found_inf [1] fp32: non-zero means skip: master, params and momentum stay bit-identical.
      lr_scale  optional [n] fp32 per-element multiplier of ``lr`` (LARC), else 1.

    Per element, in fp32 math, with ``lr_e = lr * lr_scale``:
      g = float(grads) * grad_coef
      g += weight_decay * w                     (decay_mode "l2" only)
      fp32 momentum (Caffe):  h = m*h + lr_e*g;  w -= h
      fp16 momentum (factored, NVIDIA slides):  G = half(m*float(G) + g);  w -= lr_e*float(G)
      w -= weight_decay * lr_e * w              (decay_mode "decoupled", beside the step)
      params = storage(w); grads = 0
    """
    skip = found_inf.reshape(()) != 0
    g = grads.float() * grad_coef
    w = master
    lr_e = lr if lr_scale is None else lr * lr_scale
    if weight_decay and not decoupled:
        g = g + weight_decay * w
    if momentum.dtype == torch.float32:
        h = momentum_coef * momentum + lr_e * g
        step = h
    else:
        h = (momentum_coef * momentum.float() + g).to(momentum.dtype)
        step = lr_e * h.float()
    if weight_decay and decoupled:
        step = step + weight_decay * lr_e * w
    new_w = w - step
    # torch.where keeps the skipped step bit-exact (w - 0*h would turn -0.0 into +0.0)
    # and reads found_inf on the device, so the host never waits.
    momentum.copy_(torch.where(skip, momentum, h))
    master.copy_(torch.where(skip, master, new_w))
    if params is not master:
        params.copy_(master)
    grads.zero_()


# --------------------------------------------------------------------------- dispatch


@functools.cache
def _cupy() -> ModuleType | None:
    """CuPy, imported on first use; None (logged once) when it is not installed."""
    try:
        import cupy
    except ImportError as e:
        log.warning("CuPy is not importable (%s); CUDA tensors use the torch reference updates", e)
        return None
    return cupy


def kernel_backend(*tensors: torch.Tensor) -> Literal["cupy", "torch", "cpu"]:
    """Which implementation :func:`grad_norm`/:func:`sgd_update` use for these tensors.

    "cupy" when every tensor is on CUDA, CuPy imports and ``DPTRAIN_KERNELS`` is not "torch";
    "cpu" (the in-place CPU path, :func:`sgd_update_cpu`) when every tensor is on the CPU and
    ``DPTRAIN_KERNELS`` is "auto"; otherwise "torch" (the reference). Reads the environment on
    every call, so tests and benchmarks can switch per call.
    """
    choice = os.environ.get(KERNELS_ENV, "auto")
    if choice not in _BACKENDS:
        raise ConfigError(f"{KERNELS_ENV}={choice!r} is not one of {_BACKENDS}; unset it or pick one of those")
    if choice == "auto" and not any(t.is_cuda for t in tensors):
        return "cpu"
    if choice == "torch" or not all(t.is_cuda for t in tensors):
        return "torch"
    if _cupy() is None:
        if choice == "cupy":
            raise SetupError(f"{KERNELS_ENV}=cupy but CuPy is not importable; install cupy-cuda12x "
                             f"(pip install dptrain[cuda12]) or set {KERNELS_ENV}=auto")
        return "torch"
    return "cupy"


def grad_norm(grads: torch.Tensor) -> torch.Tensor:
    """Dispatch :func:`grad_norm_reference` (CPU) or its CUDA kernel; same result up to the
    fp32 summation order (the kernel sums per block, then the block sums)."""
    if kernel_backend(grads) == "cupy":
        return _grad_norm_cupy(grads)
    return grad_norm_reference(grads)


def sgd_update(
    grads: torch.Tensor,
    master: torch.Tensor,
    params: torch.Tensor,
    momentum: torch.Tensor,
    *,
    lr: float,
    momentum_coef: float,
    weight_decay: float,
    decoupled: bool,
    grad_coef: torch.Tensor,
    found_inf: torch.Tensor,
    lr_scale: torch.Tensor | None = None,
    cpu_fused: bool = False,
) -> None:
    """Dispatch :func:`sgd_update_reference` (CPU) or its CUDA kernel; same arguments, same bits.

    On the CPU, ``cpu_fused`` selects :func:`sgd_update_cpu_fused` (one compiled pass) over
    :func:`sgd_update_cpu` (in-place passes).

    The one difference: on a skipped step the kernel writes nothing but the zeroed grads,
    while the reference re-derives ``params`` from ``master``; the two agree whenever
    ``params`` already holds ``master`` rounded to the storage dtype, which the flat
    buffers and every update keep true.
    """
    kw = dict(lr=lr, momentum_coef=momentum_coef, weight_decay=weight_decay, decoupled=decoupled,
              grad_coef=grad_coef, found_inf=found_inf, lr_scale=lr_scale)
    tensors = [grads, master, params, momentum, grad_coef, found_inf] + ([lr_scale] if lr_scale is not None else [])
    backend = kernel_backend(*tensors)
    if backend == "cpu":
        (sgd_update_cpu_fused if cpu_fused else sgd_update_cpu)(grads, master, params, momentum, **kw)
    elif backend == "torch":
        sgd_update_reference(grads, master, params, momentum, **kw)
    else:
        _sgd_update_cupy(grads, master, params, momentum, **kw)


def sgd_update_cpu(
    grads: torch.Tensor,
    master: torch.Tensor,
    params: torch.Tensor,
    momentum: torch.Tensor,
    *,
    lr: float,
    momentum_coef: float,
    weight_decay: float,
    decoupled: bool,
    grad_coef: torch.Tensor,
    found_inf: torch.Tensor,
    lr_scale: torch.Tensor | None = None,
) -> None:
    """:func:`sgd_update_reference`'s rule with in-place ops, for CPU tensors.

    On the CPU, reading ``found_inf`` is a plain memory load (no device to wait for), so a
    skipped step returns early instead of computing both outcomes and selecting with
    ``torch.where``; the update itself runs as in-place passes with no temporaries beyond the
    fp32 gradient. About 5x fewer bytes moved than the reference. Results equal the
    reference's up to the rounding of ``m*h + lr*g`` computed as one ``add_(alpha=)``.
    """
    if bool(found_inf.reshape(())):
        grads.zero_()
        return
    g = grads.float() if grads.dtype != torch.float32 else grads  # fp32 storage: reuse, zeroed below
    g.mul_(grad_coef)
    if weight_decay and not decoupled:
        g.add_(master, alpha=weight_decay)
    if momentum.dtype == torch.float32:
        momentum.mul_(momentum_coef)
        if lr_scale is None:
            momentum.add_(g, alpha=lr)
        else:
            momentum.addcmul_(g, lr_scale, value=lr)
        step = momentum
    else:  # lr-factored fp16 history: G = half(m*G + g); step = lr_e * G
        momentum.copy_(momentum.float().mul_(momentum_coef).add_(g))
        step = momentum.float().mul_(lr)
        if lr_scale is not None:
            step.mul_(lr_scale)
    if weight_decay and decoupled:
        decay = master * (weight_decay * lr)
        if lr_scale is not None:
            decay.mul_(lr_scale)
        step = step + decay
    master.sub_(step)
    if params is not master:
        params.copy_(master)
    grads.zero_()



def _fused_body(grads, master, params, momentum, grad_coef, scalars, lr_scale, *, l2: bool, decoupled: bool,
                write_params: bool) -> None:
    """:func:`sgd_update_reference`'s rule for a step that is not skipped, written for inductor
    to fuse into one loop. ``scalars`` is [lr, momentum, weight_decay] fp32 (a tensor, so a
    new lr each iteration does not recompile)."""
    lr, mc, wd = scalars[0], scalars[1], scalars[2]
    g = grads.float() * grad_coef
    lr_e = lr if lr_scale is None else lr * lr_scale
    if l2:
        g = g + wd * master
    if momentum.dtype == torch.float32:
        h = mc * momentum + lr_e * g
        step = h
    else:
        h = (mc * momentum.float() + g).to(momentum.dtype)
        step = lr_e * h.float()
    if decoupled:
        step = step + wd * lr_e * master
    new_w = master - step
    momentum.copy_(h)
    master.copy_(new_w)
    if write_params:
        params.copy_(new_w)
    grads.zero_()


FUSED_VARIANTS_MAX = 64
"""Compiled variants of the fused CPU update allowed per process (flags x dtypes x shapes)."""


@functools.cache
def _fused_update(l2: bool, decoupled: bool, write_params: bool):
    """The compiled update for one combination of flags (compiled on first call, then cached
    by inductor on disk, so later processes load it in seconds)."""
    body = functools.partial(_fused_body, l2=l2, decoupled=decoupled, write_params=write_params)
    # Without emulate_precision_casts inductor drops the fp16/bf16 round trip of a low-precision
    # momentum (h.to(fp16).float()), so the master would take the unrounded history while the
    # stored one is rounded: off the reference rule by up to ~1e-4 per step.
    return torch.compile(body, options={"emulate_precision_casts": True})


def sgd_update_cpu_fused(
    grads: torch.Tensor,
    master: torch.Tensor,
    params: torch.Tensor,
    momentum: torch.Tensor,
    *,
    lr: float,
    momentum_coef: float,
    weight_decay: float,
    decoupled: bool,
    grad_coef: torch.Tensor,
    found_inf: torch.Tensor,
    lr_scale: torch.Tensor | None = None,
) -> None:
    """The update as one fused pass compiled by torch.compile (inductor's C++ backend).

    Reads grads, master and momentum once and writes momentum, master, weights and zeroed
    grads once: about 5x faster than :func:`sgd_update_cpu` on an 11M-parameter model on 2
    cores. The first call per flag combination compiles (~15 s; needs a C++ compiler).
    """
    if bool(found_inf.reshape(())):  # CPU: a plain load, no device to wait for
        grads.zero_()
        return
    scalars = torch.tensor([lr, momentum_coef, weight_decay], dtype=torch.float32)
    fn = _fused_update(bool(weight_decay) and not decoupled, bool(weight_decay) and decoupled,
                       params is not master)
    # One compiled variant per flag/dtype/shape combination (a run has at most a few): lift
    # dynamo's default limit of 8 so none of them silently falls back to the eager passes.
    with torch._dynamo.config.patch(recompile_limit=FUSED_VARIANTS_MAX):
        fn(grads, master, params, momentum, grad_coef, scalars, lr_scale)

# --------------------------------------------------------------------------- CuPy wrappers


@functools.cache
def _module() -> object:
    """The RawModule of sgd_update.cu with every template instance; compiled on first use."""
    cupy = _cupy()
    assert cupy is not None, "_module() called without CuPy; kernel_backend() should have said torch"
    return cupy.RawModule(code=SGD_SOURCE.read_text(), options=NVRTC_OPTIONS,
                          name_expressions=SGD_KERNEL_NAMES + NORM_KERNEL_NAMES)


@functools.cache
def _function(name: str, device_index: int) -> object:
    """One compiled kernel, loaded on one device (compiles the module on first call)."""
    cupy = _cupy()
    with cupy.cuda.Device(device_index):
        try:
            return _module().get_function(name)
        except cupy.cuda.compiler.CompileException as e:
            raise RuntimeError(
                f"compiling {SGD_SOURCE.name} failed ({e}); NVRTC needs cuda_fp16.h and cuda_bf16.h: set "
                f"CUDA_PATH to a CUDA toolkit, or set {KERNELS_ENV}=torch to use the torch reference"
            ) from e


@functools.cache
def _sm_count(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def _launch(name: str, device: torch.device, blocks: int, args: tuple) -> None:
    """Launch kernel ``name`` on torch's current stream of ``device``; asynchronous."""
    cupy = _cupy()
    fn = _function(name, device.index)
    with cupy.cuda.Device(device.index):
        stream = cupy.cuda.ExternalStream(torch.cuda.current_stream(device).cuda_stream)
        fn((blocks,), (BLOCK_THREADS,), args, stream=stream)


def _vector_width(tensors: list[torch.Tensor]) -> int:
    """VECTOR_ELEMS when every tensor's start is aligned to VECTOR_ELEMS of its elements, else 1."""
    ok = all(t.data_ptr() % (VECTOR_ELEMS * t.element_size()) == 0 for t in tensors)
    return VECTOR_ELEMS if ok else 1


def _ptr(t: torch.Tensor | None) -> object:
    import numpy as np

    return np.uint64(0 if t is None else t.data_ptr())


def _check_flat(name: str, t: torch.Tensor, n: int, dtypes: tuple[torch.dtype, ...], device: torch.device) -> None:
    if t.dim() != 1 or t.numel() != n or not t.is_contiguous() or t.device != device:
        raise RuntimeError(f"{name} must be a contiguous 1-D tensor of {n} elements on {device}, "
                         f"got shape {tuple(t.shape)} strides {t.stride()} on {t.device}")
    if t.dtype not in dtypes:
        raise RuntimeError(f"{name} has dtype {t.dtype}; the CUDA kernel supports {dtypes}")


def _check_scalar(name: str, t: torch.Tensor, device: torch.device) -> None:
    if t.numel() != 1 or t.dtype != torch.float32 or t.device != device:
        raise RuntimeError(f"{name} must be one fp32 element on {device} (the kernel reads it there), "
                         f"got shape {tuple(t.shape)} {t.dtype} on {t.device}")


def sgd_scalars(lr: float, momentum_coef: float, weight_decay: float, decoupled: bool) -> tuple:
    """The update kernel's scalar arguments, rounded as the reference's torch ops round them.

    Returns numpy scalars ``(lr, momentum_coef, weight_decay, wd_lr)`` as float32 and
    ``decay_mode`` as int32 (0 none, 1 l2, 2 decoupled). A Python float meeting an fp32
    tensor is rounded to fp32, but the reference's ``weight_decay * lr * w`` multiplies
    the two Python floats first, so ``wd_lr`` is fp32 of their double product.
    """
    import numpy as np

    decay_mode = 0 if not weight_decay else (2 if decoupled else 1)
    return (np.float32(lr), np.float32(momentum_coef), np.float32(weight_decay), np.float32(weight_decay * lr),
            np.int32(decay_mode))


def _grad_norm_cupy(grads: torch.Tensor) -> torch.Tensor:
    """Two-stage L2 norm on the current stream: block sums of squares, then their sum's sqrt."""
    import numpy as np

    n = grads.numel()
    _check_flat("grads", grads, n, STORAGE_DTYPES, grads.device)
    vec = _vector_width([grads])
    blocks = max(1, min(-(-(n // vec) // BLOCK_THREADS), NORM_MAX_BLOCKS))
    partials = torch.empty(blocks, dtype=torch.float32, device=grads.device)  # [blocks] fp32 scratch
    out = torch.empty((), dtype=torch.float32, device=grads.device)  # [] fp32
    _launch(_norm_kernel_name(grads.dtype, vec), grads.device, blocks, (_ptr(grads), np.int64(n), _ptr(partials)))
    _launch(_NORM_FINISH, grads.device, 1, (_ptr(partials), np.int32(blocks), _ptr(out)))
    return out


def _sgd_update_cupy(
    grads: torch.Tensor, master: torch.Tensor, params: torch.Tensor, momentum: torch.Tensor, *,
    lr: float, momentum_coef: float, weight_decay: float, decoupled: bool,
    grad_coef: torch.Tensor, found_inf: torch.Tensor, lr_scale: torch.Tensor | None,
) -> None:
    """Host wrapper of ``dptrain_sgd_update``: checks layouts, rounds the scalars as torch does."""
    import numpy as np

    n, dev = grads.numel(), grads.device
    _check_flat("grads", grads, n, STORAGE_DTYPES, dev)
    _check_flat("master", master, n, (torch.float32,), dev)
    _check_flat("params", params, n, (grads.dtype,), dev)
    _check_flat("momentum", momentum, n, MOMENTUM_DTYPES, dev)
    _check_scalar("grad_coef", grad_coef, dev)
    _check_scalar("found_inf", found_inf, dev)
    if lr_scale is not None:
        _check_flat("lr_scale", lr_scale, n, (torch.float32,), dev)
    # fp32 storage: params is the master; the kernel writes it once, as the master.
    params_arg = None if params.data_ptr() == master.data_ptr() else params
    vec = _vector_width([t for t in (grads, master, params, momentum, lr_scale) if t is not None])
    blocks = max(1, min(-(-(n // vec) // BLOCK_THREADS), UPDATE_BLOCKS_PER_SM * _sm_count(dev.index)))
    args = (
        _ptr(grads), _ptr(master), _ptr(params_arg), _ptr(momentum), _ptr(lr_scale), _ptr(grad_coef), _ptr(found_inf),
        *sgd_scalars(lr, momentum_coef, weight_decay, decoupled), np.int64(n),
    )
    _launch(_sgd_kernel_name(grads.dtype, momentum.dtype, vec), dev, blocks, args)
