#include "torus/flat_buffer.h"

#include <algorithm>

namespace torch_bigbatch::torus {

FlatBuffer::FlatBuffer(std::vector<at::Tensor> tensors, int64_t multiple)
    : tensors_(std::move(tensors)), multiple_(multiple) {
  int64_t total = 0;
  for (const auto& tensor : tensors_) total += tensor.numel();
  int64_t padded = (total + multiple - 1) / multiple * multiple;
  if (tensors_.size() == 1 && tensors_[0].is_contiguous() && padded == total) {
    flat = tensors_[0].view(-1);
    return;
  }
  is_copy_ = true;
  flat = at::empty({padded}, tensors_[0].options());
}

void FlatBuffer::copy_in() {
  if (!is_copy_) return;
  int64_t offset = 0;
  for (const auto& tensor : tensors_) {
    flat.narrow(0, offset, tensor.numel()).view(tensor.sizes()).copy_(tensor);
    offset += tensor.numel();
  }
  flat.narrow(0, offset, flat.numel() - offset).zero_();
}

std::vector<std::pair<int64_t, int64_t>> FlatBuffer::segments(int64_t segment_bytes) const {
  int64_t per_segment = std::max<int64_t>(segment_bytes / flat.element_size(), 1);
  per_segment = std::max<int64_t>(per_segment / multiple_, 1) * multiple_;
  std::vector<std::pair<int64_t, int64_t>> result;
  for (int64_t begin = 0; begin < flat.numel(); begin += per_segment)
    result.emplace_back(begin, std::min(per_segment, flat.numel() - begin));
  if (result.empty()) result.emplace_back(0, 0);  // an empty tensor still completes
  return result;
}

void FlatBuffer::copy_out() {
  if (!is_copy_) return;
  int64_t offset = 0;
  for (auto& tensor : tensors_) {
    tensor.copy_(flat.narrow(0, offset, tensor.numel()).view(tensor.sizes()));
    offset += tensor.numel();
  }
}

}  // namespace torch_bigbatch::torus
