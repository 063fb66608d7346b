// Reused host buffers for the torus phases. A fresh large allocation is a fresh mmap: its
// page faults and zeroing cost as much as the copies of a loopback allreduce, on every call.
// Thread-safe: the phases' callbacks run on the worker threads of several process groups.
#pragma once

#include <ATen/ATen.h>

#include <mutex>
#include <vector>

namespace torch_bigbatch::torus {

class ScratchPool {
 public:
  // A byte tensor of `bytes` bytes on the CPU, contents undefined.
  at::Tensor take(int64_t bytes);
  // Returns a tensor from take(), in any dtype and shape, to the pool (an undefined tensor is
  // ignored).
  void give(at::Tensor buffer);

 private:
  static constexpr size_t kMaxKept = 32;  // a few segments in flight, five buffers each
  std::mutex mutex_;
  std::vector<at::Tensor> free_;
};

}  // namespace torch_bigbatch::torus
