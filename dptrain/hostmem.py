"""The solver process's host allocator: keep freed memory for the next step instead of giving it back.

A CPU training step allocates and frees its activations and gradients, a few MiB each, every
iteration. glibc's malloc serves a request above ``M_MMAP_THRESHOLD`` with its own ``mmap`` and
unmaps it on free, and hands the top of the heap back to the kernel once more than
``M_TRIM_THRESHOLD`` of it is free; either way the next step faults the same pages in again, and
the kernel zeroes each one. Both thresholds move with the allocation pattern (glibc raises them
as large blocks are freed), so whether a run pays this depends on the order its tensors happen
to be freed in. Measured on the native-bf16 2-core VM, 2 gloo solvers, ResNet-18 CIFAR width 32,
batch 32, bf16, 20 steps: 3200-3570 minor page faults and 10-19 ms of system time per step and
solver with glibc's defaults; 0-63 faults and 5-8 ms with the settings below (the peer, DDP +
autocast bf16, had 23-46 faults per step with the defaults). PyTorch's CPU performance guide
recommends an allocator that reuses memory (jemalloc, TCMalloc) for the same reason; these two
``mallopt`` calls get the effect from the C library already loaded, with nothing to install.

``keep_freed_memory`` sets both thresholds once at startup: requests up to 32 MiB (glibc's ceiling
on 64-bit) come from the heap, and up to 1 GiB of free heap stays in the process. Memory freed
stays mapped: the resident size stays at the run's peak, as with torch's CUDA caching allocator.
It leaves the allocator alone where a user chose one: ``LD_PRELOAD`` of another allocator, or
glibc malloc settings in the environment (``MALLOC_*_``, ``GLIBC_TUNABLES``).
"""
from __future__ import annotations

import ctypes
import logging
import os
import sys
from typing import Literal

log = logging.getLogger(__name__)

M_TRIM_THRESHOLD = -1
M_MMAP_THRESHOLD = -3
"""mallopt parameter numbers (glibc's malloc.h)."""

MMAP_THRESHOLD_BYTES = 32 << 20
"""Requests up to this size come from the heap (glibc's DEFAULT_MMAP_THRESHOLD_MAX on 64-bit:
a larger value is refused); larger ones keep their own mapping."""

TRIM_THRESHOLD_BYTES = 1 << 30
"""Free memory at the top of the heap that stays in the process."""

_USER_SETTINGS = ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_", "MALLOC_TOP_PAD_", "MALLOC_ARENA_MAX")


def users_choice(env: dict[str, str]) -> str | None:
    """What in ``env`` says the user chose the allocator or its settings, or None."""
    preload = env.get("LD_PRELOAD", "")
    if any(name in preload for name in ("jemalloc", "tcmalloc", "mimalloc")):
        return f"LD_PRELOAD={preload}"
    for key in _USER_SETTINGS:
        if key in env:
            return f"{key}={env[key]}"
    if "glibc.malloc." in env.get("GLIBC_TUNABLES", ""):
        return f"GLIBC_TUNABLES={env['GLIBC_TUNABLES']}"
    return None


def keep_freed_memory() -> str | None:
    """Set glibc's mmap and trim thresholds (module docstring); return None when done, else why not."""
    if not sys.platform.startswith("linux"):
        return f"the platform is {sys.platform}, not Linux with glibc"
    chosen = users_choice(dict(os.environ))
    if chosen is not None:
        return f"the environment chooses the allocator ({chosen})"
    libc = ctypes.CDLL(None)  # the C library this process already runs on
    if not hasattr(libc, "gnu_get_libc_version"):
        return "the C library is not glibc"
    mallopt = libc.mallopt
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    if not mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD_BYTES):
        return f"mallopt(M_MMAP_THRESHOLD, {MMAP_THRESHOLD_BYTES}) was refused"
    if not mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD_BYTES):
        return f"mallopt(M_TRIM_THRESHOLD, {TRIM_THRESHOLD_BYTES}) was refused"
    return None


def apply_host_malloc(setting: Literal["auto", "keep", "system"], device_type: str) -> bool:
    """``train.host_malloc``: "keep" applies :func:`keep_freed_memory`, "auto" does on the CPU device
    (where the activations live in host memory), "system" leaves glibc's defaults. Returns whether
    the thresholds are set; a reason they could not be is logged at debug level ("auto") or as a
    warning ("keep")."""
    if setting == "system" or (setting == "auto" and device_type != "cpu"):
        return False
    why = keep_freed_memory()
    if why is not None:
        (log.warning if setting == "keep" else log.debug)("train.host_malloc = %r: glibc's malloc settings are "
                                                         "left as they are: %s", setting, why)
        return False
    log.debug("train.host_malloc = %r: freed host memory up to %d MiB per block stays in the process",
              setting, MMAP_THRESHOLD_BYTES >> 20)
    return True
