"""The CPU backend of the update rules: ``update.cu``'s per-element code built for the host.

``dptrain/csrc/update_cpu.cc`` includes ``update.cu`` (which takes its fp16/bf16 types from
``host_half.h`` when no CUDA compiler reads it) and runs each rule's functor, the one the GPU
kernel runs, over a range of the flat buffers in one pass: read gradient, master and state
once, write state, master, weights and the zeroed gradient once. So a rule is written once
for both devices, and the CPU update moves the bytes the fused GPU kernel moves, instead of
the eight or more passes of :mod:`.cpu`'s in-place torch ops.

It is built at first use with the system C++ compiler (``$CXX``, else ``c++``/``g++``) and
cached (:mod:`dptrain.csrc.build`), in about 3 s. The flags keep the reference's roundings:
``-ffp-contract=off`` (no fused multiply-add, as NVRTC's ``--fmad=false``), no fast-math
(IEEE division, square root and subnormals); ``-fno-math-errno`` only lets ``sqrtf``
vectorise (its value is the same; errno, which nothing reads, is no longer set).
On x86-64 it is tuned for the host CPU (``-march=native``), which is part of the cache key.

Before first use in a process, :func:`unusable` runs :func:`dptrain.kernels.selfcheck.compare`
on it (every rule, storage and state dtype, each table alone and both, every decay mode,
subnormals, a skipped step) against the torch reference, bit for bit; a build failure or a
mismatch makes the dispatch (:func:`dptrain.kernels.kernel_backend`) use :mod:`.cpu`'s
in-place passes, with one warning.

Moving the bytes once, the update takes a fraction of the in-place passes' time, and less still
tuned for the host CPU (measurements: docs/measurements.md#native-update).
"""
from __future__ import annotations

import ctypes
import functools
import logging
import os
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import torch

from dptrain.csrc import build as native_build
from dptrain.errors import first_line
from dptrain.kernels.cuda import check_update_args  # update.cu's layout rules, on either device
from dptrain.kernels.spec import RULES, UpdateArgs, rule_of

log = logging.getLogger(__name__)

CSRC = Path(__file__).resolve().parent.parent / "csrc"
SOURCE = CSRC / "update_cpu.cc"
SOURCES = (SOURCE, CSRC / "update.cu", CSRC / "host_half.h")
"""Every file the build reads: all of them key the cached library."""
CXXFLAGS = ("-O3", "-std=c++17", "-ffp-contract=off", "-fno-math-errno", "-fPIC", "-shared")
TUNE_FLAGS = native_build.TUNE_FLAGS
RULE_CODES = {name: code for code, name in enumerate(RULES)}
"""``rule`` argument of ``dptrain_cpu_update``: the rule's index in ``spec.RULES``."""


def rules_macro() -> str:
    """``-DDPT_RULES(X)=X(0, functor) X(1, functor) ...``: the C++ dispatch of ``update_cpu.cc``, from spec.RULES."""
    return "-DDPT_RULES(X)=" + " ".join(f"X({RULE_CODES[r.name]}, {r.functor})" for r in RULES.values())
DTYPE_CODES = {torch.float32: 0, torch.float16: 1, torch.bfloat16: 2}
"""``storage`` and ``state`` arguments of ``dptrain_cpu_update``."""
RANGE_ALIGN = 64
"""Ranges given to threads start at multiples of this many elements: at a cache-line boundary
of every buffer (64 elements are 128 B or more), so no two threads write one cache line."""
MIN_ELEMS_PER_THREAD = 1 << 18
"""A thread gets at least this many elements (~1 ms of work); smaller updates run on one."""

_lock = threading.Lock()
_state: dict[str, object] = {}  # "lib": the loaded library, or "why": the reason it is unusable


def _compiler() -> list[str] | None:
    return native_build.compiler("CXX", ("c++", "g++", "clang++"))


def build(directory: Path | None = None, *, tune: bool = True) -> Path:
    """Compile update_cpu.cc (default: into ``native_build.cache_dir()``) unless already there; the path.

    ``tune`` adds :data:`TUNE_FLAGS`. Raises RuntimeError when there is no compiler or the
    build fails (with the compiler's first error line).
    """
    cxx = _compiler()
    if cxx is None:
        raise RuntimeError(f"no C++ compiler {os.environ.get('CXX', 'c++')!r} (install g++ or set CXX)")
    flags = (*CXXFLAGS, rules_macro(), *(TUNE_FLAGS if tune else ()))
    return native_build.build_library(name="update_cpu", main=SOURCE, sources=SOURCES, command=cxx, flags=flags,
                                      machine=native_build.host_cpu() if tune and TUNE_FLAGS else b"",
                                      directory=directory)


