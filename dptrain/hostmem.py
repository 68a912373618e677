"""The solver process's host allocator: keep freed memory for the next step instead of giving it back.

A CPU training step allocates and frees its activations and gradients, a few MiB each, every
iteration. glibc's malloc serves a request above ``M_MMAP_THRESHOLD`` with its own ``mmap`` and
unmaps it on free, and hands the top of the heap back to the kernel once more than
``M_TRIM_THRESHOLD`` of it is free; either way the next step faults the same pages in again, and
the kernel zeroes each one. Both thresholds move with the allocation pattern (glibc raises them
as large blocks are freed), so whether a run pays this depends on the order its tensors happen
to be freed in: with glibc's defaults the page faults per step swing from run to run. With the
settings below a step faults few pages in, run after run, spends less system time and trains faster
(measurements: docs/measurements.md#host-memory). PyTorch's CPU performance
guide recommends an allocator that reuses memory (jemalloc, TCMalloc) for the same reason; these
two ``mallopt`` calls get the effect from the C library already loaded, with nothing to install.

``keep_freed_memory`` sets both thresholds once at startup: requests up to 32 MiB (glibc's ceiling
on 64-bit) come from the heap, and up to 1 GiB of free heap stays in the process. Memory freed
stays mapped: the resident size stays at the run's peak, as with torch's CUDA caching allocator.
It leaves the allocator alone where a user chose one: another allocator preloaded or linked in
(this process's ``malloc`` is not the C library's), or glibc malloc settings in the environment
(``MALLOC_*_``, ``GLIBC_TUNABLES``).
"""
from __future__ import annotations

import ctypes
import logging
import os
import sys
from collections.abc import Callable
from typing import Any, Literal

log = logging.getLogger(__name__)

M_TRIM_THRESHOLD = -1
M_MMAP_THRESHOLD = -3
"""mallopt parameter numbers (glibc's malloc.h)."""

MMAP_THRESHOLD_BYTES = 32 << 20
"""Requests up to this size come from the heap (glibc's DEFAULT_MMAP_THRESHOLD_MAX on 64-bit:
a larger value is refused); larger ones keep their own mapping."""

TRIM_THRESHOLD_BYTES = 1 << 30
"""Free memory at the top of the heap that stays in the process."""

_USER_SETTINGS = ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_", "MALLOC_TOP_PAD_", "MALLOC_MMAP_MAX_",
                  "MALLOC_ARENA_MAX")
"""glibc's malloc environment variables: a user who set one chose the allocator's behaviour."""


def users_choice(env: dict[str, str]) -> str | None:
    """The setting in ``env`` by which the user tuned glibc's malloc, or None."""
    for key in _USER_SETTINGS:
        if key in env:
            return f"{key}={env[key]}"
    if "glibc.malloc." in env.get("GLIBC_TUNABLES", ""):
        return f"GLIBC_TUNABLES={env['GLIBC_TUNABLES']}"
    return None


def _address(fn: Any) -> int | None:
    """The address a ctypes function resolves to."""
    return ctypes.cast(fn, ctypes.c_void_p).value


def keep_freed_memory() -> str | None:
    """Set glibc's mmap and trim thresholds (module docstring); return None when done, else why not."""
    if not sys.platform.startswith("linux"):
        return f"the platform is {sys.platform}, not Linux with glibc"
    chosen = users_choice(dict(os.environ))
    if chosen is not None:
        return f"the environment tunes glibc's malloc ({chosen})"
    process = ctypes.CDLL(None)  # the symbols this process resolves, an LD_PRELOADed allocator's first
    if not hasattr(process, "gnu_get_libc_version"):
        return "the C library is not glibc"
    if _address(process.malloc) != _address(ctypes.CDLL("libc.so.6").malloc):
        return "malloc is not glibc's (another allocator is preloaded or linked in)"
    mallopt = process.mallopt
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    return set_thresholds(mallopt)


def set_thresholds(mallopt: Callable[[int, int], int]) -> str | None:
    """Both mallopt calls; None when glibc took them (it returns 1), else which one it refused."""
    for param, name, value in ((M_MMAP_THRESHOLD, "M_MMAP_THRESHOLD", MMAP_THRESHOLD_BYTES),
                               (M_TRIM_THRESHOLD, "M_TRIM_THRESHOLD", TRIM_THRESHOLD_BYTES)):
        if mallopt(param, value) != 1:
            return f"mallopt({name}, {value}) was refused"
    return None


def apply_host_malloc(setting: Literal["auto", "keep", "system"], device_type: str, rank: int) -> bool:
    """``train.host_malloc``: "keep" applies :func:`keep_freed_memory`, "auto" does on the CPU device
    (where the activations live in host memory), "system" leaves glibc's defaults. Returns whether
    the thresholds are set; a reason they could not be is logged at debug level ("auto") or as a
    warning ("keep")."""
    if setting == "system" or (setting == "auto" and device_type != "cpu"):
        return False
    why = keep_freed_memory()
    if why is not None:
        (log.warning if setting == "keep" else log.debug)(
            "rank %d: train.host_malloc = %r: glibc's malloc settings are left as they are: %s", rank, setting, why)
        return False
    log.debug("rank %d: train.host_malloc = %r: freed host memory up to %d MiB per block stays in the process",
              rank, setting, MMAP_THRESHOLD_BYTES >> 20)
    return True
