"""Caffe's MNIST LeNet (no BatchNorm), for 32x32 inputs with 3 channels."""
from __future__ import annotations

from torch import nn


class LeNet(nn.Module):
    """conv5(20) -> maxpool2 -> conv5(50) -> maxpool2 -> fc500 -> relu -> fc(num_classes).

    Caffe's lenet_train_test.prototxt, adapted from 28x28x1 to 32x32xC input. No BatchNorm,
    so data-parallel equivalence tests can compare weights across world sizes exactly.
    """

    def __init__(self, num_classes: int = 10, in_channels: int = 3) -> None:
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(in_channels, 20, 5),  # [B, 20, 28, 28]
            nn.MaxPool2d(2),  # [B, 20, 14, 14]
            nn.Conv2d(20, 50, 5),  # [B, 50, 10, 10]
            nn.MaxPool2d(2),  # [B, 50, 5, 5]
        )
        self.classifier = nn.Sequential(
            nn.Flatten(),
            nn.Linear(50 * 5 * 5, 500),
            nn.ReLU(inplace=True),
            nn.Linear(500, num_classes),
        )

    def forward(self, x):
        return self.classifier(self.features(x))


def lenet(*, num_classes: int = 10, width: int = 64, in_channels: int = 3) -> LeNet:
    """LeNet; ``width`` is ignored (fixed Caffe widths)."""
    del width
    return LeNet(num_classes, in_channels)
