"""The activation layout: ``model.channels_last = "auto"`` resolved once, where it was measured faster.

Rule (every zoo model is convolutional; ``true``/``false`` in the config override it):

- CUDA, fp16 or bf16 storage: NHWC. Tensor-core convolutions run NHWC natively; with NCHW
  cuDNN transposes around each convolution (NVIDIA's deep learning performance guide,
  "Tensor layouts in memory"), which is why NVIDIA's ResNet-50 recipes train channels_last.
- CPU, bf16 storage with native bf16 kernels (AVX512-BF16/AMX): NHWC. Measured on a
  native-bf16 2-core VM (an earlier session), 2 gloo solvers, ResNet-18 CIFAR width 32, batch 32
  per solver: 544 images/s NCHW, 582-626 NHWC.
- CPU, fp32: NCHW (``CPU_FP32_CHANNELS_LAST``): measured faster in NHWC, but unsafe there.
- CPU, a storage dtype without native kernels (bf16/fp16 on AVX2): NCHW; that path is a slow
  reference fallback either way and was not measured.
"""
from __future__ import annotations

from typing import Literal

import torch

from dptrain.precision import cpu_native_support

CPU_FP32_CHANNELS_LAST = False
"""fp32 on the CPU stays NCHW although NHWC measured faster on the AVX2-only 2-core VM (oneDNN):
ResNet-18 CIFAR width 32, batch 32, one thread, forward + backward 874 ms NHWC vs 1106 ms NCHW
(plain torch, median of 3 alternated rounds); ``dptrain bench`` 2 solvers 90.1 vs 80.5 images/s
(benchmarks/results/throughput_layout_cpu2_20261125.md). With one thread per process, as every
multi-solver CPU run has, torch 2.13.0+cpu corrupts the heap in the NHWC backward of ResNet-18
CIFAR at width 4 ("double free or corruption", "malloc(): unaligned tcache chunk"; plain torch,
no dptrain code; widths 8-32 ran), so NHWC is not a safe default there; ``channels_last = true``
opts in."""


def resolve_channels_last(setting: bool | Literal["auto"], storage: str, device: torch.device) -> bool:
    """``model.channels_last`` as a bool: the setting itself, or the rule of the module docstring for "auto"."""
    if setting != "auto":
        return bool(setting)
    if device.type == "cuda":
        return storage in ("fp16", "bf16")
    if storage == "fp32":
        return CPU_FP32_CHANNELS_LAST
    return cpu_native_support(storage)
