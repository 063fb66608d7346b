"""ResNets with torchvision's module names, so state dicts move between the two: resnet50 and
resnet18 (ImageNet stem), and a small CIFAR-style ResNet for CPU runs. Written here rather than
imported so the package needs no torchvision; the norm layer is a parameter, so
LocalBatchNorm2d goes in without conversion."""

from functools import partial

from torch import nn

from .._checks import as_index
from ..nn import LocalBatchNorm2d, zero_init_last_bn


def conv3x3(in_channels, out_channels, stride=1):
    return nn.Conv2d(in_channels, out_channels, 3, stride=stride, padding=1, bias=False)


def conv1x1(in_channels, out_channels, stride=1):
    return nn.Conv2d(in_channels, out_channels, 1, stride=stride, bias=False)


class BasicBlock(nn.Module):
    """Two 3x3 convolutions and the identity (or a 1x1 projection when the shape changes)."""

    expansion = 1

    def __init__(self, in_channels, width, stride=1, downsample=None, norm_layer=nn.BatchNorm2d):
        super().__init__()
        self.conv1 = conv3x3(in_channels, width, stride)
        self.bn1 = norm_layer(width)
        self.relu = nn.ReLU(inplace=True)
        self.conv2 = conv3x3(width, width)
        self.bn2 = norm_layer(width)
        self.downsample = downsample

    def forward(self, x):
        identity = x if self.downsample is None else self.downsample(x)
        out = self.relu(self.bn1(self.conv1(x)))
        return self.relu(self.bn2(self.conv2(out)) + identity)


class Bottleneck(nn.Module):
    """1x1, 3x3 (strided: ResNet v1.5, as torchvision and Goyal et al.'s Caffe2 model), 1x1."""

    expansion = 4

    def __init__(self, in_channels, width, stride=1, downsample=None, norm_layer=nn.BatchNorm2d):
        super().__init__()
        self.conv1 = conv1x1(in_channels, width)
        self.bn1 = norm_layer(width)
        self.conv2 = conv3x3(width, width, stride)
        self.bn2 = norm_layer(width)
        self.conv3 = conv1x1(width, width * self.expansion)
        self.bn3 = norm_layer(width * self.expansion)
        self.relu = nn.ReLU(inplace=True)
        self.downsample = downsample

    def forward(self, x):
        identity = x if self.downsample is None else self.downsample(x)
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.relu(self.bn2(self.conv2(out)))
        return self.relu(self.bn3(self.conv3(out)) + identity)


class ResNet(nn.Module):
    """stages[i] blocks of widths[i] channels (times the block's expansion), the first stage at
    stride 1 and each later one at stride 2. stem="imagenet": 7x7/2 convolution and 3x3/2 max
    pooling (224x224 input); stem="cifar": one 3x3 convolution (28x28 or 32x32 input)."""

    def __init__(self, block, stages, widths=(64, 128, 256, 512), num_classes=1000,
                 in_channels=3, stem="imagenet", norm_layer=nn.BatchNorm2d,
                 zero_init_residual=False):
        super().__init__()
        if stem not in ("imagenet", "cifar"):
            raise ValueError(f"stem must be 'imagenet' or 'cifar', got {stem!r}")
        if not all((as_index(blocks) or 0) >= 1 for blocks in stages):  # numpy's ints too
            raise ValueError(f"stages must be ints >= 1 (blocks per stage), got {tuple(stages)}")
        if len(stages) != len(widths):
            raise ValueError(f"one width per stage: got {len(stages)} stages, {len(widths)} widths")
        channels = widths[0]
        if stem == "imagenet":
            self.conv1 = nn.Conv2d(in_channels, channels, 7, stride=2, padding=3, bias=False)
        else:
            self.conv1 = conv3x3(in_channels, channels)
        self.bn1 = norm_layer(channels)
        self.relu = nn.ReLU(inplace=True)
        self.maxpool = nn.MaxPool2d(3, stride=2, padding=1) if stem == "imagenet" else nn.Identity()
        for index, (blocks, width) in enumerate(zip(stages, widths)):
            stride = 1 if index == 0 else 2
            out_channels = width * block.expansion
            downsample = None
            if stride != 1 or channels != out_channels:
                downsample = nn.Sequential(conv1x1(channels, out_channels, stride),
                                           norm_layer(out_channels))
            layers = [block(channels, width, stride, downsample, norm_layer)]
            layers += [block(out_channels, width, norm_layer=norm_layer) for _ in range(blocks - 1)]
            self.add_module(f"layer{index + 1}", nn.Sequential(*layers))
            channels = out_channels
        self.stages = len(stages)
        self.avgpool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(channels, num_classes)

        # torchvision's initialization.
        for module in self.modules():
            if isinstance(module, nn.Conv2d):
                nn.init.kaiming_normal_(module.weight, mode="fan_out", nonlinearity="relu")
        if zero_init_residual:
            zero_init_last_bn(self)

    def forward(self, x):
        x = self.maxpool(self.relu(self.bn1(self.conv1(x))))
        for index in range(self.stages):
            x = getattr(self, f"layer{index + 1}")(x)
        return self.fc(self.avgpool(x).flatten(1))


def norm_layer_for(group_size):
    """nn.BatchNorm2d for group_size=0, else LocalBatchNorm2d over groups of group_size
    (None: the whole local batch)."""
    if group_size == 0:
        return nn.BatchNorm2d
    return partial(LocalBatchNorm2d, group_size=group_size)


def resnet50(num_classes=1000, in_channels=3, bn_group_size=0, zero_init_residual=False):
    """ResNet-50 (torchvision's names and shapes; 25,557,032 parameters at 1000 classes)."""
    return ResNet(Bottleneck, (3, 4, 6, 3), num_classes=num_classes, in_channels=in_channels,
                  norm_layer=norm_layer_for(bn_group_size), zero_init_residual=zero_init_residual)


def resnet18(num_classes=1000, in_channels=3, bn_group_size=0, zero_init_residual=False):
    """ResNet-18 (torchvision's names and shapes; 11,689,512 parameters at 1000 classes)."""
    return ResNet(BasicBlock, (2, 2, 2, 2), num_classes=num_classes, in_channels=in_channels,
                  norm_layer=norm_layer_for(bn_group_size), zero_init_residual=zero_init_residual)


def resnet_small(num_classes=10, in_channels=1, bn_group_size=0, zero_init_residual=False,
                 widths=(16, 32, 64), blocks=1):
    """A CIFAR-style ResNet (He et al. 2016, section 4.2: 6 * blocks + 2 layers; blocks=3 has
    ResNet-20's layers, with 1x1 projections where the shape changes, where He et al. pad
    identity shortcuts with zeros) for 28x28 or 32x32 input: quick enough to train on a CPU."""
    return ResNet(BasicBlock, (blocks,) * len(widths), widths=widths, num_classes=num_classes,
                  in_channels=in_channels, stem="cifar", norm_layer=norm_layer_for(bn_group_size),
                  zero_init_residual=zero_init_residual)
