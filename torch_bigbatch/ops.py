"""Python side of the C++ ops: fake kernels, so torch.compile can trace a step that calls them."""

import torch


@torch.library.register_fake("torch_bigbatch::sgd_step_")
def _sgd_step_fake(params, grads, momentum_buffers, group_of_tensor, lr, lr_tensor, momentum,
                   momentum_scale, dampening, weight_decay, nesterov, maximize,
                   trust_coefficient, trust_eps, trust_clip, grad_scale, found_inf, first_step):
    return None  # updates params and momentum_buffers in place; no output
