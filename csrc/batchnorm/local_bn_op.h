#pragma once
// ATen glue of the ops torch_bigbatch::local_batch_norm and local_batch_norm_backward (schemas
// in csrc/ops.cpp): checks the arguments, views the input as [N, C, S] in its own memory order,
// allocates the outputs and scratch, and hands a BnPass to a device's `run` (with the input,
// whose device the CUDA kernels launch on).

#include <ATen/ATen.h>

#include <tuple>

#include "batchnorm/local_bn.h"

namespace torch_bigbatch::batchnorm {

using RunPass = void (*)(const BnPass&, const at::Tensor& input);

// (output, mean, invstd); mean and invstd are [groups, C] in float (double for double input).
std::tuple<at::Tensor, at::Tensor, at::Tensor> local_batch_norm_forward(
    const at::Tensor& input, const std::optional<at::Tensor>& weight,
    const std::optional<at::Tensor>& bias, const std::optional<at::Tensor>& running_mean,
    const std::optional<at::Tensor>& running_var, int64_t group_size, double momentum,
    double eps, RunPass run);

// (grad_input, grad_weight, grad_bias); the last two [C] in mean's dtype.
std::tuple<at::Tensor, at::Tensor, at::Tensor> local_batch_norm_backward(
    const at::Tensor& grad_output, const at::Tensor& input, const std::optional<at::Tensor>& weight,
    const at::Tensor& mean, const at::Tensor& invstd, int64_t group_size, RunPass run);

// The ops' kernels for one device.
template <RunPass Run>
std::tuple<at::Tensor, at::Tensor, at::Tensor> local_batch_norm_kernel(
    const at::Tensor& input, const std::optional<at::Tensor>& weight,
    const std::optional<at::Tensor>& bias, const std::optional<at::Tensor>& running_mean,
    const std::optional<at::Tensor>& running_var, int64_t group_size, double momentum,
    double eps) {
  return local_batch_norm_forward(input, weight, bias, running_mean, running_var, group_size,
                                  momentum, eps, Run);
}
template <RunPass Run>
std::tuple<at::Tensor, at::Tensor, at::Tensor> local_batch_norm_backward_kernel(
    const at::Tensor& grad_output, const at::Tensor& input, const std::optional<at::Tensor>& weight,
    const at::Tensor& mean, const at::Tensor& invstd, int64_t group_size) {
  return local_batch_norm_backward(grad_output, input, weight, mean, invstd, group_size, Run);
}

}  // namespace torch_bigbatch::batchnorm
