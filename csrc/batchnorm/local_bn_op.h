#pragma once
// ATen glue of the ops torch_bigbatch::local_batch_norm and local_batch_norm_backward (schemas
// in csrc/ops.cpp): local_bn_op.cpp checks the arguments, views the input as [N, C, S] in its
// own memory order, allocates the outputs and scratch, and hands a BnPass to the launcher that
// the input's device registered here (local_bn_cpu.cpp, local_bn_cuda_glue.cpp), with the input,
// whose device the CUDA kernels launch on.

#include <ATen/ATen.h>

#include "batchnorm/local_bn.h"
#include "common/device_launchers.h"

namespace torch_bigbatch::batchnorm {

using BnLaunchers = DeviceLaunchers<void (*)(const BnPass&, const at::Tensor& input)>;

}  // namespace torch_bigbatch::batchnorm
