"""NVRTC through ctypes: dptrain compiles its CUDA sources itself, with exactly its own options.

CuPy's ``RawModule`` appends options of its own (``-ftz=true`` among them, which flushes
fp32 subnormals to zero and breaks the update's bit-exact match with the torch
reference), so dptrain calls NVRTC directly and hands CuPy only the finished cubin. The
same function, :func:`compile_cuda`, runs at first use on a GPU and in the test suite on
a machine with no GPU and no driver (NVRTC needs neither), so what CI compiles is what a
solver compiles.

Where NVRTC and the CUDA headers come from, first found wins:
``DPTRAIN_NVRTC`` / ``DPTRAIN_CUDA_INCLUDE`` (a file / a folder); the pip wheels
``nvidia-cuda-nvrtc`` and ``nvidia-cuda-runtime`` (``nvidia/cu13``, or the CUDA 12 layout
``nvidia/cuda_nvrtc`` and ``nvidia/cuda_runtime``); ``$CUDA_PATH`` and ``/usr/local/cuda``.
"""
from __future__ import annotations

import ctypes
import ctypes.util
import functools
import glob
import importlib.util
import os
from dataclasses import dataclass
from pathlib import Path

NVRTC_ENV = "DPTRAIN_NVRTC"
"""Path of a libnvrtc.so to use instead of searching."""
INCLUDE_ENV = "DPTRAIN_CUDA_INCLUDE"
"""Folder holding cuda_fp16.h and cuda_bf16.h to use instead of searching."""
HEADER = "cuda_fp16.h"


class NvrtcError(RuntimeError):
    """NVRTC is missing, or refused the source (the message carries its log)."""


def _wheel_roots() -> list[Path]:
    """Folders of the ``nvidia`` namespace package that the CUDA pip wheels install into."""
    spec = importlib.util.find_spec("nvidia")
    return [Path(p) for p in (spec.submodule_search_locations or [])] if spec else []


def _toolkit_roots() -> list[Path]:
    roots = [os.environ.get("CUDA_PATH", ""), os.environ.get("CUDA_HOME", ""), "/usr/local/cuda"]
    return [Path(r) for r in roots if r]


def _major(path: str) -> int:
    """The CUDA major version in a ``libnvrtc.so.<major>`` name (0 when it has none)."""
    suffix = Path(path).name.split(".so.")[-1].split(".")[0]
    return int(suffix) if suffix.isdigit() else 0


def _candidates() -> list[str]:
    found: list[str] = []
    for root in _wheel_roots():
        found += glob.glob(str(root / "*" / "lib" / "libnvrtc.so*"))
    for root in _toolkit_roots():
        for sub in ("lib64", "lib"):
            found += glob.glob(str(root / sub / "libnvrtc.so*"))
    return [f for f in found if "builtins" not in f and "alt" not in Path(f).name]


def find_library(cuda_major: int | None = None) -> str:
    """The libnvrtc to load (see the module docstring for the search order).

    With ``cuda_major`` (the CUDA version torch was built for), an NVRTC of that major
    version is preferred, so the cubin suits the driver torch runs on; else the newest.
    """
    if os.environ.get(NVRTC_ENV):
        return os.environ[NVRTC_ENV]
    found = _candidates()
    if found:
        return max(found, key=lambda f: (_major(f) == cuda_major, _major(f), f))
    name = ctypes.util.find_library("nvrtc")
    if name:
        return name
    raise NvrtcError("NVRTC not found: pip install nvidia-cuda-nvrtc (CUDA 13) or nvidia-cuda-nvrtc-cu12, "
                     f"or set {NVRTC_ENV} to a libnvrtc.so")


def find_include(library: str | None = None) -> str:
    """A folder with the CUDA headers the kernels include (cuda_fp16.h, cuda_bf16.h).

    The include folder beside ``library`` comes first, so the headers match the compiler.
    """
    if os.environ.get(INCLUDE_ENV):
        return os.environ[INCLUDE_ENV]
    candidates: list[Path] = []
    if library and os.path.sep in library:
        candidates.append(Path(library).resolve().parent.parent / "include")
    for root in _wheel_roots():
        candidates += [Path(p) for p in sorted(glob.glob(str(root / "*" / "include")), reverse=True)]
    candidates += [root / "include" for root in _toolkit_roots()]
    for c in candidates:
        if (c / HEADER).is_file() and (c / "cuda_bf16.h").is_file():
            return str(c)
    raise NvrtcError("CUDA headers (cuda_fp16.h, cuda_bf16.h) not found: pip install nvidia-cuda-runtime (CUDA 13) "
                     f"or nvidia-cuda-runtime-cu12, set CUDA_PATH to a CUDA toolkit, or set {INCLUDE_ENV}")


