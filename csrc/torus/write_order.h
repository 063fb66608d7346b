// Which torus allreduces still in flight on a device write which memory, so that a later
// collective on the same memory runs after them, as one engine's collectives run in the order
// they were issued (ProcessGroupNCCL's all run on one stream). The torus spreads a call over
// several streams and groups: without this, a second call on a tensor read it while the first
// still wrote it, and a broadcast issued after a torus allreduce ran before it.
//
// A call is recorded with the byte spans of its tensors and its done event (the last thing it
// does on the device); an entry lives as long as the call's Work (which holds the tensors, so
// the memory cannot be reused meanwhile). Calls on other memory (DDP's buckets, views of one
// flat gradient buffer that do not overlap) keep overlapping.
#pragma once

#include <ATen/ATen.h>
#include <c10/core/Event.h>
#include <c10/core/Stream.h>

#include <map>
#include <memory>
#include <mutex>
#include <vector>

namespace torch_bigbatch::torus {

class WriteOrder {
 public:
  // `stream` waits for every call in flight that writes memory `tensors` overlap.
  void follow_writes_to(const std::vector<at::Tensor>& tensors, const c10::Stream& stream);
  // `stream` waits for every call in flight on its device (a barrier's order).
  void follow_all(const c10::Stream& stream);
  // A call that writes `tensors` (on one device) ends with `done`, recorded on the device. Its
  // first stream has followed the calls that write the same memory (follow_writes_to).
  void record(const std::vector<at::Tensor>& tensors, const std::shared_ptr<c10::Event>& done);

 private:
  struct Span {
    int64_t begin, end;  // bytes of the storage
    std::weak_ptr<c10::Event> done;
  };
  static Span span_of(const at::Tensor& tensor);
  void forget_ended();  // (when many storages are listed: each call may bring a new one)

  std::mutex mutex_;
  std::map<const void*, std::vector<Span>> spans_;  // per storage
  // Per device, the last call's done: done events complete in call order (one finish stream
  // per device), so it implies every earlier one.
  std::map<c10::DeviceIndex, std::weak_ptr<c10::Event>> last_;
};

}  // namespace torch_bigbatch::torus
