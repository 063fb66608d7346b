"""Python side of the C++ ops (schemas in csrc/ops.cpp): fake kernels, so torch.compile can trace
code that calls them, and the autograd formula that makes local_batch_norm differentiable."""

import torch


@torch.library.register_fake("torch_bigbatch::sgd_step_")
def _sgd_step_fake(params, grads, momentum_buffers, group_of_tensor, lr, lr_tensor, momentum,
                   momentum_scale, dampening, weight_decay, nesterov, maximize,
                   trust_coefficient, trust_eps, trust_clip, grad_scale, found_inf, first_step,
                   first_step_pending):
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
def _local_batch_norm_fake(input, weight, bias, group_size, eps):
    groups = local_batch_norm_groups(input.shape[0], group_size)
    mean = input.new_empty((groups, input.shape[1]), dtype=_statistics_dtype(input))
    average = mean.new_empty((input.shape[1],))
    return (_like_kernel_output(input), mean, torch.empty_like(mean), average,
            torch.empty_like(average))


@torch.library.register_fake("torch_bigbatch::local_batch_norm_backward")
def _local_batch_norm_backward_fake(grad_output, input, weight, mean, invstd, group_size):
    grad_weight = input.new_empty((input.shape[1],), dtype=_statistics_dtype(input))
    return _like_kernel_output(input), grad_weight, torch.empty_like(grad_weight)


def _local_batch_norm_setup_context(ctx, inputs, output):
    input, weight, bias, group_size, _ = inputs
    _, mean, invstd, average_mean, average_var = output
    ctx.save_for_backward(input, weight, mean, invstd)
    ctx.group_size = group_size
    ctx.bias_dtype = None if bias is None else bias.dtype
    ctx.mark_non_differentiable(mean, invstd, average_mean, average_var)


def _local_batch_norm_backward(ctx, grad_output, *_statistics):
    input, weight, mean, invstd = ctx.saved_tensors
    grad_input, grad_weight, grad_bias = torch.ops.torch_bigbatch.local_batch_norm_backward(
        grad_output, input, weight, mean, invstd, ctx.group_size)
    needs_input, needs_weight, needs_bias = ctx.needs_input_grad[:3]
    return (grad_input if needs_input else None,
            grad_weight.to(weight.dtype) if needs_weight else None,
            grad_bias.to(ctx.bias_dtype) if needs_bias else None,
            None, None)


torch.library.register_autograd("torch_bigbatch::local_batch_norm", _local_batch_norm_backward,
                                setup_context=_local_batch_norm_setup_context)


def _no_double_backward(ctx, *grads):
    raise RuntimeError("local_batch_norm supports no double backward (create_graph=True and then "
                       "a gradient of its gradient); use nn.BatchNorm2d for that")


# Without it autograd would pass zeros through the backward op (with a warning), so a gradient
# of the gradient would come out silently wrong; torch's once_differentiable raises instead, as
# this does, when the second backward reaches it.
torch.library.register_autograd("torch_bigbatch::local_batch_norm_backward", _no_double_backward,
                                setup_context=lambda ctx, inputs, output: None)
