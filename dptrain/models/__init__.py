"""Model zoo: plain nn.Modules with no distributed, precision or config imports.

Every entry of ``MODELS`` is a builder called as ``builder(num_classes=..., width=...,
in_channels=...)`` that returns an fp32 ``nn.Module``; ``width`` matters only for the ``*_cifar``
nets, ``in_channels`` is the samples' (3 for RGB, 1 for grey LMDBs). ``build_model`` adds the
channels_last conversion; :func:`check_input` tries a sample shape on the meta device.
"""
from __future__ import annotations

from typing import Protocol

import torch
from torch import nn

from dptrain.errors import ConfigError
from dptrain.models.alexnet import alexnet
from dptrain.models.googlenet import googlenet
from dptrain.models.lenet import lenet
from dptrain.models.resnet import resnet18, resnet18_cifar, resnet34, resnet50, resnet101


class ModelBuilder(Protocol):
    """Signature shared by every zoo entry."""

    def __call__(self, *, num_classes: int, width: int = 64, in_channels: int = 3) -> nn.Module: ...


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


def build_model(name: str, *, num_classes: int, width: int = 64, in_channels: int = 3,
                channels_last: bool = False) -> nn.Module:
    """Instantiate zoo entry ``name``; raise ValueError listing the choices for an unknown name."""
    if name not in MODELS:
        raise ConfigError(f"model.name must be one of {sorted(MODELS)}, got {name!r}")
    model = MODELS[name](num_classes=num_classes, width=width, in_channels=in_channels)
    if channels_last:
        model = model.to(memory_format=torch.channels_last)
    return model


def check_input(name: str, *, num_classes: int, width: int, sample_shape: tuple[int, int, int]) -> str | None:
    """Why zoo entry ``name`` cannot take [H, W, C] samples (torch's first error line), or None.

    The model is built and run on the meta device: shapes only, no memory and no compute.
    """
    h, w, c = sample_shape
    with torch.device("meta"):
        model = build_model(name, num_classes=num_classes, width=width, in_channels=c)
        try:
            model.eval()(torch.empty((1, c, h, w)))
        except RuntimeError as e:
            return str(e).strip().splitlines()[0]
    return None
