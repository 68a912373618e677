"""AlexNet, the one-GPU ("one weird trick", Krizhevsky 2014) variant: no LRN, no BatchNorm.

Conv widths are 64, 192, 384, 256, 256, as in cuda-convnet2's ``layers-imagenet-1gpu.cfg``
and torchvision; the paper's footnote gives 384 for conv4 instead (pytorch/vision#463). With
1000 classes that is 61,100,840 parameters. The classifier is Caffe's order
fc6-relu-dropout-fc7-relu-dropout-fc8 (same parameters as torchvision's dropout-first order).
An adaptive 6x6 average pool before fc6 makes the net accept sizes other than 224.
"""
from __future__ import annotations

import torch
from torch import nn

DROPOUT_P = 0.5
"""Dropout probability on fc6 and fc7 (Krizhevsky et al., 2012, section 4.2)."""


class AlexNet(nn.Module):
    """Five convs (ReLU, three 3x3/2 max-pools), 6x6 pool, three fully connected layers."""

    def __init__(self, num_classes: int = 1000, dropout: float = DROPOUT_P, in_channels: int = 3) -> None:
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(in_channels, 64, 11, stride=4, padding=2), nn.ReLU(inplace=True),  # [B, 64, 55, 55] at 224
            nn.MaxPool2d(3, stride=2),  # [B, 64, 27, 27]
            nn.Conv2d(64, 192, 5, padding=2), nn.ReLU(inplace=True),
            nn.MaxPool2d(3, stride=2),  # [B, 192, 13, 13]
            nn.Conv2d(192, 384, 3, padding=1), nn.ReLU(inplace=True),
            nn.Conv2d(384, 256, 3, padding=1), nn.ReLU(inplace=True),
            nn.Conv2d(256, 256, 3, padding=1), nn.ReLU(inplace=True),
            nn.MaxPool2d(3, stride=2),  # [B, 256, 6, 6]
        )
        self.pool = nn.AdaptiveAvgPool2d((6, 6))  # identity at 224 input; fixes fc6's input elsewhere
        self.classifier = nn.Sequential(
            nn.Linear(256 * 6 * 6, 4096), nn.ReLU(inplace=True), nn.Dropout(dropout),
            nn.Linear(4096, 4096), nn.ReLU(inplace=True), nn.Dropout(dropout),
            nn.Linear(4096, num_classes),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.classifier(self.pool(self.features(x)).flatten(1))  # [B, num_classes]


def alexnet(*, num_classes: int = 1000, width: int = 64, in_channels: int = 3) -> AlexNet:
    """One-GPU AlexNet for 224x224 input; ``width`` is ignored (fixed widths)."""
    del width
    return AlexNet(num_classes, in_channels=in_channels)
