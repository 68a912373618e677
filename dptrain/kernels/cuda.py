"""The CUDA backend: dptrain/csrc/update.cu compiled by NVRTC, loaded and launched through CuPy.

Every rule's kernel takes the same argument list, built once here from :class:`UpdateArgs`:

    grads, master, params (nullptr when it is the master), *state, lr_scale, decay_scale,
    grad_coef, found_inf, bias_correction (each optional one nullptr when absent),
    *rule scalars (fp32 floats, int32 flags), n

and is named ``dptrain_<rule>_update<T, M, V>`` (storage dtype, state dtype, vector width).
Kernels launch on torch's current stream with raw ``data_ptr()`` pointers: no copies, no
host sync. The module is compiled by :mod:`.nvrtc`, with :data:`NVRTC_OPTIONS` and nothing
else (CuPy never compiles it, so none of CuPy's own options, such as ``-ftz=true``, apply),
once per GPU architecture: the cubin is kept in ``<cache>/nvrtc`` (``dptrain.csrc.build.cache_dir``)
under a hash of everything that makes it, so later processes load it instead of spending
seconds in NVRTC (:func:`compile_module_cached`). CuPy is imported lazily: the package imports
without it.
"""
from __future__ import annotations

import functools
import hashlib
import json
import logging
import os
import tempfile
import warnings
from pathlib import Path
from types import ModuleType
from typing import Any

import numpy as np
import torch

from dptrain.csrc.build import cache_dir
from dptrain.errors import SetupError
from dptrain.kernels import nvrtc
from dptrain.kernels.spec import RULES, Rule, UpdateArgs, rule_of

log = logging.getLogger(__name__)

SOURCE = Path(__file__).resolve().parent.parent / "csrc" / "update.cu"
NVRTC_OPTIONS = (
    "--std=c++17",
    "--fmad=false",  # no a*b+c contraction: the reference rounds every multiply and add
    "--ftz=false",  # keep fp32 subnormals, as torch does (NVRTC's default; stated, since CuPy adds -ftz=true)
    "--prec-div=true",  # IEEE division and square root, as torch's CUDA kernels
    "--prec-sqrt=true",
    "-D__CUDA_NO_HALF_CONVERSIONS__",  # conversions are explicit; also decouples fp16/bf16 headers of
    "-D__CUDA_NO_BFLOAT16_CONVERSIONS__",  # different CUDA versions
)
BLOCK_THREADS = 256
"""Threads per block of every kernel; equals ``dpt::kBlockThreads`` in update.cu."""
VECTOR_BYTES = 16
"""Bytes per vector access of the storage-dtype streams (gradients, weights) when every pointer allows
it: 4 fp32 or 8 fp16/bf16 elements per pack (:func:`vector_elems`); the fp32 streams of a 16-bit
pack (master, fp32 state) then move as two 16-byte accesses. Flat buffers are 64-element aligned."""
UPDATE_WAVES = 2
"""The update grid holds this many waves of resident blocks (occupancy API); the grid-stride
loop covers the rest. Two waves leave the tail of one wave to overlap the next."""
FALLBACK_BLOCKS_PER_SM = 8
"""Blocks per SM assumed when the occupancy API is unavailable: a 256-thread block with up to
~48 registers per thread fits 5 per SM (64k registers), so 8 is under two waves."""
NORM_MAX_BLOCKS = 1024
"""Blocks of the norm, at most; a function of n only, so the sum order is deterministic."""

CTYPES = {torch.float32: "float", torch.float16: "__half", torch.bfloat16: "__nv_bfloat16"}
STORAGE_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def vector_elems(storage: torch.dtype) -> int:
    """Elements per pack for ``storage``: one 16-byte access of the storage stream."""
    return VECTOR_BYTES // storage.itemsize


def update_kernel_name(rule: Rule, storage: torch.dtype, state: torch.dtype, vec: int) -> str:
    return f"dptrain_{rule.name}_update<{CTYPES[storage]}, {CTYPES[state]}, {vec}>"


def norm_kernel_name(dtype: torch.dtype, vec: int) -> str:
    return f"dptrain_norm<{CTYPES[dtype]}, {vec}>"


def name_expressions() -> tuple[str, ...]:
    """Every kernel instance the run-time path may launch: what NVRTC must lower."""
    updates = tuple(update_kernel_name(r, s, m, v) for r in RULES.values() for s in STORAGE_DTYPES
                    for m in r.state_dtypes for v in (vector_elems(s), 1))
    norms = tuple(norm_kernel_name(s, v) for s in STORAGE_DTYPES for v in (vector_elems(s), 1))
    return updates + norms


