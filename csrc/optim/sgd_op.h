#pragma once
// ATen glue of the op torch_bigbatch::sgd_step_ (schema in csrc/ops.cpp): sgd_op.cpp checks the
// arguments, turns them into an SgdStep of raw pointers and hands it to the launcher that the
// parameters' device registered here (sgd_cpu.cpp, sgd_cuda_glue.cpp).

#include <ATen/ATen.h>

#include "common/device_launchers.h"
#include "optim/sgd.h"

namespace torch_bigbatch::optim {

using SgdLaunchers = DeviceLaunchers<void (*)(const SgdStep&, at::TensorList params)>;

}  // namespace torch_bigbatch::optim
