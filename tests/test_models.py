"""The ResNets against torchvision's names and shapes (its published parameter counts, and a
key list written from its architecture; torchvision itself too when it is installed)."""

import importlib.util

import numpy as np
import pytest
import torch
from torch import nn

import torch_bigbatch as bb


def torchvision_resnet_shapes(bottleneck, stages):
    """{state-dict key: shape} of torchvision's resnet50 (bottleneck) or resnet18."""
    shapes = {"conv1.weight": (64, 3, 7, 7)}

    def norm(name, channels):
        shapes.update({f"{name}.weight": (channels,), f"{name}.bias": (channels,),
                       f"{name}.running_mean": (channels,), f"{name}.running_var": (channels,),
                       f"{name}.num_batches_tracked": ()})

    norm("bn1", 64)
    in_channels = 64
    for stage, (blocks, width) in enumerate(zip(stages, (64, 128, 256, 512)), start=1):
        out_channels = width * (4 if bottleneck else 1)
        for block in range(blocks):
            prefix = f"layer{stage}.{block}"
            if bottleneck:
                convs = [(width, in_channels, 1, 1), (width, width, 3, 3),
                         (out_channels, width, 1, 1)]
            else:
                convs = [(width, in_channels, 3, 3), (width, width, 3, 3)]
            for index, shape in enumerate(convs, start=1):
                shapes[f"{prefix}.conv{index}.weight"] = shape
                norm(f"{prefix}.bn{index}", shape[0])
            if block == 0 and (stage > 1 or in_channels != out_channels):
                shapes[f"{prefix}.downsample.0.weight"] = (out_channels, in_channels, 1, 1)
                norm(f"{prefix}.downsample.1", out_channels)
            in_channels = out_channels
    shapes.update({"fc.weight": (1000, in_channels), "fc.bias": (1000,)})
    return shapes


def key_shapes(model):
    return {key: tuple(value.shape) for key, value in model.state_dict().items()}


def test_resnet50_matches_torchvision():
    model = bb.models.resnet50()
    assert sum(p.numel() for p in model.parameters()) == 25_557_032  # torchvision's count
    expected = torchvision_resnet_shapes(True, (3, 4, 6, 3))
    assert key_shapes(model) == expected
    assert list(model.state_dict()) == list(expected)  # the same order, too
    if importlib.util.find_spec("torchvision") is not None:
        import torchvision
        assert key_shapes(model) == key_shapes(torchvision.models.resnet50())


def test_resnet18_matches_torchvision():
    model = bb.models.resnet18()
    assert sum(p.numel() for p in model.parameters()) == 11_689_512
    assert key_shapes(model) == torchvision_resnet_shapes(False, (2, 2, 2, 2))


def test_local_batchnorm_and_zero_init():
    model = bb.models.resnet50(bn_group_size=32, zero_init_residual=True)
    norms = [m for m in model.modules() if isinstance(m, nn.modules.batchnorm._BatchNorm)]
    assert len(norms) == 53
    assert all(type(m) is bb.nn.LocalBatchNorm2d and m.group_size == 32 for m in norms)
    zeroed = {name for name, m in model.named_modules()
              if isinstance(m, nn.modules.batchnorm._BatchNorm) and not m.weight.any()}
    assert zeroed == {f"layer{s}.{b}.bn3" for s, n in enumerate((3, 4, 6, 3), 1) for b in range(n)}
    # A state dict of the plain model loads into the local-BN one: the same keys.
    model.load_state_dict(bb.models.resnet50().state_dict())


def test_zero_init_residual_with_group_norm():
    """As torchvision's: each block's last norm layer is zeroed whatever its kind."""
    model = bb.models.ResNet(bb.models.BasicBlock, (2, 1), widths=(8, 16), stem="cifar",
                             norm_layer=lambda channels: nn.GroupNorm(4, channels),
                             zero_init_residual=True)
    zeroed = {name for name, m in model.named_modules()
              if isinstance(m, nn.GroupNorm) and not m.weight.any()}
    assert zeroed == {"layer1.0.bn2", "layer1.1.bn2", "layer2.0.bn2"}


@pytest.mark.parametrize("stages", [(0,), (2, -1), (1.5,)])
def test_stages_of_fewer_than_one_block_are_refused(stages):
    with pytest.raises(ValueError, match="stages must be ints >= 1"):
        bb.models.ResNet(bb.models.BasicBlock, stages, widths=(8,) * len(stages))
    # numpy's integers count, as range() takes them
    assert len(bb.models.ResNet(bb.models.BasicBlock, np.array([2]), widths=(8,)).layer1) == 2


def test_small_resnet_trains_on_fashion_mnist_shapes():
    torch.manual_seed(0)
    model = bb.models.resnet_small(bn_group_size=8)
    x, y = torch.randn(32, 1, 28, 28), torch.randint(0, 10, (32,))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    losses = []
    for _ in range(40):
        loss = nn.functional.cross_entropy(model(x), y)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    assert model(x).shape == (32, 10)
    assert losses[-1] < 0.5 * losses[0]  # fits one batch


@pytest.mark.cuda_build  # needs torchvision
def test_resnet50_loads_torchvisions_weights_and_computes_the_same():
    import torchvision
    torch.manual_seed(0)
    theirs = torchvision.models.resnet50().eval()
    ours = bb.models.resnet50().eval()
    ours.load_state_dict(theirs.state_dict(), strict=True)
    with torch.no_grad():  # trained-looking statistics, so eval-mode BN is not the identity
        for name, buffer in theirs.named_buffers():
            if name.endswith(("running_mean", "running_var")):
                buffer.uniform_(0.5, 1.5)
        ours.load_state_dict(theirs.state_dict(), strict=True)
        x = torch.randn(2, 3, 224, 224)
        torch.testing.assert_close(ours(x), theirs(x), rtol=0, atol=0)