def compile_module(arch: str, library: str | None = None) -> nvrtc.Compiled:
    """update.cu compiled for ``arch`` ("sm_90", or "compute_90" for PTX) exactly as a solver
    compiles it at first use: :data:`NVRTC_OPTIONS`, the headers beside NVRTC, every name."""
    lib = library or nvrtc.find_library()
    options = (*NVRTC_OPTIONS, f"-I{nvrtc.find_include(lib)}")
    return nvrtc.compile_cuda(SOURCE.read_text(), name=SOURCE.name, options=options,
                              name_expressions=name_expressions(), arch=arch, library=lib)


ELF_MAGIC = b"\x7fELF"
"""How a cubin starts."""


def compile_module_cached(arch: str, library: str | None = None, *, reuse: bool = True) -> tuple[nvrtc.Compiled, bool]:
    """:func:`compile_module` through ``<cache>/nvrtc``, and whether it came from there. The cubin
    and its lowered names are stored under a hash of the sources (update.cu and the csrc
    headers), the options, the names, ``arch`` and the NVRTC library and version, so a change of
    any makes a new entry. An entry that is not whole (no names, a file that is not a cubin) is
    compiled again, and so is any entry with ``reuse`` false (a cubin the driver refused to load:
    :class:`_Loaded`); a cache that cannot be read or written costs a compile, nothing else. A
    wrong cubin would still be caught by the first-use self-check (``kernels.selfcheck``)."""
    lib = library or nvrtc.find_library()
    sources = [SOURCE.read_text(), *(h.read_text() for h in sorted(SOURCE.parent.glob("*.h")))]
    key = hashlib.sha256(json.dumps([sources, NVRTC_OPTIONS, name_expressions(), arch, lib,
                                     nvrtc.version(lib)]).encode()).hexdigest()[:24]
    stem = cache_dir() / "nvrtc" / f"update-{arch}-{key}"
    binary, names = stem.with_suffix(".cubin"), stem.with_suffix(".json")
    if reuse:
        try:
            data, lowered = binary.read_bytes(), json.loads(names.read_text())
            if data.startswith(ELF_MAGIC) and isinstance(lowered, dict) and set(lowered) == set(name_expressions()):
                return nvrtc.Compiled(arch, data, lowered, "", ()), True
        except (OSError, ValueError):
            pass
    compiled = compile_module(arch, lib)
    try:  # the names last: an entry is whole once its names exist
        stem.parent.mkdir(parents=True, exist_ok=True)
        for path, data in ((binary, compiled.binary), (names, json.dumps(compiled.lowered).encode())):
            fd, tmp = tempfile.mkstemp(dir=stem.parent, prefix=f"{path.name}.", suffix=".tmp")
            try:
                with os.fdopen(fd, "wb") as f:
                    f.write(data)
                os.replace(tmp, path)
            finally:
                Path(tmp).unlink(missing_ok=True)
    except OSError as e:
        log.debug("cannot cache the NVRTC build in %s (%s)", stem.parent, e)
    return compiled, False


# --------------------------------------------------------------------------------------- CuPy


@functools.cache
def cupy_module() -> ModuleType | None:
    """CuPy, imported on first use; None (logged once) when it is not installed."""
    try:
        import cupy
    except ImportError as e:
        log.warning("CuPy is not importable (%s); CUDA tensors use the torch reference updates", e)
        return None
    return cupy


class _Loaded:
    """update.cu's cubin loaded on one device, with its lowered names."""

    def __init__(self, device_index: int) -> None:
        cupy = cupy_module()
        major, minor = torch.cuda.get_device_capability(device_index)
        cuda_major = int(torch.version.cuda.split(".")[0]) if torch.version.cuda else None
        arch, library = f"sm_{major}{minor}", nvrtc.find_library(cuda_major)
        compiled, cached = compile_module_cached(arch, library)
        try:
            self._load(cupy, compiled, device_index)
        except Exception as e:  # noqa: BLE001 - a cached cubin the driver refuses: compiled afresh, once
            if not cached:
                raise
            log.info("the cached NVRTC build of %s did not load (%s); compiling it again", SOURCE.name, e)
            compiled, _ = compile_module_cached(arch, library, reuse=False)
            self._load(cupy, compiled, device_index)
        self.device_index = device_index
        self.arch = compiled.arch

    def _load(self, cupy: ModuleType, compiled: nvrtc.Compiled, device_index: int) -> None:
        # CuPy loads a cubin from a file (cuModuleLoad); the file is only needed while loading
        digest = hashlib.sha256(compiled.binary).hexdigest()[:16]
        with tempfile.TemporaryDirectory(prefix="dptrain-cubin-") as d:
            path = Path(d) / f"update-{digest}.cubin"
            path.write_bytes(compiled.binary)
            with cupy.cuda.Device(device_index):
                self.module = cupy.RawModule(path=str(path))
                self.functions = {expr: self.module.get_function(low) for expr, low in compiled.lowered.items()}


