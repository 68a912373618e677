"""GoogLeNet (Inception v1, Szegedy et al. 2014) with BatchNorm after every convolution.

No auxiliary classifiers. As in common BN re-implementations, the 5x5 branch uses a 3x3
convolution ("5x5" slot) to keep the parameter count of the original design's intent.
"""
from __future__ import annotations

import torch
from torch import nn


def _cbr(cin: int, cout: int, k: int, stride: int = 1) -> nn.Sequential:
    return nn.Sequential(nn.Conv2d(cin, cout, k, stride=stride, padding=k // 2, bias=False),
                         nn.BatchNorm2d(cout, eps=0.001), nn.ReLU(inplace=True))


class Inception(nn.Module):
    def __init__(self, cin: int, c1: int, c3r: int, c3: int, c5r: int, c5: int, pool_proj: int) -> None:
        super().__init__()
        self.b1 = _cbr(cin, c1, 1)
        self.b2 = nn.Sequential(_cbr(cin, c3r, 1), _cbr(c3r, c3, 3))
        self.b3 = nn.Sequential(_cbr(cin, c5r, 1), _cbr(c5r, c5, 3))
        self.b4 = nn.Sequential(nn.MaxPool2d(3, stride=1, padding=1, ceil_mode=True), _cbr(cin, pool_proj, 1))

    def forward(self, x):
        return torch.cat([self.b1(x), self.b2(x), self.b3(x), self.b4(x)], dim=1)


class GoogLeNet(nn.Module):
    def __init__(self, num_classes: int = 1000, dropout: float = 0.2) -> None:
        super().__init__()
        self.stem = nn.Sequential(
            _cbr(3, 64, 7, stride=2), nn.MaxPool2d(3, stride=2, ceil_mode=True),
            _cbr(64, 64, 1), _cbr(64, 192, 3), nn.MaxPool2d(3, stride=2, ceil_mode=True),
        )
        self.inception3 = nn.Sequential(Inception(192, 64, 96, 128, 16, 32, 32),
                                        Inception(256, 128, 128, 192, 32, 96, 64),
                                        nn.MaxPool2d(3, stride=2, ceil_mode=True))
        self.inception4 = nn.Sequential(Inception(480, 192, 96, 208, 16, 48, 64),
                                        Inception(512, 160, 112, 224, 24, 64, 64),
                                        Inception(512, 128, 128, 256, 24, 64, 64),
                                        Inception(512, 112, 144, 288, 32, 64, 64),
                                        Inception(528, 256, 160, 320, 32, 128, 128),
                                        nn.MaxPool2d(2, stride=2, ceil_mode=True))
        self.inception5 = nn.Sequential(Inception(832, 256, 160, 320, 32, 128, 128),
                                        Inception(832, 384, 192, 384, 48, 128, 128))
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.dropout = nn.Dropout(dropout)
        self.fc = nn.Linear(1024, num_classes)

    def forward(self, x):
        x = self.inception5(self.inception4(self.inception3(self.stem(x))))
        return self.fc(self.dropout(self.pool(x).flatten(1)))


def googlenet(*, num_classes: int = 1000, width: int = 64) -> GoogLeNet:
    del width
    return GoogLeNet(num_classes)
