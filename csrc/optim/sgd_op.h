#pragma once
// ATen glue of the op torch_bigbatch::sgd_step_ (schema in csrc/ops.cpp): sgd_op.cpp checks the
// arguments, turns them into an SgdStep of raw pointers and hands it to the launcher that the
// parameters' device registered here (sgd_cpu.cpp, sgd_cuda_glue.cpp).

#include <ATen/ATen.h>

#include "common/device_launchers.h"
#include "optim/sgd.h"

namespace torch_bigbatch::optim {

using SgdLaunchers = DeviceLaunchers<void (*)(const SgdStep&, at::TensorList params)>;

// The op's kernel, for every device (the arguments as csrc/ops.cpp's schema names them).
void sgd_step_(at::TensorList params, at::TensorList grads, at::TensorList momentum_buffers,
               at::IntArrayRef group_of_tensor, at::ArrayRef<double> lr,
               const c10::List<std::optional<at::Tensor>>& lr_tensor, at::ArrayRef<double> momentum,
               at::ArrayRef<double> momentum_scale, at::ArrayRef<double> dampening,
               at::ArrayRef<double> weight_decay, const c10::List<bool>& nesterov,
               const c10::List<bool>& maximize, at::ArrayRef<double> trust_coefficient,
               at::ArrayRef<double> trust_eps, const c10::List<bool>& trust_clip,
               const std::optional<at::Tensor>& grad_scale,
               const std::optional<at::Tensor>& found_inf, bool first_step,
               const std::optional<at::Tensor>& first_step_pending);

}  // namespace torch_bigbatch::optim