@functools.cache
def loaded(device_index: int) -> _Loaded:
    """The compiled module on ``device_index`` (compiled and loaded on first call)."""
    try:
        return _Loaded(device_index)
    except nvrtc.NvrtcError as e:
        raise SetupError(f"compiling {SOURCE.name} failed: {e}") from e


@functools.cache
def _stream(ptr: int, device_index: int) -> Any:
    """CuPy's handle of torch's stream ``ptr``, made once per stream (a new ExternalStream per
    launch warns in CuPy 14 and costs a Python object per kernel)."""
    cupy = cupy_module()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        return cupy.cuda.ExternalStream(ptr, device_index)


@functools.cache
def _sm_count(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


@functools.cache
def _resident_blocks(expr: str, device_index: int) -> int:
    """Blocks of kernel ``expr`` resident per SM at BLOCK_THREADS threads (occupancy API)."""
    cupy = cupy_module()
    fn = loaded(device_index).functions[expr]
    try:
        with cupy.cuda.Device(device_index):
            return max(1, int(cupy.cuda.driver.occupancyMaxActiveBlocksPerMultiprocessor(fn.ptr, BLOCK_THREADS, 0)))
    except (AttributeError, RuntimeError) as e:  # an older CuPy without the binding
        log.debug("occupancy API unavailable (%s); assuming %d blocks per SM", e, FALLBACK_BLOCKS_PER_SM)
        return FALLBACK_BLOCKS_PER_SM


def _launch(expr: str, device: torch.device, blocks: int, args: tuple, stream: int | None = None) -> None:
    """Launch kernel ``expr`` on torch's stream ``stream`` (a handle; default the current stream of
    ``device``); asynchronous."""
    cupy = cupy_module()
    fn = loaded(device.index).functions[expr]
    stream = _stream(torch.cuda.current_stream(device).cuda_stream if stream is None else stream, device.index)
    with cupy.cuda.Device(device.index):
        fn((blocks,), (BLOCK_THREADS,), args, stream=stream)


def vector_width(tensors: list[torch.Tensor], storage: torch.dtype) -> int:
    """:func:`vector_elems` of ``storage`` when every tensor's start is aligned to that many of its
    own elements (a pack of each is one aligned struct), else 1."""
    v = vector_elems(storage)
    return v if all(t.data_ptr() % (v * t.element_size()) == 0 for t in tensors) else 1


def _ptr(t: torch.Tensor | None) -> np.uint64:
    return np.uint64(0 if t is None else t.data_ptr())


def check_flat(name: str, t: torch.Tensor, n: int, dtypes: tuple[torch.dtype, ...], device: torch.device) -> None:
    if t.dim() != 1 or t.numel() != n or not t.is_contiguous() or t.device != device:
        raise RuntimeError(f"{name} must be a contiguous 1-D tensor of {n} elements on {device}, "
                           f"got shape {tuple(t.shape)} strides {t.stride()} on {t.device}")
    if t.dtype not in dtypes:
        raise RuntimeError(f"{name} has dtype {t.dtype}; update.cu supports {dtypes}")


def check_scalar(name: str, t: torch.Tensor, device: torch.device, count: int = 1) -> None:
    if t.numel() != count or t.dtype != torch.float32 or t.device != device or not t.is_contiguous():
        what = "one fp32 element" if count == 1 else f"{count} contiguous fp32 elements"
        raise RuntimeError(f"{name} must be {what} on {device} (the kernel reads it there), "
                           f"got shape {tuple(t.shape)} {t.dtype} on {t.device}")


def kernel_scalars(scalars: tuple) -> tuple:
    """A rule's scalars as kernel arguments: float fields fp32, int fields int32."""
    return tuple(np.int32(v) if isinstance(v, int) else np.float32(v) for v in scalars)


def check_update_args(a: UpdateArgs, rule: Rule) -> None:
    """Every layout update.cu's entry points assume (its kernels here, its host build in
    :mod:`.native`): per-element tensors 1-D, contiguous, of one length, on the gradient's
    device; a storage dtype update.cu has; one state dtype, one the rule keeps; fp32 masters,
    tables and device scalars."""
    n, dev = a.numel, a.grads.device
    check_flat("grads", a.grads, n, STORAGE_DTYPES, dev)
    check_flat("master", a.master, n, (torch.float32,), dev)
    check_flat("params", a.params, n, (a.grads.dtype,), dev)
    state_dtype = a.state[0].dtype
    if state_dtype not in rule.state_dtypes or any(t.dtype != state_dtype for t in a.state):
        raise RuntimeError(f"rule {rule.name} keeps its state in {rule.state_dtypes}, one dtype for all of it; got "
                           f"{[t.dtype for t in a.state]}")
    for name, t in zip(rule.state_names, a.state, strict=True):
        check_flat(name, t, n, (state_dtype,), dev)
    check_scalar("grad_coef", a.grad_coef, dev)
    check_scalar("found_inf", a.found_inf, dev)
    for name in ("lr_scale", "decay_scale"):
        if getattr(a, name) is not None:
            check_flat(name, getattr(a, name), n, (torch.float32,), dev)
    if a.bias_correction is not None:
        check_scalar("bias_correction", a.bias_correction, dev, count=2)


def update_args(a: UpdateArgs, rule: Rule) -> tuple:
    """The kernel argument tuple of one update (see the module docstring); checks every layout."""
    check_update_args(a, rule)
    params = None if a.params.data_ptr() == a.master.data_ptr() else a.params  # fp32: written once, as the master
    return (_ptr(a.grads), _ptr(a.master), _ptr(params), *(_ptr(t) for t in a.state), _ptr(a.lr_scale),
            _ptr(a.decay_scale), _ptr(a.grad_coef), _ptr(a.found_inf), _ptr(a.bias_correction),
            *kernel_scalars(rule.scalars(a.hyper)), np.int64(a.numel))


def update(a: UpdateArgs) -> None:
    """Launch the rule's fused kernel over one flat group on the current stream."""
    rule = rule_of(a)
    args = update_args(a, rule)
    vec = vector_width([t for t in (a.grads, a.master, a.params, *a.state, a.lr_scale, a.decay_scale) if t is not None],
                       a.grads.dtype)
    expr = update_kernel_name(rule, a.grads.dtype, a.state[0].dtype, vec)
    dev = a.grads.device
    cap = UPDATE_WAVES * _resident_blocks(expr, dev.index) * _sm_count(dev.index)
    _launch(expr, dev, max(1, min(-(-(a.numel // vec) // BLOCK_THREADS), cap)), args)


_NORM_SCRATCH: dict[tuple[int, int], tuple[torch.Tensor, torch.Tensor]] = {}
"""(device, stream) -> the norm's scratch on that stream (:func:`_norm_scratch`)."""


def _norm_scratch(device_index: int, stream: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The norm's block partials ([NORM_MAX_BLOCKS] fp32) and arrival counter ([1] uint32 as int32,
    zeroed here once; the kernel leaves it 0) for one stream: reused by every call on that stream,
    whose launches run in order, so a call never allocates them or zeroes them again. Made outside
    any CUDA graph capture, which would record the zeroing instead of running it. A graph that
    captures a norm keeps its capture stream's scratch: replay it ordered with that stream's other
    norms (dptrain captures none: the update runs outside model.compile's CUDA graphs)."""
    key = (device_index, stream)
    if key not in _NORM_SCRATCH:
        if torch.cuda.is_current_stream_capturing():
            raise RuntimeError("kernels.cuda.grad_norm: first call on this stream inside a CUDA graph capture; "
                               "call it once on the stream before capturing, so its scratch is made and zeroed")
        device = torch.device("cuda", device_index)
        _NORM_SCRATCH[key] = (torch.empty(NORM_MAX_BLOCKS, dtype=torch.float32, device=device),
                              torch.zeros(1, dtype=torch.int32, device=device))
    return _NORM_SCRATCH[key]


def grad_norm(grads: torch.Tensor) -> torch.Tensor:
    """L2 norm in fp32 on the current stream: one launch (``dptrain_norm``), one allocation (the result)."""
    n = grads.numel()
    check_flat("grads", grads, n, STORAGE_DTYPES, grads.device)
    vec = vector_width([grads], grads.dtype)
    blocks = max(1, min(-(-(n // vec) // BLOCK_THREADS), NORM_MAX_BLOCKS))
    stream = torch.cuda.current_stream(grads.device).cuda_stream
    partials, arrived = _norm_scratch(grads.device.index, stream)
    out = torch.empty((), dtype=torch.float32, device=grads.device)  # [] fp32
    _launch(norm_kernel_name(grads.dtype, vec), grads.device, blocks,
            (_ptr(grads), np.int64(n), _ptr(partials), _ptr(arrived), _ptr(out)), stream)
    return out
