// ATen glue of the CUDA kernels: device guard and current stream.

#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

#include "batchnorm/local_bn_cuda.h"
#include "batchnorm/local_bn_op.h"

namespace torch_bigbatch::batchnorm {
namespace {

void run_local_bn_cuda(const BnPass& pass, const at::Tensor& input) {
  const c10::cuda::CUDAGuard guard(input.device());
  C10_CUDA_CHECK(launch_local_bn_cuda(pass, c10::cuda::getCurrentCUDAStream().stream()));
}

const BnLaunchers::Register kCuda(c10::DeviceType::CUDA, &run_local_bn_cuda);

}  // namespace
}  // namespace torch_bigbatch::batchnorm
