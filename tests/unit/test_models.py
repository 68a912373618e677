"""Model zoo: shapes at native resolution, channels_last, parameter counts, init, import hygiene."""
from __future__ import annotations

import ast
from pathlib import Path

import pytest
import torch
from torch import nn

import dptrain.models
from dptrain.errors import ConfigError
from dptrain.models import MODELS, build_model
from dptrain.models.googlenet import GoogLeNet

# Published counts with 1000 classes (He et al. / torchvision for ResNet v1.5 and one-GPU AlexNet).
PARAMS_1000 = {"resnet18": 11_689_512, "resnet34": 21_797_672, "resnet50": 25_557_032,
               "resnet101": 44_549_160, "alexnet": 61_100_840}
# GoogLeNet with BN, no aux heads: paper's 5x5 branch, and torchvision's 3x3 layout (vision#906).
GOOGLENET_PARAMS_1000 = {5: 7_005_832, 3: 6_624_904}

# Native input side per model; resnet18_cifar runs at width 8 to keep the test fast.
NATIVE_SIZE = {"lenet": 32, "resnet18_cifar": 32, "resnet18": 224, "resnet34": 224, "resnet50": 224,
               "resnet101": 224, "alexnet": 224, "googlenet": 224}


def _n_params(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


def test_every_registered_model_has_a_native_size():
    assert set(MODELS) == set(NATIVE_SIZE)


@pytest.mark.parametrize("name,count", sorted(PARAMS_1000.items()))
def test_parameter_counts(name, count):
    assert _n_params(build_model(name, num_classes=1000)) == count


@pytest.mark.parametrize("kernel,count", sorted(GOOGLENET_PARAMS_1000.items()))
def test_googlenet_parameter_counts(kernel, count):
    assert _n_params(GoogLeNet(1000, branch5_kernel=kernel)) == count
    if kernel == 5:
        assert _n_params(build_model("googlenet", num_classes=1000)) == count


def test_googlenet_rejects_other_branch_kernels():
    with pytest.raises(ValueError, match=r"branch5_kernel must be 5 \(paper\) or 3 .*got 7"):
        GoogLeNet(10, branch5_kernel=7)


@pytest.mark.parametrize("channels_last", [False, True], ids=["nchw", "nhwc"])
@pytest.mark.parametrize("name", sorted(NATIVE_SIZE))
def test_forward_at_native_size(name, channels_last):
    torch.manual_seed(0)
    model = build_model(name, num_classes=7, width=8, channels_last=channels_last).eval()
    size = NATIVE_SIZE[name]
    x = torch.randn(1, 3, size, size)  # [B, C, H, W]
    if channels_last:
        x = x.to(memory_format=torch.channels_last)
        conv = next(m for m in model.modules() if isinstance(m, nn.Conv2d))
        assert conv.weight.is_contiguous(memory_format=torch.channels_last)
    with torch.no_grad():
        out = model(x)
    assert out.shape == (1, 7) and torch.isfinite(out).all()


def test_cifar_width_scales_channels():
    small = build_model("resnet18_cifar", num_classes=10, width=16)
    full = build_model("resnet18_cifar", num_classes=10, width=64)
    assert small.layer4[0].conv1.out_channels == 128 and full.layer4[0].conv1.out_channels == 512
    assert small.stem[0].kernel_size == (3, 3) and small.stem[0].stride == (1, 1)
    assert not any(isinstance(m, nn.MaxPool2d) for m in full.modules())


def test_imagenet_resnets_ignore_width():
    assert _n_params(build_model("resnet18", num_classes=1000, width=8)) == PARAMS_1000["resnet18"]


def test_resnet50_v15_strides_on_the_3x3():
    block = build_model("resnet50", num_classes=10).layer2[0]
    assert block.conv1.stride == (1, 1) and block.conv2.stride == (2, 2)


def test_zero_init_residual_is_default_and_optional():
    default = MODELS["resnet50"](num_classes=10)
    assert all(torch.all(b.bn3.weight == 0) and torch.all(b.bn1.weight == 1)
               for stage in (default.layer1, default.layer4) for b in stage)
    plain = MODELS["resnet18"](num_classes=10, zero_init_residual=False)
    assert torch.all(plain.layer1[0].bn2.weight == 1)


def test_lenet_has_no_batchnorm():
    model = build_model("lenet", num_classes=10)
    assert not any(isinstance(m, nn.modules.batchnorm._BatchNorm) for m in model.modules())


def test_unknown_model_lists_choices():
    with pytest.raises(ConfigError, match=r"model.name must be one of \[.*'googlenet'.*'resnet50'.*\], got 'vgg'"):
        build_model("vgg", num_classes=10)


def test_models_import_no_distributed_precision_or_config():
    banned = ("torch.distributed", "dptrain.distributed.comm", "dptrain.precision", "dptrain.config", "dptrain.train")
    for path in Path(dptrain.models.__file__).parent.glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                names = [node.module or ""]
            else:
                continue
            assert not any(n.startswith(banned) for n in names), f"{path.name} imports {names}"
