#pragma once
// CUDA launcher of the fused SGD/LARS step. Torch-free, so the kernels compile with nvcc alone.

#include <cuda_runtime_api.h>

#include "optim/sgd.h"

namespace torch_bigbatch::optim {

// Floats of device scratch that launch_sgd_cuda needs (LARS norm partials), possibly 0.
int64_t sgd_cuda_scratch_floats(const SgdStep& step);

// Enqueues the step on `stream`: one launch for all tensors (two with LARS) unless the step has
// more tensors or groups than one launch's table holds. Returns the launch error, if any.
cudaError_t launch_sgd_cuda(const SgdStep& step, float* scratch, cudaStream_t stream);

}  // namespace torch_bigbatch::optim
