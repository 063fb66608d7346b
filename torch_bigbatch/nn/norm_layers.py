"""The normalization layers of torch.nn, for what treats them alike: no weight decay on their
parameters (bb.optim.param_groups), a zero gamma in the last one of a residual block
(zero_init_last_bn)."""

from torch import nn

NORM_LAYERS = (
    nn.modules.batchnorm._NormBase,  # BatchNorm*d, SyncBatchNorm, InstanceNorm*d, LocalBatchNorm
    nn.GroupNorm,
    nn.LayerNorm,
    nn.LocalResponseNorm,
    nn.RMSNorm,
)