@functools.cache
def _lib(path: str) -> ctypes.CDLL:
    try:
        lib = ctypes.CDLL(path)
    except OSError as e:
        raise NvrtcError(f"cannot load NVRTC from {path!r} ({e})") from e
    c_p, c_int, c_size = ctypes.c_void_p, ctypes.c_int, ctypes.c_size_t
    sig = {
        "nvrtcVersion": [ctypes.POINTER(c_int), ctypes.POINTER(c_int)],
        "nvrtcCreateProgram": [ctypes.POINTER(c_p), ctypes.c_char_p, ctypes.c_char_p, c_int, c_p, c_p],
        "nvrtcDestroyProgram": [ctypes.POINTER(c_p)],
        "nvrtcAddNameExpression": [c_p, ctypes.c_char_p],
        "nvrtcCompileProgram": [c_p, c_int, ctypes.POINTER(ctypes.c_char_p)],
        "nvrtcGetProgramLogSize": [c_p, ctypes.POINTER(c_size)],
        "nvrtcGetProgramLog": [c_p, ctypes.c_char_p],
        "nvrtcGetPTXSize": [c_p, ctypes.POINTER(c_size)],
        "nvrtcGetPTX": [c_p, ctypes.c_char_p],
        "nvrtcGetCUBINSize": [c_p, ctypes.POINTER(c_size)],
        "nvrtcGetCUBIN": [c_p, ctypes.c_char_p],
        "nvrtcGetLoweredName": [c_p, ctypes.c_char_p, ctypes.POINTER(ctypes.c_char_p)],
        "nvrtcGetErrorString": [c_int],
    }
    for name, argtypes in sig.items():
        fn = getattr(lib, name)
        fn.argtypes = argtypes
        fn.restype = ctypes.c_char_p if name == "nvrtcGetErrorString" else c_int
    return lib


def version(library: str | None = None) -> tuple[int, int]:
    """NVRTC's (major, minor)."""
    lib = _lib(library or find_library())
    major, minor = ctypes.c_int(), ctypes.c_int()
    _check(lib, lib.nvrtcVersion(ctypes.byref(major), ctypes.byref(minor)), "nvrtcVersion")
    return major.value, minor.value


def _check(lib: ctypes.CDLL, rc: int, what: str, log: str = "") -> None:
    if rc != 0:
        text = lib.nvrtcGetErrorString(rc).decode()
        raise NvrtcError(f"{what} failed: {text}" + (f"\n{log}" if log else ""))


@dataclass(frozen=True)
class Compiled:
    """One NVRTC compilation: the binary, and each name expression's lowered (mangled) name."""

    arch: str
    """e.g. "sm_90" (``binary`` is a cubin) or "compute_90" (``binary`` is PTX text)."""
    binary: bytes
    lowered: dict[str, str]
    log: str
    options: tuple[str, ...]


def compile_cuda(source: str, *, name: str, options: tuple[str, ...], name_expressions: tuple[str, ...],
                 arch: str, library: str | None = None) -> Compiled:
    """Compile ``source`` for ``arch`` with ``options`` (plus ``-arch``) and lower every name expression.

    ``arch`` "sm_XX" yields a cubin for that GPU, "compute_XX" PTX. Raises
    :class:`NvrtcError` with NVRTC's log when the source does not compile or a name
    expression does not lower.
    """
    lib = _lib(library or find_library())
    prog = ctypes.c_void_p()
    _check(lib, lib.nvrtcCreateProgram(ctypes.byref(prog), source.encode(), name.encode(), 0, None, None),
           "nvrtcCreateProgram")
    try:
        for expr in name_expressions:
            _check(lib, lib.nvrtcAddNameExpression(prog, expr.encode()), f"nvrtcAddNameExpression({expr})")
        opts = (*options, f"-arch={arch}")
        argv = (ctypes.c_char_p * len(opts))(*[o.encode() for o in opts])
        rc = lib.nvrtcCompileProgram(prog, len(opts), argv)
        size = ctypes.c_size_t()
        lib.nvrtcGetProgramLogSize(prog, ctypes.byref(size))
        buf = ctypes.create_string_buffer(size.value)
        lib.nvrtcGetProgramLog(prog, buf)
        log = buf.value.decode(errors="replace").strip()
        _check(lib, rc, f"compiling {name} for {arch}", log)
        getsize, get = (lib.nvrtcGetCUBINSize, lib.nvrtcGetCUBIN) if arch.startswith("sm_") else \
            (lib.nvrtcGetPTXSize, lib.nvrtcGetPTX)
        _check(lib, getsize(prog, ctypes.byref(size)), "getting the binary size")
        out = ctypes.create_string_buffer(size.value)
        _check(lib, get(prog, out), "getting the binary")
        lowered = {}
        for expr in name_expressions:
            ptr = ctypes.c_char_p()
            _check(lib, lib.nvrtcGetLoweredName(prog, expr.encode(), ctypes.byref(ptr)),
                   f"lowering name expression {expr}")
            lowered[expr] = ptr.value.decode()
        return Compiled(arch, out.raw, lowered, log, opts)
    finally:
        lib.nvrtcDestroyProgram(ctypes.byref(prog))
