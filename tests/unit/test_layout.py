"""dptrain.layout: model.channels_last = "auto" resolves by device and storage; true/false override it."""
from __future__ import annotations

import torch

from dptrain import layout
from dptrain.precision import cpu_native_support

CPU, CUDA = torch.device("cpu"), torch.device("cuda", 0)  # a device object only: nothing runs on it


def test_auto_rule_and_overrides():
    assert layout.resolve_channels_last("auto", "fp16", CUDA) and layout.resolve_channels_last("auto", "bf16", CUDA)
    assert not layout.resolve_channels_last("auto", "fp32", CUDA)
    assert layout.resolve_channels_last("auto", "fp32", CPU) is layout.CPU_FP32_CHANNELS_LAST
    assert layout.resolve_channels_last("auto", "bf16", CPU) is cpu_native_support("bf16")
    for storage in ("fp32", "bf16", "fp16"):
        for device in (CPU, CUDA):
            assert layout.resolve_channels_last(True, storage, device) is True
            assert layout.resolve_channels_last(False, storage, device) is False
