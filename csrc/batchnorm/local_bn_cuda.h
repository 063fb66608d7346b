#pragma once
// CUDA launcher of local BatchNorm's passes. Torch-free, so the kernels compile with nvcc alone.

#include <cuda_runtime_api.h>

#include "batchnorm/local_bn.h"

namespace torch_bigbatch::batchnorm {

// Enqueues the four steps of the pass (local_bn.h) on `stream`. Returns the launch error, if any.
cudaError_t launch_local_bn_cuda(const BnPass& pass, cudaStream_t stream);

}  // namespace torch_bigbatch::batchnorm
