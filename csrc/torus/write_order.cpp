#include "torus/write_order.h"

#include <algorithm>

namespace torch_bigbatch::torus {

WriteOrder::Span WriteOrder::span_of(const at::Tensor& tensor) {
  const auto begin = reinterpret_cast<uintptr_t>(tensor.storage().data()) +
                     static_cast<uintptr_t>(tensor.storage_offset() * tensor.element_size());
  int64_t last = 0;  // the offset of the last element, in elements (dense strides are >= 0)
  for (int64_t dim = 0; dim < tensor.dim(); ++dim)
    last += (tensor.size(dim) - 1) * tensor.stride(dim);
  return {begin, begin + static_cast<uintptr_t>((last + 1) * tensor.element_size()), {}};
}

void WriteOrder::follow_writes_to(const std::vector<at::Tensor>& tensors,
                                  const c10::Stream& stream) {
  std::lock_guard<std::mutex> lock(mutex_);
  for (const auto& tensor : tensors) {
    if (!tensor.defined() || tensor.numel() == 0) continue;
    if (!tensor.has_storage()) {  // (its memory is not one span)
      follow_device(tensor.device().index(), stream);
      continue;
    }
    auto found = spans_.find(tensor.device().index());
    if (found == spans_.end()) continue;
    const Span wanted = span_of(tensor);
    for (const Span& written : found->second) {
      if (written.begin >= wanted.end || wanted.begin >= written.end) continue;
      if (auto done = written.done.lock()) done->block(stream);
    }
  }
}

void WriteOrder::follow_all(const c10::Stream& stream) {
  std::lock_guard<std::mutex> lock(mutex_);
  for (const auto& [device, last] : last_) follow_device(device, stream);
}

void WriteOrder::follow_device(c10::DeviceIndex device, const c10::Stream& stream) {
  auto found = last_.find(device);
  if (found == last_.end()) return;
  if (auto done = found->second.lock()) done->block(stream);
}

void WriteOrder::record(const std::vector<at::Tensor>& tensors,
                        const std::shared_ptr<c10::Event>& done) {
  if (tensors.empty()) return;
  std::lock_guard<std::mutex> lock(mutex_);
  const c10::DeviceIndex device = tensors.front().device().index();
  std::vector<Span>& spans = spans_[device];
  for (const auto& tensor : tensors) {
    if (tensor.numel() == 0) continue;
    Span span = span_of(tensor);
    // Ended calls go, and so do the earlier calls within this span: this done completes after
    // theirs, whether or not the call waited for them (one finish stream per device).
    spans.erase(std::remove_if(spans.begin(), spans.end(),
                               [&](const Span& old) {
                                 return old.done.expired() ||
                                        (span.begin <= old.begin && old.end <= span.end);
                               }),
                spans.end());
    span.done = done;
    spans.push_back(span);
  }
  last_[device] = done;
}

}  // namespace torch_bigbatch::torus
