// ATen glue of the CUDA kernels: device guard, current stream, scratch from torch's allocator.

#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

#include "sgd_cuda.h"
#include "sgd_op.h"

namespace torch_bigbatch::optim {
namespace {

void run_sgd_cuda(const SgdStep& step, at::TensorList params) {
  const c10::cuda::CUDAGuard guard(params[0].device());
  // LARS norm partials: freed at return, which the stream-ordered caching allocator makes safe.
  const int64_t scratch_floats = sgd_cuda_scratch_floats(step);
  const at::Tensor scratch =
      scratch_floats > 0 ? at::empty({scratch_floats}, params[0].options().dtype(at::kFloat))
                         : at::Tensor();
  C10_CUDA_CHECK(launch_sgd_cuda(step, scratch.defined() ? scratch.data_ptr<float>() : nullptr,
                                 c10::cuda::getCurrentCUDAStream().stream()));
}

const SgdLaunchers::Register kCuda(c10::DeviceType::CUDA, &run_sgd_cuda);

}  // namespace
}  // namespace torch_bigbatch::optim
