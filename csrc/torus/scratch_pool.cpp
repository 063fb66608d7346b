#include "torus/scratch_pool.h"

#include <algorithm>

namespace torch_bigbatch::torus {

at::Tensor ScratchPool::take(int64_t bytes) {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    auto fits = std::find_if(free_.begin(), free_.end(),
                             [&](const at::Tensor& buffer) { return buffer.numel() == bytes; });
    if (fits != free_.end()) {
      at::Tensor buffer = std::move(*fits);
      free_.erase(fits);
      return buffer;
    }
  }
  return at::empty({bytes}, at::TensorOptions().dtype(at::kByte));
}

void ScratchPool::give(at::Tensor buffer) {
  if (!buffer.defined()) return;
  std::lock_guard<std::mutex> lock(mutex_);
  if (free_.size() == kMaxKept) free_.erase(free_.begin());
  // take() hands out flat bytes, viewed as any dtype and shape
  free_.push_back(buffer.view(at::kByte).view({-1}));
}

}  // namespace torch_bigbatch::torus
