"""Parameter groups for large-batch training: no weight decay (and no LARS adaptation) on the
parameters of normalization layers (Goyal et al. 2017, section 5.1: BatchNorm's gamma and beta)
nor on biases (as MLPerf's ResNet-50 LARS reference excludes them, and torchvision's
reference recipes with --bias-weight-decay 0; in ResNet-50 that is the 1,000 values of
fc.bias, which Goyal et al. decay)."""

from torch import nn

from ..nn.norm_layers import NORM_LAYERS


def param_groups(model, weight_decay):
    """Two groups for an optimizer: the weights with `weight_decay`, and the biases plus every
    parameter of a normalization layer with weight_decay 0 and lars_exclude=True. Frozen
    parameters are left out; empty groups are dropped."""
    if not isinstance(model, nn.Module):  # model.parameters() is what torch.optim.SGD takes
        raise TypeError(f"param_groups takes the model (an nn.Module), got "
                        f"{type(model).__name__}")
    decay, no_decay, seen = [], [], set()
    for module in model.modules():
        for name, param in module.named_parameters(recurse=False):
            if not param.requires_grad or id(param) in seen:
                continue
            seen.add(id(param))
            # "bias" as a word of the name: also nn.MultiheadAttention's in_proj_bias and
            # bias_k, and the RNNs' bias_ih_l0.
            if isinstance(module, NORM_LAYERS) or "bias" in name.split("_"):
                no_decay.append(param)
            else:
                decay.append(param)
    groups = [
        {"params": decay, "weight_decay": weight_decay},
        {"params": no_decay, "weight_decay": 0.0, "lars_exclude": True},
    ]
    return [group for group in groups if group["params"]]
