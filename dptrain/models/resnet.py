"""ResNets: ResNet-18/34/50/101 for 224x224 ImageNet input, and ResNet-18 for 32x32 CIFAR input.

The Bottleneck nets are "ResNet v1.5": a down-sampling block strides on its 3x3 conv, not on
the first 1x1 as in He et al. (2015); this costs a little speed and gains ~0.5% top-1 (NVIDIA's
figures for ResNet-50 v1.5 in its Deep Learning Examples). With
1000 classes the parameter counts are 11,689,512 (18), 21,797,672 (34), 25,557,032 (50) and
44,549,160 (101), the widely published numbers.

Convolutions get Kaiming-normal init (fan_out, ReLU gain). ``zero_init_residual`` sets each
block's last BatchNorm gamma to 0, so every block starts as the identity (Goyal et al., 2017,
"Accurate, Large Minibatch SGD"), which helps large-batch training.
"""
from __future__ import annotations

import torch
from torch import nn

IMAGENET_WIDTH = 64
"""Channels of the ImageNet nets' stem and first stage (He et al., 2015, Table 1)."""


def _conv3x3(cin: int, cout: int, stride: int = 1) -> nn.Conv2d:
    return nn.Conv2d(cin, cout, 3, stride=stride, padding=1, bias=False)


def _conv1x1(cin: int, cout: int, stride: int = 1) -> nn.Conv2d:
    return nn.Conv2d(cin, cout, 1, stride=stride, bias=False)


def _shortcut(cin: int, cout: int, stride: int) -> nn.Module:
    """Identity when the shapes match, else a strided 1x1 projection + BN (He et al. option B)."""
    if stride == 1 and cin == cout:
        return nn.Identity()
    return nn.Sequential(_conv1x1(cin, cout, stride), nn.BatchNorm2d(cout))


class BasicBlock(nn.Module):
    """Two 3x3 convs with BN; ``width`` output channels; the first conv carries the stride."""

    expansion = 1

    def __init__(self, cin: int, width: int, stride: int = 1) -> None:
        super().__init__()
        cout = width * self.expansion
        self.conv1, self.bn1 = _conv3x3(cin, width, stride), nn.BatchNorm2d(width)
        self.conv2, self.bn2 = _conv3x3(width, cout), nn.BatchNorm2d(cout)
        self.relu = nn.ReLU(inplace=True)
        self.downsample = _shortcut(cin, cout, stride)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        return self.relu(out + self.downsample(x))

    def last_bn(self) -> nn.BatchNorm2d:
        """The BN on the residual branch's output, which ``zero_init_residual`` zeroes."""
        return self.bn2


class Bottleneck(nn.Module):
    """1x1 reduce -> 3x3 (carries the stride, v1.5) -> 1x1 expand to ``4 * width`` channels."""

    expansion = 4

    def __init__(self, cin: int, width: int, stride: int = 1) -> None:
        super().__init__()
        cout = width * self.expansion
        self.conv1, self.bn1 = _conv1x1(cin, width), nn.BatchNorm2d(width)
        self.conv2, self.bn2 = _conv3x3(width, width, stride), nn.BatchNorm2d(width)
        self.conv3, self.bn3 = _conv1x1(width, cout), nn.BatchNorm2d(cout)
        self.relu = nn.ReLU(inplace=True)
        self.downsample = _shortcut(cin, cout, stride)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.relu(self.bn2(self.conv2(out)))
        out = self.bn3(self.conv3(out))
        return self.relu(out + self.downsample(x))

    def last_bn(self) -> nn.BatchNorm2d:
        """The BN on the residual branch's output, which ``zero_init_residual`` zeroes."""
        return self.bn3


