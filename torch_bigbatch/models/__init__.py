"""ResNets for large-batch training, with torchvision's state-dict keys."""

from .resnet import BasicBlock, Bottleneck, ResNet, resnet18, resnet50, resnet_small

__all__ = ["BasicBlock", "Bottleneck", "ResNet", "resnet18", "resnet50", "resnet_small"]
