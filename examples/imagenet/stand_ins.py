"""What main_original.py and main_phalanx.py take from torchvision, which is not installed here (and
nothing is downloaded): ``models.resnet18``, a small ResNet of the same shape (a strided stem, basic
residual blocks with BatchNorm, global average pooling, a linear head) narrow enough for CPU tests;
``datasets.FakeData``, torchvision's fake images, each drawn from a generator seeded with its index
so every process and every run sees the same ones; ``transforms.ToTensor``, which they already are.
Only ``--dummy`` runs: the ImageFolder path needs torchvision."""

from __future__ import annotations

from types import SimpleNamespace

import torch
from torch import nn
from torch.utils.data import Dataset


class BasicBlock(nn.Module):
    def __init__(self, inplanes: int, planes: int, stride: int = 1):
        super().__init__()
        self.conv1 = nn.Conv2d(inplanes, planes, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(planes)
        self.conv2 = nn.Conv2d(planes, planes, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(planes)
        self.relu = nn.ReLU(inplace=True)
        self.downsample = None
        if stride != 1 or inplanes != planes:
            self.downsample = nn.Sequential(nn.Conv2d(inplanes, planes, 1, stride, bias=False), nn.BatchNorm2d(planes))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        identity = x if self.downsample is None else self.downsample(x)
        out = self.relu(self.bn1(self.conv1(x)))
        return self.relu(self.bn2(self.conv2(out)) + identity)


class TinyResNet(nn.Module):
    def __init__(self, num_classes: int = 1000, width: int = 8):
        super().__init__()
        # A 16x16 strided stem instead of resnet18's 7x7 and max-pool: 224 pixels become 14 at once.
        self.conv1 = nn.Conv2d(3, width, 16, 16, bias=False)
        self.bn1 = nn.BatchNorm2d(width)
        self.relu = nn.ReLU(inplace=True)
        self.layer1 = BasicBlock(width, width)
        self.layer2 = BasicBlock(width, 2 * width, stride=2)
        self.avgpool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(2 * width, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.layer2(self.layer1(self.relu(self.bn1(self.conv1(x)))))
        return self.fc(torch.flatten(self.avgpool(x), 1))


def resnet18(pretrained: bool = False) -> nn.Module:
    if pretrained:
        raise SystemExit("the stand-in resnet18 has no pretrained weights (nothing is downloaded here)")
    return TinyResNet()


class FakeData(Dataset):
    def __init__(self, size: int, image_size: tuple, num_classes: int, transform=None):
        self.size, self.image_size, self.num_classes, self.transform = size, image_size, num_classes, transform

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, index: int):
        g = torch.Generator().manual_seed(index)
        image = torch.rand(self.image_size, generator=g)
        target = int(torch.randint(self.num_classes, (), generator=g))
        return (self.transform(image) if self.transform else image), target


def _only_dummy(*args, **kwargs):
    raise SystemExit("only --dummy runs here: ImageFolder and its transforms need torchvision")


models = SimpleNamespace(resnet18=resnet18)
datasets = SimpleNamespace(FakeData=FakeData, ImageFolder=_only_dummy)
transforms = SimpleNamespace(
    ToTensor=lambda: lambda image: image,
    Normalize=_only_dummy,
    Compose=_only_dummy,
    RandomResizedCrop=_only_dummy,
    RandomHorizontalFlip=_only_dummy,
    Resize=_only_dummy,
    CenterCrop=_only_dummy,
)
