// The torus allreduce on engines that order their work by streams (NCCL, CUDA tensors).
//
// Streams. An engine's collective waits for what the current stream holds when it is enqueued,
// then runs on the engine's own stream; Work::synchronize() makes the current stream wait for
// its end. The pipeline owns, per device, one stream per phase, a finish stream and a completion
// stream; they run no collective, they only order them. Before phase p of segment k is
// enqueued, the stream of phase p waits for:
//   - the reduce-scatter stream (the first phase's) for the caller's current stream, since the
//     inputs are ready there, then for the comparison of the ranks' calls (one small allreduce
//     of the whole group: count, dtype and op; on NCCL after the group's earlier collectives),
//     and for the earlier torus calls in flight that write the same memory (write_order.h);
//     the copy into a flat buffer, when there is one, runs on it too, after these;
//   - the column stream for the reduce-scatter of segment k;
//   - the allgather stream for the column allreduce (or, with one row, the reduce-scatter) of k.
// Each stream thus accumulates waits on one engine, whose own stream runs in order, so what it
// waited for earlier is implied anyway: segment k+1 is reduce-scattered while segment k crosses
// the column, and a call's reduce-scatters do not wait for the previous call's allgathers
// unless the two write the same memory. The whole group's collectives issued after a torus call
// wait for it in the same way (TorusBackend::follow_torus_calls).
//
// Order. The calling thread enqueues every phase of a call at once and in one fixed order (all
// reduce-scatters, then all column allreduces, then all allgathers, each in segment order),
// never interleaved with another call's, so every group sees its collectives in the same order
// on every rank.
//
// Completion. The finish stream waits for each segment's last phase (which ended after the
// phases before it), divides an AVG (the engines sum: one rounding), copies the result back
// when the flat buffer is a copy, and records the Work's `done` event. done events complete in
// call order (one finish stream per device). A watcher thread polls the oldest unsettled Works
// (every kPollInterval): calls that differ between ranks fail their Work as soon as the
// comparison arrives, a phase with an error fails its Work with the phase named, a late Work
// fails naming the phase it waits for, and a Work whose done event has completed completes its
// future with the outputs. After the first failure every pending and later allreduce fails, as
// on the host pipeline, so nothing pairs with the wrong peer.
//
// Lifetime. A Work holds its inputs, its flat buffer, the reduced parts and the phase Works; the
// watcher holds the Work until its done event has completed, also after a failure, so no tensor
// goes back to the caching allocator while one of these streams may still use it.
//
// Host. allreduce() never blocks, nor does wait(): as with ProcessGroupNCCL, it makes the current
// stream wait for done (and throws a failure known by then). (On engines ordered on the host,
// Gloo's CUDA collectives, allreduce() blocks until its phases have run: each phase's input is
// ready only then; that engine lets several ranks share one GPU, for tests.) wait(timeout)
// blocks the host until the Work is settled, and one whose timeout passes fails the Work as the
// pipeline's own timeout would. The future completes on the watcher thread, so its then()
// callbacks run there, as Gloo's run on its worker threads; a callback must not block on
// another torus collective.
// Failures reach the future, isSuccess() and exception(), and every later allreduce refuses.
//
// The watcher thread makes the device of the Work it polls current (else its first event query
// would create a context on GPU 0) and, through the device's glue, puts the thread in
// thread-local stream-capture mode (a query in global mode would invalidate a CUDA graph that
// another thread is capturing), as ProcessGroupNCCL's watchdog does.
#pragma once

#include "common/device_launchers.h"
#include "torus/stream_work.h"
#include "torus/topology.h"
#include "torus/write_order.h"

#include <c10/core/Stream.h>
#include <torch/csrc/distributed/c10d/Types.hpp>

#include <array>
#include <chrono>
#include <condition_variable>
#include <deque>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <thread>
#include <vector>

namespace torch_bigbatch::torus {

class StreamPipeline {
 public:
  // `writes`: the backend's, shared with its whole-group collectives (write_order.h).
  StreamPipeline(TorusShape shape, Engines engines, std::chrono::milliseconds timeout,
                 std::shared_ptr<BackendFailure> failure, std::shared_ptr<DeliveryOrder> order,
                 std::shared_ptr<WriteOrder> writes);
  ~StreamPipeline();
  StreamPipeline(const StreamPipeline&) = delete;
  StreamPipeline& operator=(const StreamPipeline&) = delete;

  // Reduces `inputs` (one dtype, one device) in place: one tensor for allreduce, several for
  // allreduce_coalesced (reduced as one flattened buffer), in segments of about segment_bytes.
  c10::intrusive_ptr<c10d::Work> allreduce(std::vector<at::Tensor> inputs, c10d::ReduceOp op,
                                           c10d::OpType op_type, int64_t segment_bytes);

 private:
  // How late a completed allreduce is noticed at most: DDP's host waits for its last bucket.
  static constexpr std::chrono::microseconds kPollInterval{200};
  static constexpr std::array<Phase, 3> kPhaseOrder = {
      Phase::RowScatter, Phase::ColumnAllreduce, Phase::RowGather};

  struct DeviceStreams {
    std::array<c10::Stream, kPhaseOrder.size()> phase;
    c10::Stream finish, completion;
  };

  const DeviceStreams& streams_for(c10::Device device);
  std::exception_ptr enqueue(const std::vector<at::Tensor>& inputs, const c10d::ReduceOp& op,
                             const DeviceStreams& streams, int64_t segment_bytes,
                             DeviceWork& device_work);
  std::exception_ptr compare_calls(const c10::Stream& first, DeviceWork& device_work);
  // The finish stream waits for what each phase stream holds.
  void finish_after_phases(const DeviceStreams& streams, c10::Device device);
  c10::intrusive_ptr<c10d::Work> issue(Phase phase, at::Tensor& part, at::Tensor& reduced,
                                       const c10d::ReduceOp& op);
  void watch();
  void poll(std::deque<c10::intrusive_ptr<StreamWork>>& watched);
  void prepare_watcher(c10::Device device);  // watcher thread only, as the next one
  bool device_finished(const StreamWork& work);

  const Engines engines_;
  const std::shared_ptr<PipelineContext> context_;
  std::vector<size_t> active_;  // indices into kPhaseOrder of the phases this shape has

  const std::shared_ptr<WriteOrder> writes_;
  std::mutex enqueue_mutex_;  // one call's phases at a time; guards streams_
  std::map<c10::DeviceIndex, DeviceStreams> streams_;

  std::mutex mutex_;  // guards what the calling threads hand the watcher
  std::condition_variable wake_;
  bool stopping_ = false;
  std::vector<c10::intrusive_ptr<StreamWork>> incoming_;
  std::thread watcher_;
  std::optional<c10::Device> watcher_device_;  // the device the watcher thread has made current
};

// What a device's glue registers for the thread that queries its events (torus_cuda_glue.cpp):
// make `device` current, and whatever else such a thread needs there.
using WatcherSetups = DeviceLaunchers<void (*)(c10::Device)>;

// What a device's glue registers to tell whether the device's current stream is capturing a
// graph (torus_cuda_glue.cpp): the pipeline cannot run in a capture (its watcher and the
// tuner's trials query events on the host, which a capture records only at replay).
using CaptureChecks = DeviceLaunchers<bool (*)(c10::Device)>;

}  // namespace torch_bigbatch::torus
