// Which torus allreduces still in flight on a device write which memory, so that a later
// collective on the same memory runs after them, as one engine's collectives run in the order
// they were issued (ProcessGroupNCCL's all run on one stream). The torus spreads a call over
// several streams and groups: without this, a second call on a tensor read it while the first
// still wrote it, and a broadcast issued after a torus allreduce ran before it.
//
// A call is recorded with the device addresses its tensors span and its done event (the last
// thing it does on the device); an entry lives as long as the call's Work, which holds the
// tensors, so the memory cannot be reused meanwhile. Addresses, not storages: two storages over
// one memory (DLPack, IPC) overlap as they are. Calls on other memory (DDP's buckets) overlap
// on the device, until one waits: its wait stays on the pipeline's streams, so the calls issued
// after it wait too (as all of one NCCL group's do).
#pragma once

#include <ATen/ATen.h>
#include <c10/core/Event.h>
#include <c10/core/Stream.h>

#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <vector>

namespace torch_bigbatch::torus {

class WriteOrder {
 public:
  // `stream` waits for every call in flight on its device that writes memory `tensors` span
  // (a tensor without storage, a sparse one: for every call in flight).
  void follow_writes_to(const std::vector<at::Tensor>& tensors, const c10::Stream& stream);
  // `stream` waits for every call in flight, on every device (a barrier's order).
  void follow_all(const c10::Stream& stream);
  // A call that writes `tensors` (strided, on one device) ends with `done`, recorded last on
  // the device's finish stream.
  void record(const std::vector<at::Tensor>& tensors, const std::shared_ptr<c10::Event>& done);

 private:
  struct Span {
    uintptr_t begin, end;  // device addresses
    std::weak_ptr<c10::Event> done;
  };
  static Span span_of(const at::Tensor& tensor);
  void follow_device(c10::DeviceIndex device, const c10::Stream& stream);  // (under mutex_)

  std::mutex mutex_;
  std::map<c10::DeviceIndex, std::vector<Span>> spans_;
  // Per device, the last call's done: done events complete in the order they were recorded
  // (one finish stream per device), so it implies every earlier one.
  std::map<c10::DeviceIndex, std::weak_ptr<c10::Event>> last_;
};

}  // namespace torch_bigbatch::torus
