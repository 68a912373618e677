"""Model zoo: plain nn.Modules with no distributed, precision or config imports.

Every entry of ``MODELS`` is a builder called as ``builder(num_classes=..., width=...)`` that
returns an fp32 ``nn.Module``; ``width`` matters only for the ``*_cifar`` nets. ``build_model``
adds the channels_last conversion.
"""
from __future__ import annotations

from typing import Protocol

import torch
from torch import nn

from dptrain.models.alexnet import alexnet
from dptrain.models.googlenet import googlenet
from dptrain.models.lenet import lenet
from dptrain.models.resnet import resnet18, resnet18_cifar, resnet34, resnet50, resnet101


class ModelBuilder(Protocol):
    """Signature shared by every zoo entry."""

    def __call__(self, *, num_classes: int, width: int = 64) -> nn.Module: ...


MODELS: dict[str, ModelBuilder] = {
    "lenet": lenet,
    "resnet18_cifar": resnet18_cifar,
    "resnet18": resnet18,
    "resnet34": resnet34,
    "resnet50": resnet50,
    "resnet101": resnet101,
    "alexnet": alexnet,
    "googlenet": googlenet,
}


def build_model(name: str, *, num_classes: int, width: int = 64, channels_last: bool = False) -> nn.Module:
    """Instantiate zoo entry ``name``; raise ValueError listing the choices for an unknown name."""
    if name not in MODELS:
        raise ValueError(f"model.name must be one of {sorted(MODELS)}, got {name!r}")
    model = MODELS[name](num_classes=num_classes, width=width)
    if channels_last:
        model = model.to(memory_format=torch.channels_last)
    return model
