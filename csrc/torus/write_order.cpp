#include "torus/write_order.h"

#include <algorithm>

namespace torch_bigbatch::torus {
namespace {

constexpr size_t kStoragesBeforeForgetting = 64;

const void* storage_of(const at::Tensor& tensor) {
  return tensor.storage().unsafeGetStorageImpl();
}

}  // namespace

WriteOrder::Span WriteOrder::span_of(const at::Tensor& tensor) {
  const int64_t begin = tensor.storage_offset() * tensor.element_size();
  if (tensor.numel() == 0) return {begin, begin, {}};
  int64_t last = 0;  // the offset of the last element, in elements (dense strides are >= 0)
  for (int64_t dim = 0; dim < tensor.dim(); ++dim)
    last += (tensor.size(dim) - 1) * tensor.stride(dim);
  return {begin, begin + (last + 1) * tensor.element_size(), {}};
}

void WriteOrder::follow_writes_to(const std::vector<at::Tensor>& tensors,
                                  const c10::Stream& stream) {
  std::lock_guard<std::mutex> lock(mutex_);
  for (const auto& tensor : tensors) {
    auto found = spans_.find(storage_of(tensor));
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
  auto found = last_.find(stream.device_index());
  if (found == last_.end()) return;
  if (auto done = found->second.lock()) done->block(stream);
}

void WriteOrder::record(const std::vector<at::Tensor>& tensors,
                        const std::shared_ptr<c10::Event>& done) {
  std::lock_guard<std::mutex> lock(mutex_);
  for (const auto& tensor : tensors) {
    Span span = span_of(tensor);
    span.done = done;
    std::vector<Span>& spans = spans_[storage_of(tensor)];
    // Ended calls go, and so do those within this call's span: it waited for them.
    spans.erase(std::remove_if(spans.begin(), spans.end(),
                               [&](const Span& old) {
                                 return old.done.expired() ||
                                        (span.begin <= old.begin && old.end <= span.end);
                               }),
                spans.end());
    spans.push_back(span);
  }
  if (!tensors.empty()) last_[tensors.front().device().index()] = done;
  if (spans_.size() > kStoragesBeforeForgetting) forget_ended();
}

void WriteOrder::forget_ended() {
  for (auto entry = spans_.begin(); entry != spans_.end();) {
    auto& spans = entry->second;
    spans.erase(std::remove_if(spans.begin(), spans.end(),
                               [](const Span& span) { return span.done.expired(); }),
                spans.end());
    entry = spans.empty() ? spans_.erase(entry) : std::next(entry);
  }
}

}  // namespace torch_bigbatch::torus
