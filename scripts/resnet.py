"""ResNet-50 for PyTorch, defined here because torchvision does not install beside the pinned CPU
build of torch (PyPI's torchvision fails to import: ``operator torchvision::nms does not exist``).

The definition is torchvision's ``resnet50()`` (He et al., "Deep Residual Learning for Image
Recognition", CVPR 2016, in its "v1.5" form: the stride of a downsampling bottleneck sits on its 3x3
convolution): the same layers in the same order, the same parameter names and shapes
(``workloads.resnet50_shapes`` lists them; a test compares), and the same initialisation (He-normal
convolutions in fan-out mode, batch-norm scale 1 and shift 0, ``nn.Linear``'s own for the
classifier), so that its forward, backward and gradients are those of the model users train.
"""

from __future__ import annotations

import torch
from torch import nn


class Bottleneck(nn.Module):
    """1x1 reduce, 3x3 (carrying the stride), 1x1 expand by 4, each followed by batch norm; the
    shortcut is a strided 1x1 convolution with batch norm where the shape changes."""

    expansion = 4

    def __init__(self, inplanes: int, width: int, stride: int = 1):
        super().__init__()
        out = width * self.expansion
        self.conv1 = nn.Conv2d(inplanes, width, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(width)
        self.conv2 = nn.Conv2d(width, width, 3, stride=stride, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(width)
        self.conv3 = nn.Conv2d(width, out, 1, bias=False)
        self.bn3 = nn.BatchNorm2d(out)
        self.relu = nn.ReLU(inplace=True)
        self.downsample = None
        if stride != 1 or inplanes != out:
            self.downsample = nn.Sequential(nn.Conv2d(inplanes, out, 1, stride=stride, bias=False),
                                            nn.BatchNorm2d(out))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        identity = x if self.downsample is None else self.downsample(x)
        y = self.relu(self.bn1(self.conv1(x)))
        y = self.relu(self.bn2(self.conv2(y)))
        y = self.bn3(self.conv3(y))
        return self.relu(y + identity)


class ResNet50(nn.Module):
    """Stem (7x7/2 convolution, 3x3/2 max-pool), four stages of 3, 4, 6 and 3 bottlenecks of widths
    64-512, global average pooling and a ``classes``-way classifier: 25,557,032 parameters at 1000."""

    def __init__(self, classes: int = 1000):
        super().__init__()
        self.conv1 = nn.Conv2d(3, 64, 7, stride=2, padding=3, bias=False)
        self.bn1 = nn.BatchNorm2d(64)
        self.relu = nn.ReLU(inplace=True)
        self.maxpool = nn.MaxPool2d(3, stride=2, padding=1)
        inplanes = 64
        for stage, (width, blocks) in enumerate(zip((64, 128, 256, 512), (3, 4, 6, 3)), start=1):
            layers = []
            for block in range(blocks):
                stride = 2 if block == 0 and stage > 1 else 1
                layers.append(Bottleneck(inplanes, width, stride))
                inplanes = width * Bottleneck.expansion
            setattr(self, f"layer{stage}", nn.Sequential(*layers))
        self.avgpool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(inplanes, classes)
        for m in self.modules():
            if isinstance(m, nn.Conv2d):
                nn.init.kaiming_normal_(m.weight, mode="fan_out", nonlinearity="relu")
            elif isinstance(m, nn.BatchNorm2d):
                nn.init.ones_(m.weight)
                nn.init.zeros_(m.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.maxpool(self.relu(self.bn1(self.conv1(x))))
        x = self.layer4(self.layer3(self.layer2(self.layer1(x))))
        return self.fc(torch.flatten(self.avgpool(x), 1))
