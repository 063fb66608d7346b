"""Local (ghost) BatchNorm: statistics per group of `group_size` samples of the local batch,
never across processes (Goyal et al. 2017, section 5.3; Hoffer et al. 2017).

Training splits the N samples of the batch into consecutive groups of group_size (the last
group takes a tail of one sample, which alone has no variance) and normalizes each group by its
own biased mean and variance; weight and bias are shared. The running statistics move towards
the average over groups of the group means and unbiased variances. Evaluation uses the running
statistics exactly as nn.BatchNorm does. group_size=None normalizes the whole local batch as
one group: plain per-process BatchNorm.

The statistics of every (group, channel) come from one pass of a fused kernel (CPU or CUDA), not
from a Python loop over chunks: the op torch.ops.torch_bigbatch.local_batch_norm, differentiable
through its autograd registration (torch_bigbatch/ops.py). Under torch.compile a batch of equal
groups is normalized by torch ops instead, which the compiler fuses with the layers around it.
"""

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.modules.batchnorm import _BatchNorm

from .._checks import as_index


def _recomputed_in_backward():
    """Whether this forward runs inside a backward pass, as torch.utils.checkpoint's
    recomputation does (reentrant or not) and a step's own forward does not. torch has no public
    test for it; its checkpoint reads the same graph task id. Not while compiling: there the
    compiled graph runs its own forward."""
    return not torch.compiler.is_compiling() and torch._C._current_graph_task_id() != -1


def _checked_group_size(group_size):
    """group_size as an int (or None), or a ValueError."""
    if group_size is None:
        return None
    size = as_index(group_size)  # numpy's integers too
    if size is None or size < 2:
        raise ValueError("group_size must be an integer of at least 2 (a group of one sample has "
                         f"no variance), or None for the whole batch; got {group_size!r}")
    return size


def _refuse_forward_mode():
    """The op has a backward formula only. torch.func.jvp (and jacfwd, hessian) would carry a
    zero tangent through a custom op without a forward-mode one, silently (torch 2.11-2.14);
    torch.autograd.forward_ad already raises."""
    if torch.compiler.is_compiling():
        return
    stack = torch._C._functorch.get_interpreter_stack() or []
    if any(level.key() == torch._C._functorch.TransformType.Jvp for level in stack):
        raise RuntimeError("local batch norm has no forward-mode derivative in training: "
                           "torch.func.jvp, jacfwd and hessian cannot go through it (use "
                           "nn.BatchNorm2d there, or reverse mode: torch.autograd.grad)")


# The input dtypes the op's kernels take.
_KERNEL_DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.float64)


def _equal_groups_by_ops(input, weight, bias, group_size, eps):
    """The training pass of a batch of equal groups in torch ops, for torch.compile: inductor
    fuses them with the convolution and ReLU around them, as it does nn.BatchNorm's own
    decomposition, where the op is a call it cannot fuse (ResNet-50 compiled, bf16, on an H200:
    0.62x nn.BatchNorm2d's images/s with the op). Returns (output, the groups' average mean,
    their average unbiased variance), as the op does."""
    batch, channels = input.shape[:2]
    groups = batch // group_size
    acc = torch.promote_types(input.dtype, torch.float32)
    # (group, sample, channel, the other dims): a view in contiguous and channels-last memory
    x = input.reshape(groups, group_size, channels, -1).to(acc)
    # Centered on each group's first sample's mean (a constant to autograd: the result does
    # not depend on it): inductor's float var_mean of values around 1e6 times their spread
    # came out 8e-2 off, 7e-7 centered (the op centers each sample on its own mean). Not
    # centered where that mean is inf or NaN, as the op: an inf stays the group's mean.
    center = x[:, :1].mean(dim=3, keepdim=True).detach()
    center = torch.where(center.isfinite(), center, 0)
    x = x - center
    variance, offset = torch.var_mean(x, dim=(1, 3), correction=0, keepdim=True)
    scale = torch.rsqrt(variance + eps)
    if weight is not None:
        scale = scale * weight.to(acc).view(1, 1, channels, 1)
    output = (x - offset) * scale
    if bias is not None:
        output = output + bias.to(acc).view(1, 1, channels, 1)
    count = group_size * x.shape[3]
    average_mean = (center + offset).view(groups, channels).mean(0)
    average_var = variance.view(groups, channels).mean(0) * (count / (count - 1))
    return output.to(input.dtype).reshape(input.shape), average_mean, average_var


