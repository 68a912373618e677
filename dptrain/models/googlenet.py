"""GoogLeNet (Inception v1, Szegedy et al. 2014) with BatchNorm after every convolution.

Follows the paper's Table 1, with BN + ReLU after each conv in place of the two LRN layers
and no auxiliary classifiers. Max-pools round up (``ceil_mode``) as Caffe's do, giving
[B, 832, 7, 7] before the last two Inception modules at 224 input.

The "5x5" branch uses a 5x5 conv by default, as in the paper: 7,005,832 parameters with
1000 classes. torchvision's GoogLeNet has a 3x3 there, a bug ported from TF-slim and kept for
its pretrained weights (pytorch/vision#906); ``branch5_kernel=3`` reproduces that layout and
its 6,624,904 parameters.
"""
from __future__ import annotations

import torch
from torch import nn

DROPOUT_P = 0.4
"""Dropout before the classifier (Szegedy et al., 2014, section 5)."""

# (in, 1x1, 3x3 reduce, 3x3, 5x5 reduce, 5x5, pool proj) per Inception module; paper Table 1.
_STAGE3 = [(192, 64, 96, 128, 16, 32, 32), (256, 128, 128, 192, 32, 96, 64)]
_STAGE4 = [(480, 192, 96, 208, 16, 48, 64), (512, 160, 112, 224, 24, 64, 64), (512, 128, 128, 256, 24, 64, 64),
           (512, 112, 144, 288, 32, 64, 64), (528, 256, 160, 320, 32, 128, 128)]
_STAGE5 = [(832, 256, 160, 320, 32, 128, 128), (832, 384, 192, 384, 48, 128, 128)]


def _conv_bn_relu(cin: int, cout: int, k: int, stride: int = 1) -> nn.Sequential:
    return nn.Sequential(nn.Conv2d(cin, cout, k, stride=stride, padding=k // 2, bias=False),
                         nn.BatchNorm2d(cout), nn.ReLU(inplace=True))


def _max_pool() -> nn.MaxPool2d:
    """3x3/2 max-pool that rounds the output size up, like Caffe's pooling layer."""
    return nn.MaxPool2d(3, stride=2, ceil_mode=True)


class Inception(nn.Module):
    """Four parallel branches (1x1; 1x1->3x3; 1x1->5x5; 3x3 pool->1x1) concatenated on channels."""

    def __init__(self, cin: int, c1: int, c3_reduce: int, c3: int, c5_reduce: int, c5: int, pool_proj: int, *,
                 branch5_kernel: int = 5) -> None:
        super().__init__()
        self.b1 = _conv_bn_relu(cin, c1, 1)
        self.b2 = nn.Sequential(_conv_bn_relu(cin, c3_reduce, 1), _conv_bn_relu(c3_reduce, c3, 3))
        self.b3 = nn.Sequential(_conv_bn_relu(cin, c5_reduce, 1), _conv_bn_relu(c5_reduce, c5, branch5_kernel))
        self.b4 = nn.Sequential(nn.MaxPool2d(3, stride=1, padding=1), _conv_bn_relu(cin, pool_proj, 1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.cat([self.b1(x), self.b2(x), self.b3(x), self.b4(x)], dim=1)  # [B, c1+c3+c5+pool_proj, H, W]


class GoogLeNet(nn.Module):
    """Stem (7x7/2 conv, pool, 1x1, 3x3, pool), Inception 3a-b, 4a-e, 5a-b, avg-pool, dropout, fc."""

    def __init__(self, num_classes: int = 1000, *, branch5_kernel: int = 5, dropout: float = DROPOUT_P,
                 in_channels: int = 3) -> None:
        super().__init__()
        if branch5_kernel not in (3, 5):
            raise ValueError(f"branch5_kernel must be 5 (paper) or 3 (torchvision layout), got {branch5_kernel}")

        def stage(specs: list[tuple[int, ...]]) -> list[nn.Module]:
            return [Inception(*s, branch5_kernel=branch5_kernel) for s in specs]

        self.stem = nn.Sequential(
            _conv_bn_relu(in_channels, 64, 7, stride=2), _max_pool(),  # [B, 64, 56, 56] at 224
            _conv_bn_relu(64, 64, 1), _conv_bn_relu(64, 192, 3), _max_pool(),  # [B, 192, 28, 28]
        )
        self.inception3 = nn.Sequential(*stage(_STAGE3), _max_pool())  # [B, 480, 14, 14]
        self.inception4 = nn.Sequential(*stage(_STAGE4), _max_pool())  # [B, 832, 7, 7]
        self.inception5 = nn.Sequential(*stage(_STAGE5))  # [B, 1024, 7, 7]
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.dropout = nn.Dropout(dropout)
        self.fc = nn.Linear(1024, num_classes)
        for m in self.modules():
            if isinstance(m, nn.Conv2d):
                nn.init.kaiming_normal_(m.weight, mode="fan_out", nonlinearity="relu")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.inception5(self.inception4(self.inception3(self.stem(x))))
        return self.fc(self.dropout(self.pool(x).flatten(1)))  # [B, num_classes]


def googlenet(*, num_classes: int = 1000, width: int = 64, in_channels: int = 3, branch5_kernel: int = 5) -> GoogLeNet:
    """GoogLeNet with BN for 224x224 input; ``width`` is ignored (fixed widths)."""
    del width
    return GoogLeNet(num_classes, branch5_kernel=branch5_kernel, in_channels=in_channels)
