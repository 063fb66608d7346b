// Reused host buffers for the torus phases. A fresh large allocation is a fresh mmap: its
// page faults and zeroing cost as much as the copies of a loopback allreduce, on every call.
#pragma once

#include <ATen/ATen.h>

#include <vector>

namespace torch_bigbatch::torus {

class ScratchPool {
 public:
  // A tensor of `numel` elements of `like`'s dtype and device, contents undefined.
  at::Tensor take(int64_t numel, const at::Tensor& like);
  // Returns a tensor from take() to the pool.
  void give(at::Tensor tensor);

 private:
  static constexpr size_t kMaxKept = 16;  // the pipeline has few segments in flight
  std::vector<at::Tensor> free_;          // byte buffers
};

}  // namespace torch_bigbatch::torus
