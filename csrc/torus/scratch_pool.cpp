#include "torus/scratch_pool.h"

#include <algorithm>

namespace torch_bigbatch::torus {

at::Tensor ScratchPool::take(int64_t numel, const at::Tensor& like) {
  int64_t bytes = numel * like.element_size();
  auto fits = std::find_if(free_.begin(), free_.end(), [&](const at::Tensor& buffer) {
    return buffer.numel() == bytes && buffer.device() == like.device();
  });
  at::Tensor buffer;
  if (fits != free_.end()) {
    buffer = std::move(*fits);
    free_.erase(fits);
  } else {
    buffer = at::empty({bytes}, like.options().dtype(at::kByte));
  }
  return buffer.view(like.scalar_type());
}

void ScratchPool::give(at::Tensor tensor) {
  if (!tensor.defined()) return;
  if (free_.size() == kMaxKept) free_.erase(free_.begin());
  free_.push_back(tensor.view(at::kByte));
}

}  // namespace torch_bigbatch::torus
