"""Python side of the C++ ops: fake kernels, so torch.compile can trace code that calls them."""

import torch


@torch.library.register_fake("torch_bigbatch::sgd_step_")
def _sgd_step_fake(params, grads, momentum_buffers, group_of_tensor, lr, lr_tensor, momentum,
                   momentum_scale, dampening, weight_decay, nesterov, maximize,
                   trust_coefficient, trust_eps, trust_clip, grad_scale, found_inf, first_step):
    return None  # updates params and momentum_buffers in place; no output


def local_batch_norm_groups(batch, group_size):
    """The number of groups local_batch_norm splits `batch` samples into: groups of group_size,
    with a tail of one sample joining the group before it (csrc/batchnorm/local_bn.h)."""
    return max(1, batch // group_size + (batch % group_size >= 2))


def _like_kernel_output(input):
    """The kernels keep an input laid out [N, C, ...] or channels-last and copy any other."""
    if input.is_contiguous() or input.movedim(1, -1).is_contiguous():
        return torch.empty_like(input)
    return torch.empty_like(input, memory_format=torch.contiguous_format)


def _statistics_dtype(input):
    return torch.float64 if input.dtype == torch.float64 else torch.float32


@torch.library.register_fake("torch_bigbatch::local_batch_norm")
def _local_batch_norm_fake(input, weight, bias, running_mean, running_var, group_size, momentum,
                           eps):
    groups = local_batch_norm_groups(input.shape[0], group_size)
    mean = input.new_empty((groups, input.shape[1]), dtype=_statistics_dtype(input))
    return _like_kernel_output(input), mean, torch.empty_like(mean)


@torch.library.register_fake("torch_bigbatch::local_batch_norm_backward")
def _local_batch_norm_backward_fake(grad_output, input, weight, mean, invstd, group_size):
    grad_weight = input.new_empty((input.shape[1],), dtype=_statistics_dtype(input))
    return _like_kernel_output(input), grad_weight, torch.empty_like(grad_weight)
