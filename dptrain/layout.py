"""The activation layout: ``model.channels_last = "auto"`` resolved once, where it was measured faster.

Rule (every zoo model is convolutional; ``true``/``false`` in the config override it):

- CUDA, fp16 or bf16 storage: NHWC. Tensor-core convolutions run NHWC natively; with NCHW
  cuDNN transposes around each convolution (NVIDIA's deep learning performance guide,
  "Tensor layouts in memory"), which is why NVIDIA's ResNet-50 recipes train channels_last.
- CPU, bf16 storage with native bf16 kernels (AVX512-BF16/AMX): NHWC. Measured on a
  native-bf16 2-core VM, 2 gloo solvers, ResNet-18 CIFAR width 32, batch 32 per solver:
  544 images/s NCHW, 582-626 NHWC.
- CPU, fp32 (and anything else): NCHW. See ``CPU_FP32_CHANNELS_LAST`` for the measurement.
"""
from __future__ import annotations

from typing import Literal

import torch

from dptrain.precision import cpu_native_support

CPU_FP32_CHANNELS_LAST = False
"""fp32 on the CPU stays NCHW: measured on the AVX2-only 2-core VM (benchmarks/results/
throughput_cpu_cpu2_20261125_layout.md), NHWC was not faster there."""


def resolve_channels_last(setting: bool | Literal["auto"], storage: str, device: torch.device) -> bool:
    """``model.channels_last`` as a bool: the setting itself, or the rule of the module docstring for "auto"."""
    if setting != "auto":
        return bool(setting)
    if device.type == "cuda":
        return storage in ("fp16", "bf16")
    if storage in ("fp16", "bf16"):
        return cpu_native_support(storage)
    return CPU_FP32_CHANNELS_LAST