def local_batch_norm(input, running_mean, running_var, weight=None, bias=None, training=False,
                     momentum=0.1, eps=1e-5, group_size=32):
    """F.batch_norm with per-group statistics in training (see the module docstring)."""
    if not training:
        return F.batch_norm(input, running_mean, running_var, weight, bias, False, momentum, eps)
    _refuse_forward_mode()
    group_size = _checked_group_size(group_size)
    if not eps > 0:  # as F.batch_norm: a group's constant channel would give NaN
        raise ValueError(f"local batch norm eps must be positive during training, but got {eps}")
    if input.dim() < 2:
        raise ValueError(f"local batch norm needs an input of at least 2 dims (N, C, ...), got "
                         f"size {tuple(input.shape)}")
    if (running_mean is None) != (running_var is None):
        raise ValueError("running_mean and running_var must be given together")
    # (before the kernel runs, and under torch.compile, whose ops path would say it less clearly)
    for name, stat in (("running_mean", running_mean), ("running_var", running_var),
                       ("weight", weight), ("bias", bias)):
        if stat is not None and stat.numel() != input.shape[1]:
            raise ValueError(f"{name} should contain {input.shape[1]} elements (one per channel) "
                             f"not {stat.numel()}")
    if input.numel() > 0 and input.numel() // input.shape[1] < 2:  # nn.BatchNorm's rule
        raise ValueError("Expected more than 1 value per channel when training, got input size "
                         f"{tuple(input.shape)}")
    size = max(2, input.shape[0]) if group_size is None else group_size
    # (other dtypes go to the op, which refuses them by name)
    if (torch.compiler.is_compiling() and input.dtype in _KERNEL_DTYPES and input.numel() > 0
            and input.shape[0] % size == 0):
        output, average_mean, average_var = _equal_groups_by_ops(input, weight, bias, size, eps)
    else:
        output, _, _, average_mean, average_var = torch.ops.torch_bigbatch.local_batch_norm(
            input, weight, bias, size, eps)
    if running_mean is not None and input.numel() > 0:
        with torch.no_grad():
            torch._foreach_lerp_([running_mean, running_var],
                                 [average_mean.to(running_mean.dtype),
                                  average_var.to(running_var.dtype)], momentum)
    return output


class LocalBatchNorm(_BatchNorm):
    """nn.BatchNorm whose training statistics are those of groups of `group_size` samples.

    Any input of 2 or more dims (N, C, ...), in contiguous or channels-last memory; fp32, fp16,
    bf16 or fp64 with fp32 statistics (fp64 for fp64). Parameters, buffers and state-dict keys
    are nn.BatchNorm's, so its checkpoints load unchanged. Without running statistics
    (track_running_stats=False) evaluation normalizes by the batch's statistics, as
    nn.BatchNorm does, and per group, as training does. This class stands in for
    nn.SyncBatchNorm; LocalBatchNorm1d/2d/3d check the number of dims as nn.BatchNorm1d/2d/3d do.
    """

    def __init__(self, num_features, group_size=32, eps=1e-5, momentum=0.1, affine=True,
                 track_running_stats=True, device=None, dtype=None, **batchnorm_options):
        """batchnorm_options: the keyword options of this torch's nn.BatchNorm (bias=False
        from torch 2.13), passed on."""
        group_size = _checked_group_size(group_size)
        super().__init__(num_features, eps, momentum, affine, track_running_stats, device, dtype,
                         **batchnorm_options)
        self.group_size = group_size

    def _check_input_dim(self, input):
        if input.dim() < 2:
            raise ValueError(f"expected at least 2D input (got {input.dim()}D input)")

    def extra_repr(self):
        return f"{super().extra_repr()}, group_size={self.group_size}"

    def forward(self, input):
        self._check_input_dim(input)
        if input.shape[1] != self.num_features:
            raise ValueError(f"{type(self).__name__}({self.num_features}) got an input with "
                             f"{input.shape[1]} channels (size {tuple(input.shape)})")
        # nn.BatchNorm's choices of statistics and momentum, unchanged, but for checkpointing:
        # a recomputation of the step's forward in its backward (torch.utils.checkpoint)
        # normalizes as the forward did and neither moves the running statistics nor counts
        # the batch again (nn.BatchNorm does both twice).
        recomputed = self.training and self.track_running_stats and _recomputed_in_backward()
        factor = 0.0 if self.momentum is None else self.momentum
        counted = (self.training and self.track_running_stats
                   and self.num_batches_tracked is not None and not recomputed)
        if counted and self.momentum is None:
            factor = 1.0 / (float(self.num_batches_tracked) + 1.0)
        use_batch_statistics = self.training or (self.running_mean is None
                                                 and self.running_var is None)
        keep_running = (not self.training or self.track_running_stats) and not recomputed
        output = local_batch_norm(input, self.running_mean if keep_running else None,
                                  self.running_var if keep_running else None, self.weight,
                                  self.bias, use_batch_statistics, factor, self.eps,
                                  self.group_size)
        if counted:
            self.num_batches_tracked.add_(1)
        return output


class LocalBatchNorm1d(LocalBatchNorm):
    """LocalBatchNorm for (N, C) or (N, C, L) input, like nn.BatchNorm1d."""

    _check_input_dim = nn.BatchNorm1d._check_input_dim


class LocalBatchNorm2d(LocalBatchNorm):
    """LocalBatchNorm for (N, C, H, W) input, like nn.BatchNorm2d."""

    _check_input_dim = nn.BatchNorm2d._check_input_dim


class LocalBatchNorm3d(LocalBatchNorm):
    """LocalBatchNorm for (N, C, D, H, W) input, like nn.BatchNorm3d."""

    _check_input_dim = nn.BatchNorm3d._check_input_dim
