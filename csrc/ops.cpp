// Every op schema of torch_bigbatch in one place; the kernels register per device next to
// their code (TORCH_LIBRARY_IMPL). Python calls them as torch.ops.torch_bigbatch.<op>.

#include <torch/extension.h>
#include <torch/library.h>

TORCH_LIBRARY(torch_bigbatch, m) {
  // One fused SGD/LARS step over tensors of one device and dtype that may come from several
  // parameter groups: group_of_tensor[i] picks the entry of each per-group list for tensor i.
  // momentum_buffers is empty for groups without momentum; first_step initialises them as
  // torch.optim.SGD does (b = d), and so does a non-zero first_step_pending (a one-element
  // tensor read on the device: every earlier step of these buffers was skipped). grad_scale
  // and found_inf come from torch.amp.GradScaler.
  m.def(
      "sgd_step_(Tensor(a!)[] params, Tensor[] grads, Tensor(b!)[] momentum_buffers, "
      "int[] group_of_tensor, float[] lr, Tensor?[] lr_tensor, float[] momentum, "
      "float[] momentum_scale, float[] dampening, float[] weight_decay, bool[] nesterov, "
      "bool[] maximize, float[] trust_coefficient, float[] trust_eps, bool[] trust_clip, "
      "Tensor? grad_scale, Tensor? found_inf, bool first_step, Tensor? first_step_pending) "
      "-> ()");

  // Local (ghost) BatchNorm, training: the batch is split into groups of group_size samples
  // (a tail of one joins the group before), each normalized by its own statistics. Returns
  // the output, each group's mean and 1/sqrt(var + eps) ([groups, C]), and the averages over
  // groups of the group means and unbiased variances ([C]), which the running statistics move
  // towards; the statistics in float (double for double input). Functional, so that
  // torch.library.register_autograd makes it differentiable (torch_bigbatch/ops.py).
  m.def(
      "local_batch_norm(Tensor input, Tensor? weight, Tensor? bias, int group_size, float eps) "
      "-> (Tensor output, Tensor mean, Tensor invstd, Tensor average_mean, Tensor average_var)");
  // Its gradients: (grad_input, grad_weight, grad_bias), the last two in mean's dtype.
  m.def(
      "local_batch_norm_backward(Tensor grad_output, Tensor input, Tensor? weight, Tensor mean, "
      "Tensor invstd, int group_size) -> (Tensor, Tensor, Tensor)");
}
