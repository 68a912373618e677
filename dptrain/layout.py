"""The activation layout: ``model.channels_last = "auto"`` resolved once, where it was measured faster.

Rule (every zoo model is convolutional; ``true``/``false`` in the config override it):

- CUDA, fp16 or bf16 storage: NHWC. Tensor-core convolutions run NHWC natively; with NCHW
  cuDNN transposes around each convolution (NVIDIA's deep learning performance guide,
  "Tensor layouts in memory"), which is why NVIDIA's ResNet-50 recipes train channels_last.
- CPU, bf16 storage with native bf16 kernels (AVX512-BF16/AMX): NHWC. Measured on
  native-bf16 2-core VMs, 2 gloo solvers, ResNet-18 CIFAR width 32, batch 32 per solver: 544
  images/s NCHW, 582-626 NHWC (an earlier session); 385.5 NCHW, 463.9 NHWC (medians of 8
  alternated rounds, benchmarks/results/throughput_layout_cpu2_20261125_layout_bf16_final.md).
- CPU, fp32: NHWC (``CPU_FP32_CHANNELS_LAST``), measured faster, except for a model with a
  convolution torch's CPU NHWC backward breaks on (:func:`cpu_nhwc_hazards`): then NCHW.
- CPU, a storage dtype without native kernels (bf16/fp16 on AVX2): NCHW; that path is a slow
  reference fallback either way and was not measured.
"""
from __future__ import annotations

import logging
from typing import Literal

import torch
from torch import nn

from dptrain.precision import cpu_native_support

log = logging.getLogger(__name__)

CPU_FP32_CHANNELS_LAST = True
"""fp32 on the CPU runs NHWC: faster on the AVX2-only 2-core VM (oneDNN). ResNet-18 CIFAR width 32,
batch 32, one thread, forward + backward 874 ms NHWC vs 1106 ms NCHW (plain torch, median of 3
alternated rounds); ``dptrain bench`` 2 solvers 137.4 vs 104.6 images/s, median of 5 alternated
rounds (benchmarks/results/throughput_layout_cpu2_20261125_layout_fp32.md). Forward + backward,
plain torch, one thread, median of 3 alternated rounds, NCHW vs NHWC: LeNet batch 32 at 32x32
25.1 vs 17.8 ms; ResNet-18 CIFAR width 32 480 vs 415 ms, width 8 64.9 vs 50.8 ms; GoogLeNet
batch 8 at 64x64 181 vs 135 ms; AlexNet batch 8 at 64x64 301 vs 300 ms. Models with a
:func:`cpu_nhwc_hazards` convolution stay NCHW."""

HAZARD_MIN_IN_CHANNELS = 8
"""torch 2.13.0+cpu corrupts the heap ("double free or corruption", segfaults; with 2 threads it
spins forever) in the NHWC backward of a 1x1 convolution with stride > 1 and fewer than 8 input
channels: 2 to 7 input channels crashed at strides 2 and 4, in plain torch with no dptrain code,
with 1 and 2 threads; 8 to 64 input channels at strides 2 to 4 and 3x3 convolutions with 1 to 7
input channels ran (a sweep on the AVX2 VM, 2 runs per case). It is the projection shortcut of a
ResNet narrower than 8 (``model.width`` < 8)."""


def cpu_nhwc_hazards(model: nn.Module) -> list[str]:
    """The convolutions of ``model`` that torch's CPU NHWC backward breaks on (``HAZARD_MIN_IN_CHANNELS``)."""
    return [name for name, m in model.named_modules()
            if isinstance(m, nn.Conv2d) and tuple(m.kernel_size) == (1, 1) and max(m.stride) > 1
            and m.in_channels < HAZARD_MIN_IN_CHANNELS]


def resolve_channels_last(setting: bool | Literal["auto"], storage: str, device: torch.device,
                          hazards: list[str] | None = None) -> bool:
    """``model.channels_last`` as a bool: the setting itself, or the rule of the module docstring for
    "auto". ``hazards``: the model's :func:`cpu_nhwc_hazards` (CPU only)."""
    hazards = hazards if device.type == "cpu" else None
    if setting != "auto":
        if setting and hazards:
            log.warning("model.channels_last = true on the CPU: %s is known to corrupt the heap; set "
                        "model.channels_last = \"auto\" or false if the run crashes", _hazard(hazards))
        return bool(setting)
    if device.type == "cuda":
        return storage in ("fp16", "bf16")
    nhwc = CPU_FP32_CHANNELS_LAST if storage == "fp32" else cpu_native_support(storage)
    if nhwc and hazards:
        log.info("model.channels_last = auto: NCHW, because %s corrupts the heap", _hazard(hazards))
        return False
    return nhwc


def _hazard(hazards: list[str]) -> str:
    return (f"torch's CPU NHWC backward of {hazards[0]} (a 1x1 convolution with stride > 1 and fewer than "
            f"{HAZARD_MIN_IN_CHANNELS} input channels)")