class ResNet(nn.Module):
    """Stem, four stages of residual blocks (channels w, 2w, 4w, 8w), global avg-pool, fc.

    The ImageNet stem is a 7x7/2 conv + 3x3/2 max-pool ([B, w, 56, 56] at 224 input); the CIFAR
    stem is one 3x3/1 conv with no pool ([B, w, 32, 32] at 32 input). Stages 2-4 halve the
    spatial size in their first block.
    """

    def __init__(self, block: type[BasicBlock] | type[Bottleneck], layers: list[int], *, num_classes: int,
                 width: int = IMAGENET_WIDTH, cifar_stem: bool = False, zero_init_residual: bool = True,
                 in_channels: int = 3) -> None:
        super().__init__()
        if cifar_stem:
            self.stem = nn.Sequential(_conv3x3(in_channels, width), nn.BatchNorm2d(width), nn.ReLU(inplace=True))
        else:
            self.stem = nn.Sequential(nn.Conv2d(in_channels, width, 7, stride=2, padding=3, bias=False), nn.BatchNorm2d(width),
                                      nn.ReLU(inplace=True), nn.MaxPool2d(3, stride=2, padding=1))
        stages, cin = [], width
        for i, n_blocks in enumerate(layers):
            stage_width = width * 2**i
            blocks = []
            for j in range(n_blocks):
                blocks.append(block(cin, stage_width, stride=2 if (i > 0 and j == 0) else 1))
                cin = stage_width * block.expansion
            stages.append(nn.Sequential(*blocks))
        self.layer1, self.layer2, self.layer3, self.layer4 = stages
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(cin, num_classes)
        self._init_weights(zero_init_residual)

    def _init_weights(self, zero_init_residual: bool) -> None:
        for m in self.modules():
            if isinstance(m, nn.Conv2d):
                nn.init.kaiming_normal_(m.weight, mode="fan_out", nonlinearity="relu")
            elif zero_init_residual and isinstance(m, (BasicBlock, Bottleneck)):
                nn.init.zeros_(m.last_bn().weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.stem(x)
        x = self.layer4(self.layer3(self.layer2(self.layer1(x))))
        return self.fc(self.pool(x).flatten(1))  # [B, num_classes]


def resnet18_cifar(*, num_classes: int = 10, width: int = 64, in_channels: int = 3,
                   zero_init_residual: bool = True) -> ResNet:
    """ResNet-18 for 32x32 input; ``width`` is the first stage's channel count (64 is the standard net)."""
    return ResNet(BasicBlock, [2, 2, 2, 2], num_classes=num_classes, width=width, cifar_stem=True,
                  zero_init_residual=zero_init_residual, in_channels=in_channels)


def resnet18(*, num_classes: int = 1000, width: int = 64, in_channels: int = 3,
             zero_init_residual: bool = True) -> ResNet:
    """ResNet-18 for 224x224 input; ``width`` is ignored (standard channel counts)."""
    del width
    return ResNet(BasicBlock, [2, 2, 2, 2], num_classes=num_classes, zero_init_residual=zero_init_residual, in_channels=in_channels)


def resnet34(*, num_classes: int = 1000, width: int = 64, in_channels: int = 3,
             zero_init_residual: bool = True) -> ResNet:
    """ResNet-34 for 224x224 input; ``width`` is ignored (standard channel counts)."""
    del width
    return ResNet(BasicBlock, [3, 4, 6, 3], num_classes=num_classes, zero_init_residual=zero_init_residual, in_channels=in_channels)


def resnet50(*, num_classes: int = 1000, width: int = 64, in_channels: int = 3,
             zero_init_residual: bool = True) -> ResNet:
    """ResNet-50 v1.5 for 224x224 input; ``width`` is ignored (standard channel counts)."""
    del width
    return ResNet(Bottleneck, [3, 4, 6, 3], num_classes=num_classes, zero_init_residual=zero_init_residual, in_channels=in_channels)


def resnet101(*, num_classes: int = 1000, width: int = 64, in_channels: int = 3,
              zero_init_residual: bool = True) -> ResNet:
    """ResNet-101 v1.5 for 224x224 input; ``width`` is ignored (standard channel counts)."""
    del width
    return ResNet(Bottleneck, [3, 4, 23, 3], num_classes=num_classes, zero_init_residual=zero_init_residual, in_channels=in_channels)