def load(path: Path) -> ctypes.CDLL:
    """The library at ``path`` with ``dptrain_cpu_update``'s signature declared."""
    lib = ctypes.CDLL(str(path))
    fn = lib.dptrain_cpu_update
    fn.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_int,  # rule, storage, state
                   *[ctypes.c_void_p] * 11,  # grads, master, params, s0, s1, lr_scale, decay_scale,
                   # grad_coef, found_inf, bias_correction, floats
                   ctypes.c_int, ctypes.c_int, ctypes.c_longlong]  # n_floats, decay_mode, n
    fn.restype = ctypes.c_int
    return lib


def self_check(lib: ctypes.CDLL) -> str | None:
    """:func:`dptrain.kernels.selfcheck.compare` on the CPU with ``lib``: None, or the first mismatch."""
    from dptrain.kernels import selfcheck
    from dptrain.kernels.spec import grad_norm_reference

    return selfcheck.compare(functools.partial(update, lib=lib), grad_norm_reference, torch.device("cpu"))


def unusable() -> str | None:
    """Why the CPU update library cannot be used in this process, or None when it built, loaded
    and passed :func:`self_check` (decided once per process)."""
    with _lock:
        if not _state:
            try:
                lib = load(native_build.tuned_or_not(build, log))
                why = self_check(lib)
            except Exception as e:  # noqa: BLE001 - build, load or check failure: any of them means "not usable"
                lib, why = None, f"{type(e).__name__}: {first_line(e)}"
            _state.update({"lib": lib, "why": why} if why is None else {"why": why})
    return _state["why"]  # type: ignore[return-value]


def reset() -> None:
    """Forget the loaded library and the self-check verdict (tests)."""
    with _lock:
        _state.clear()


def _ptr(t: torch.Tensor | None, offset: int = 0) -> int | None:
    return None if t is None else t.data_ptr() + offset * t.element_size()


def _ranges(n: int) -> list[tuple[int, int]]:
    """[start, stop) per thread: torch's intra-op thread count, at least MIN_ELEMS_PER_THREAD each."""
    parts = max(1, min(torch.get_num_threads(), n // MIN_ELEMS_PER_THREAD))
    step = -(-n // parts // RANGE_ALIGN) * RANGE_ALIGN
    return [(s, min(n, s + step)) for s in range(0, n, step)]


def update(a: UpdateArgs, *, lib: ctypes.CDLL | None = None) -> None:
    """Apply ``a``'s rule in one pass per thread; the reference's bits (:func:`dptrain.kernels.reference`).

    ``lib`` defaults to the library :func:`unusable` loaded (it must have been found usable).
    Runs on the calling thread, or for a large update split over torch's intra-op thread
    count of threads (ctypes releases the GIL); reads ``found_inf`` and ``grad_coef`` in memory.
    On a skipped step only the gradient is zeroed, as on the GPU.
    """
    lib = lib or _state["lib"]  # type: ignore[assignment]
    rule = rule_of(a)
    check_update_args(a, rule)
    n = a.numel
    if n == 0:
        return
    *floats, decay_mode = rule.scalars(a.hyper)
    scalars = np.asarray(floats, dtype=np.float32)  # the fp32 scalars in update.cu's struct order
    params = None if a.params.data_ptr() == a.master.data_ptr() else a.params  # fp32: written once, as the master
    s1 = a.state[1] if len(a.state) > 1 else None

    def run(start: int, stop: int) -> int:
        return lib.dptrain_cpu_update(
            RULE_CODES[rule.name], DTYPE_CODES[a.grads.dtype], DTYPE_CODES[a.state[0].dtype], _ptr(a.grads, start),
            _ptr(a.master, start), _ptr(params, start), _ptr(a.state[0], start), _ptr(s1, start),
            _ptr(a.lr_scale, start), _ptr(a.decay_scale, start), _ptr(a.grad_coef), _ptr(a.found_inf),
            _ptr(a.bias_correction), scalars.ctypes.data, len(scalars), int(decay_mode), stop - start)

    ranges = _ranges(n)
    if len(ranges) == 1:
        codes = [run(0, n)]
    else:  # a pool per call (tens of microseconds against a millisecond or more per range): none outlives it
        with ThreadPoolExecutor(max_workers=len(ranges) - 1, thread_name_prefix="dptrain-update") as pool:
            rest = [pool.submit(run, *r) for r in ranges[1:]]
            codes = [run(*ranges[0]), *(f.result() for f in rest)]
    if any(codes):
        raise RuntimeError(f"dptrain_cpu_update refused rule {rule.name} with storage {a.grads.dtype}, state "
                           f"{a.state[0].dtype} and {len(scalars)} scalars (a combination update.cu does not define, "
                           f"or spec.py's scalars and update.cu's struct disagree)")
