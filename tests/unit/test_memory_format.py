"""dptrain.memory_format: model.channels_last = "auto" resolves by device and storage; true/false override it."""
from __future__ import annotations

import torch

from dptrain import memory_format as layout
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


def test_a_model_with_a_convolution_torch_breaks_on_in_nhwc_stays_nchw_on_the_cpu(caplog, tmp_path):
    """torch 2.13's CPU NHWC backward of a 1x1 stride-2 convolution with < 8 input channels corrupts
    the heap: ResNet-18 CIFAR at width 4 has one (its first projection shortcut), width 8 does not."""
    from dptrain.config import load_config
    from dptrain.models import build_model
    from dptrain.train import Trainer

    def nhwc_hazards(name: str, width: int = 64) -> list[str]:
        with torch.device("meta"):
            return layout.cpu_nhwc_hazards(build_model(name, num_classes=10, width=width, in_channels=3))

    narrow = nhwc_hazards("resnet18_cifar", 4)
    assert narrow == ["layer2.0.downsample.0"]
    for name in ("lenet", "alexnet", "googlenet", "resnet50"):
        assert nhwc_hazards(name) == [], name
    assert nhwc_hazards("resnet18_cifar", 8) == []

    caplog.set_level("INFO", logger="dptrain.memory_format")
    assert layout.resolve_channels_last("auto", "fp32", CPU, narrow) is False
    assert layout.resolve_channels_last("auto", "fp16", CUDA, narrow) is True  # CUDA: not this bug
    assert "layer2.0.downsample.0" in caplog.text
    caplog.clear()
    assert layout.resolve_channels_last(True, "fp32", CPU, narrow) is True  # an explicit setting is kept, with a warning
    assert "known to corrupt the heap" in caplog.text and "layer2.0.downsample.0" in caplog.text

    from dptrain.distributed.comm import Communicator
    from dptrain.topology import Topology

    for width, nhwc in ((4, False), (8, layout.CPU_FP32_CHANNELS_LAST)):
        cfg = load_config(None, ["model.name=resnet18_cifar", f"model.width={width}", "data.source=synthetic",
                                 "data.image_size=16", "data.batch_size=2", f"train.run_dir=\"{tmp_path}/w{width}\""])
        t = Trainer(cfg, Communicator.from_env(Topology(), 60, torch.device("cpu")))  # one process
        try:
            assert t.setup.channels_last is nhwc, width
            t.train_step()  # width 4 NHWC would crash here
        finally:
            t.close()
