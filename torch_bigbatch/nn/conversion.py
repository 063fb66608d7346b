"""Model surgery for large-batch training: local BatchNorm in place of BatchNorm, and Goyal et
al.'s zero-initialized last BatchNorm of each residual block."""

from torch import nn
from torch.nn.modules.batchnorm import _BatchNorm
from torch.nn.utils import parametrize

from .local_batchnorm import (LocalBatchNorm, LocalBatchNorm1d, LocalBatchNorm2d, LocalBatchNorm3d,
                              _checked_group_size)
from .norm_layers import NORM_LAYERS

_LOCAL_OF = ((nn.BatchNorm1d, LocalBatchNorm1d), (nn.BatchNorm2d, LocalBatchNorm2d),
             (nn.BatchNorm3d, LocalBatchNorm3d), (nn.SyncBatchNorm, LocalBatchNorm))


def convert_local_batchnorm(module, group_size=32):
    """Replaces every BatchNorm1d/2d/3d and SyncBatchNorm in `module` by LocalBatchNorm1d/2d/3d
    (LocalBatchNorm for SyncBatchNorm) with `group_size`, and returns the converted module.

    The new layers take over the same weight and bias Parameters and the same buffers (so an
    optimizer built before still holds them), eps, momentum and train/eval mode; like
    nn.SyncBatchNorm.convert_sync_batchnorm, children are replaced in place and a BatchNorm
    given as `module` itself is returned converted. A BatchNorm used in several places becomes
    one LocalBatchNorm used in all of them; a LocalBatchNorm already there takes `group_size`.
    A lazy BatchNorm not yet initialized is refused (run one forward first): left as it is, it
    would become a plain BatchNorm at its first forward; so is one whose weight a
    parametrization or a hook computes. Nothing is converted where one is refused.
    """
    group_size = _checked_group_size(group_size)
    for layer in module.modules():  # all refusals before the first change
        _check_convertible(layer)
    return _converted(module, group_size, {})


def _check_convertible(module):
    """Refuses, by name, a BatchNorm whose weight the copy could not take over."""
    if not isinstance(module, _BatchNorm) or isinstance(module, LocalBatchNorm):
        return
    name = type(module).__name__
    if isinstance(module, nn.modules.lazy.LazyModuleMixin) and module.has_uninitialized_params():
        raise ValueError(f"convert_local_batchnorm: {name} has not seen an input yet; run one "
                         "forward through the model before converting it")
    if parametrize.is_parametrized(module):
        # (its weight is computed: no Parameter to take over; a TypeError was all)
        raise ValueError(f"convert_local_batchnorm: {name} has parametrized "
                         f"{', '.join(module.parametrizations)}; convert it before registering "
                         "the parametrization")
    for attribute in ("weight", "bias"):
        value = getattr(module, attribute)
        if value is not None and not isinstance(value, nn.Parameter):  # spectral_norm's hook
            raise ValueError(f"convert_local_batchnorm: {name}'s {attribute} is a "
                             f"{type(value).__name__}, not a Parameter (a hook computes it); "
                             "convert the model before adding the hook")


def _converted(module, group_size, done):
    """`module` converted; `done` maps the id of every module converted so far to its result."""
    if id(module) in done:
        return done[id(module)]
    if isinstance(module, LocalBatchNorm):
        module.group_size = group_size
        result = module
    else:
        local = next((target for source, target in _LOCAL_OF if isinstance(module, source)),
                     None)
        result = module if local is None else _local_copy(module, local, group_size)
    done[id(module)] = result
    if result is module:
        # _modules, not named_children(): that skips a child listed twice, which would then
        # keep the BatchNorm in its second place
        for name, child in module._modules.items():
            if child is not None:
                module._modules[name] = _converted(child, group_size, done)
    return result


def _local_copy(module, local, group_size):
    converted = local(module.num_features, group_size, module.eps, module.momentum, module.affine,
                      module.track_running_stats, device="meta")
    for name in ("weight", "bias"):
        setattr(converted, name, getattr(module, name))
    for name in ("running_mean", "running_var", "num_batches_tracked"):
        setattr(converted, name, getattr(module, name))
    converted.train(module.training)
    if hasattr(module, "qconfig"):
        converted.qconfig = module.qconfig
    return converted


def zero_init_last_bn(model):
    """Sets gamma = 0 in the last BatchNorm of each residual block, so that every block starts
    as the identity (Goyal et al. 2017, section 5.1), and returns the names of those layers.

    A residual block is a module with a `downsample` attribute, as torchvision's BasicBlock and
    Bottleneck and torch_bigbatch.models' blocks have; its last BatchNorm is the last
    normalization layer (GroupNorm and the others of torch.nn too, as torchvision zeroes its
    blocks' last norm layer whatever it is) among its direct children, outside `downsample`.
    Raises ValueError if the model has no such block.
    """
    zeroed, blocks = [], 0
    for name, block in model.named_modules():
        if not hasattr(block, "downsample"):
            continue
        blocks += 1
        norms = [(child_name, child) for child_name, child in block.named_children()
                 if child_name != "downsample" and isinstance(child, NORM_LAYERS)]
        if norms and getattr(norms[-1][1], "weight", None) is not None:
            child_name, last = norms[-1]
            nn.init.zeros_(last.weight)
            zeroed.append(f"{name}.{child_name}" if name else child_name)
    if blocks == 0:
        raise ValueError("zero_init_last_bn found no residual block (a module with a "
                         "`downsample` attribute) in the model")
    return zeroed
