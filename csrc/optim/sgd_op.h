#pragma once
// ATen glue of the op torch_bigbatch::sgd_step_ (schema in csrc/ops.cpp): checks the arguments
// and turns them into an SgdStep of raw pointers, then hands it to a device's kernel.

#include <ATen/ATen.h>

#include "sgd_step.h"

namespace torch_bigbatch::optim {

SgdStep make_sgd_step(at::TensorList params, at::TensorList grads, at::TensorList momentum_buffers,
                      at::IntArrayRef group_of_tensor, at::ArrayRef<double> lr,
                      const c10::List<std::optional<at::Tensor>>& lr_tensor,
                      at::ArrayRef<double> momentum, at::ArrayRef<double> momentum_scale,
                      at::ArrayRef<double> dampening, at::ArrayRef<double> weight_decay,
                      const c10::List<bool>& nesterov, const c10::List<bool>& maximize,
                      at::ArrayRef<double> trust_coefficient, at::ArrayRef<double> trust_eps,
                      const c10::List<bool>& trust_clip, const std::optional<at::Tensor>& grad_scale,
                      const std::optional<at::Tensor>& found_inf, bool first_step,
                      std::vector<at::Tensor>& keep_alive);

// The op's kernel for one device: `Run(step, params)` launches the update.
template <void (*Run)(const SgdStep&, at::TensorList)>
void sgd_step_kernel(at::TensorList params, at::TensorList grads, at::TensorList momentum_buffers,
                     at::IntArrayRef group_of_tensor, at::ArrayRef<double> lr,
                     const c10::List<std::optional<at::Tensor>>& lr_tensor,
                     at::ArrayRef<double> momentum, at::ArrayRef<double> momentum_scale,
                     at::ArrayRef<double> dampening, at::ArrayRef<double> weight_decay,
                     const c10::List<bool>& nesterov, const c10::List<bool>& maximize,
                     at::ArrayRef<double> trust_coefficient, at::ArrayRef<double> trust_eps,
                     const c10::List<bool>& trust_clip, const std::optional<at::Tensor>& grad_scale,
                     const std::optional<at::Tensor>& found_inf, bool first_step) {
  if (params.empty()) return;
  std::vector<at::Tensor> keep_alive;  // copies that the step's raw pointers point into
  Run(make_sgd_step(params, grads, momentum_buffers, group_of_tensor, lr, lr_tensor, momentum,
                    momentum_scale, dampening, weight_decay, nesterov, maximize, trust_coefficient,
                    trust_eps, trust_clip, grad_scale, found_inf, first_step, keep_alive),
      params);
}

}  // namespace torch_bigbatch::optim
