"""The activation memory format (NCHW or NHWC): ``model.channels_last = "auto"`` resolved once, where it was measured faster.

Rule (every zoo model is convolutional; ``true``/``false`` in the config override it):

- CUDA, fp16 or bf16 storage: NHWC. Tensor-core convolutions run NHWC natively; with NCHW
  cuDNN transposes around each convolution (NVIDIA's deep learning performance guide,
  "Tensor layouts in memory"), which is why NVIDIA's ResNet-50 recipes train channels_last.
- CPU, bf16 storage with native bf16 kernels (AVX512-BF16/AMX): NHWC, which trained faster
  data-parallel (measurements: docs/measurements.md#nhwc-with-bf16).
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
"""fp32 on the CPU runs NHWC: oneDNN's fp32 convolutions ran faster NHWC than NCHW in every model
tried (AlexNet about even), alone and in data-parallel ``dptrain bench`` runs
(measurements: docs/measurements.md#nhwc-with-fp32). Models with a
:func:`cpu_nhwc_hazards` convolution stay NCHW."""

HAZARD_MIN_IN_CHANNELS = 8
"""torch 2.13.0+cpu corrupts the heap ("double free or corruption", segfaults; with 2 threads it
spins forever) in the NHWC backward of a 1x1 convolution with stride > 1 and fewer than 8 input
channels, in plain torch with no dptrain code; 1x1 convolutions with 8 input channels or more, and
3x3 convolutions with fewer, ran (the sweep: docs/measurements.md#nhwc-backward-crash).
It is the projection shortcut of a ResNet narrower than 8 (``model.width`` < 8)."""


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
