"""Model zoo: shapes, parameter counts, channels_last, and the BN-free LeNet."""
from __future__ import annotations

import pytest
import torch
from torch import nn

from dptrain.models import MODELS, build_model

# Reference parameter counts with 1000 classes (torchvision's definitions; GoogLeNet without aux heads).
PARAMS_1000 = {"resnet18": 11_689_512, "resnet34": 21_797_672, "resnet50": 25_557_032,
               "resnet101": 44_549_160, "alexnet": 61_100_840, "googlenet": 6_624_904}


@pytest.mark.parametrize("name,count", sorted(PARAMS_1000.items()))
def test_parameter_counts(name, count):
    assert sum(p.numel() for p in build_model(name, num_classes=1000).parameters()) == count


@pytest.mark.parametrize("name,size", [("lenet", 32), ("resnet18_cifar", 32), ("resnet18", 64),
                                       ("alexnet", 224), ("googlenet", 96)])
@pytest.mark.parametrize("channels_last", [False, True])
def test_forward_shapes(name, size, channels_last):
    torch.manual_seed(0)
    m = build_model(name, num_classes=7, width=8, channels_last=channels_last).eval()
    x = torch.randn(2, 3, size, size)
    if channels_last:
        x = x.to(memory_format=torch.channels_last)
        conv = next(mod for mod in m.modules() if isinstance(mod, nn.Conv2d))
        assert conv.weight.is_contiguous(memory_format=torch.channels_last)
    with torch.no_grad():
        assert m(x).shape == (2, 7)


def test_resnet50_forward_at_224():
    m = build_model("resnet50", num_classes=10).eval()
    with torch.no_grad():
        assert m(torch.randn(1, 3, 224, 224)).shape == (1, 10)


def test_cifar_width_scales_channels():
    small = sum(p.numel() for p in build_model("resnet18_cifar", num_classes=10, width=16).parameters())
    full = sum(p.numel() for p in build_model("resnet18_cifar", num_classes=10, width=64).parameters())
    assert 10 < full / small < 17  # ~16x: conv weights scale with width^2


def test_lenet_has_no_batchnorm():
    assert not any(isinstance(m, nn.modules.batchnorm._BatchNorm) for m in build_model("lenet", num_classes=10).modules())


def test_zero_init_residual():
    m = build_model("resnet18", num_classes=10)
    assert torch.all(m.layer1[0].bn2.weight == 0) and torch.all(m.layer1[0].bn1.weight == 1)


def test_unknown_model_lists_choices():
    with pytest.raises(ValueError, match=r"model.name must be one of \[.*'resnet50'.*\], got 'vgg'"):
        build_model("vgg", num_classes=10)
    assert set(MODELS) >= {"lenet", "resnet18_cifar", "resnet18", "resnet34", "resnet50", "resnet101",
                           "alexnet", "googlenet"}
