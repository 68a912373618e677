"""ResNets: ResNet-18/34/50/101 for ImageNet (v1.5: stride on the 3x3 conv) and ResNet-18 for CIFAR."""
from __future__ import annotations

from torch import nn


def _conv3x3(cin: int, cout: int, stride: int = 1) -> nn.Conv2d:
    return nn.Conv2d(cin, cout, 3, stride=stride, padding=1, bias=False)


def _conv1x1(cin: int, cout: int, stride: int = 1) -> nn.Conv2d:
    return nn.Conv2d(cin, cout, 1, stride=stride, bias=False)


class BasicBlock(nn.Module):
    expansion = 1

    def __init__(self, cin: int, width: int, stride: int = 1) -> None:
        super().__init__()
        cout = width * self.expansion
        self.conv1, self.bn1 = _conv3x3(cin, width, stride), nn.BatchNorm2d(width)
        self.conv2, self.bn2 = _conv3x3(width, cout), nn.BatchNorm2d(cout)
        self.relu = nn.ReLU(inplace=True)
        self.downsample = _shortcut(cin, cout, stride)

    def forward(self, x):
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        return self.relu(out + self.downsample(x))

    def last_bn(self) -> nn.BatchNorm2d:
        return self.bn2


class Bottleneck(nn.Module):
    expansion = 4

    def __init__(self, cin: int, width: int, stride: int = 1) -> None:
        super().__init__()
        cout = width * self.expansion
        self.conv1, self.bn1 = _conv1x1(cin, width), nn.BatchNorm2d(width)
        self.conv2, self.bn2 = _conv3x3(width, width, stride), nn.BatchNorm2d(width)  # v1.5: stride here
        self.conv3, self.bn3 = _conv1x1(width, cout), nn.BatchNorm2d(cout)
        self.relu = nn.ReLU(inplace=True)
        self.downsample = _shortcut(cin, cout, stride)

    def forward(self, x):
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.relu(self.bn2(self.conv2(out)))
        out = self.bn3(self.conv3(out))
        return self.relu(out + self.downsample(x))

    def last_bn(self) -> nn.BatchNorm2d:
        return self.bn3


def _shortcut(cin: int, cout: int, stride: int) -> nn.Module:
    if stride == 1 and cin == cout:
        return nn.Identity()
    return nn.Sequential(_conv1x1(cin, cout, stride), nn.BatchNorm2d(cout))


class ResNet(nn.Module):
    """ResNet with an ImageNet stem (7x7/2 conv + 3x3/2 max-pool) or a CIFAR stem (3x3/1 conv).

    ``zero_init_residual`` sets each block's last BatchNorm gamma to 0, so every block starts
    as the identity (Goyal et al., 2017), which helps large-batch training.
    """

    def __init__(self, block: type[BasicBlock] | type[Bottleneck], layers: list[int], *, num_classes: int,
                 width: int = 64, cifar_stem: bool = False, zero_init_residual: bool = True) -> None:
        super().__init__()
        if cifar_stem:
            self.stem = nn.Sequential(_conv3x3(3, width), nn.BatchNorm2d(width), nn.ReLU(inplace=True))
        else:
            self.stem = nn.Sequential(nn.Conv2d(3, width, 7, stride=2, padding=3, bias=False), nn.BatchNorm2d(width),
                                      nn.ReLU(inplace=True), nn.MaxPool2d(3, stride=2, padding=1))
        stages, cin = [], width
        for i, n in enumerate(layers):
            w = width * 2**i
            blocks = []
            for j in range(n):
                blocks.append(block(cin, w, stride=2 if (i > 0 and j == 0) else 1))
                cin = w * block.expansion
            stages.append(nn.Sequential(*blocks))
        self.layer1, self.layer2, self.layer3, self.layer4 = stages
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(cin, num_classes)
        for m in self.modules():
            if isinstance(m, nn.Conv2d):
                nn.init.kaiming_normal_(m.weight, mode="fan_out", nonlinearity="relu")
        if zero_init_residual:
            for m in self.modules():
                if isinstance(m, (BasicBlock, Bottleneck)):
                    nn.init.zeros_(m.last_bn().weight)

    def forward(self, x):
        x = self.stem(x)
        x = self.layer4(self.layer3(self.layer2(self.layer1(x))))
        return self.fc(self.pool(x).flatten(1))


def resnet18_cifar(*, num_classes: int = 10, width: int = 64) -> ResNet:
    """ResNet-18 for 32x32 inputs; ``width`` is the first stage's channel count (64 standard)."""
    return ResNet(BasicBlock, [2, 2, 2, 2], num_classes=num_classes, width=width, cifar_stem=True)


def resnet18(*, num_classes: int = 1000, width: int = 64) -> ResNet:
    del width
    return ResNet(BasicBlock, [2, 2, 2, 2], num_classes=num_classes)


def resnet34(*, num_classes: int = 1000, width: int = 64) -> ResNet:
    del width
    return ResNet(BasicBlock, [3, 4, 6, 3], num_classes=num_classes)


def resnet50(*, num_classes: int = 1000, width: int = 64) -> ResNet:
    del width
    return ResNet(Bottleneck, [3, 4, 6, 3], num_classes=num_classes)


def resnet101(*, num_classes: int = 1000, width: int = 64) -> ResNet:
    del width
    return ResNet(Bottleneck, [3, 4, 23, 3], num_classes=num_classes)
