// The Work of one torus allreduce whose phases the device orders by streams (NCCL, CUDA
// tensors). stream_pipeline.h says how its streams, events and phase Works relate; this is what
// the caller and DDP see: isCompleted, isSuccess and exception without blocking, wait(timeout),
// and a future that completes with the output tensors or with the named error.
#pragma once

#include "torus/backend_failure.h"
#include "torus/topology.h"
#include "torus/torus_work.h"

#include <ATen/core/ivalue.h>
#include <c10/core/Event.h>
#include <c10/core/Stream.h>
#include <torch/csrc/distributed/c10d/Work.hpp>

#include <atomic>
#include <chrono>
#include <memory>
#include <mutex>
#include <vector>

namespace torch_bigbatch::torus {

// What the Works of one pipeline share: the shape that names their phases, their timeout, and
// the backend's failure state (after a failure it refuses every allreduce).
class PipelineContext {
 public:
  PipelineContext(TorusShape shape, std::chrono::milliseconds timeout,
                  std::shared_ptr<BackendFailure> failure, std::shared_ptr<DeliveryOrder> order)
      : shape(shape), timeout(timeout), failure(std::move(failure)), order(std::move(order)) {}

  // The errors of a phase of segment `segment` (0-based) of `segments`, named as on the host
  // pipeline (topology.h).
  std::exception_ptr phase_failed(Phase phase, int64_t segment, int64_t segments,
                                  const std::exception_ptr& cause) const;
  std::exception_ptr phase_timed_out(Phase phase, int64_t segment, int64_t segments,
                                     std::chrono::milliseconds after) const;

  const TorusShape shape;
  const std::chrono::milliseconds timeout;
  const std::shared_ptr<BackendFailure> failure;
  const std::shared_ptr<DeliveryOrder> order;  // the backend's: in which its Works end
};

// One collective of one segment, as its engine returned it.
struct PhaseWork {
  Phase phase;
  int64_t segment;
  c10::intrusive_ptr<c10d::Work> work;
};

// What one allreduce put on the device.
struct DeviceWork {
  explicit DeviceWork(c10::DeviceType type)
      : agreed(type), done(std::make_shared<c10::Event>(type)) {}

  std::vector<PhaseWork> phases;    // in the order they were enqueued
  int64_t segments = 0;
  std::vector<at::Tensor> buffers;  // the flat buffer, the reduced parts, the agreement tensor
  // This rank's call (numel and call_kind) and, once `agreed` has completed, the MAX over the
  // ranks of (numel, kind, -numel, -kind) in host memory: the ranks passed the same call iff
  // the maxima are minus the minima.
  int64_t numel = 0;
  int32_t kind = 0;
  at::Tensor agreement;
  c10::Event agreed;
  // Recorded after every phase, the division of AVG and the copy back; shared with the
  // pipeline, whose later calls on the same tensors wait for it.
  std::shared_ptr<c10::Event> done;
};

class StreamWork : public TorusWork {
 public:
  // `completion`: a stream of the outputs' device that carries none of the pipeline's work
  // (the device is done with the result then: the future's events tie a consumer to no later
  // allreduce).
  StreamWork(std::shared_ptr<PipelineContext> context, c10d::OpType op_type,
             std::vector<at::Tensor> outputs, DeviceWork device_work, c10::Stream completion);

  // For the pipeline. poll() (its watcher thread's) settles the work when its device work is
  // done, the ranks' calls differ, one of its phases failed, the pipeline failed, or its
  // deadline has passed.
  void poll();
  c10::Device device() const { return outputs_.front().device(); }
  void fail(const std::exception_ptr& error) override;  // unless it is settled already
  bool device_done() const;  // the device no longer uses its tensors (even after a failure)

  // As ProcessGroupNCCL's Work: wait() makes the current stream wait for the result and raises
  // a failure known by then; wait(timeout) blocks the host until the work has ended for its
  // callers (its turn in the delivery order) or the timeout has passed (then a work still
  // running fails, naming the phase it waits for).
  bool wait(std::chrono::milliseconds timeout = kNoTimeout) override;
  void synchronize() override;  // the current stream waits for the result
  // c10d::Work's default spins a kernel on the current stream until the future's host
  // callback runs (an SM held, and the watcher's and the delivery's latency): an event does.
  void blockCurrentStream() override { synchronize(); }

 private:
  const PhaseWork* first_phase(bool (*matches)(c10d::Work&)) const;
  std::exception_ptr disagreement();  // once the comparison has arrived; watcher thread only
  std::exception_ptr failed_phase() const;
  std::exception_ptr timed_out(std::chrono::milliseconds after) const;

  const std::shared_ptr<PipelineContext> context_;
  const DeviceWork device_work_;
  const Clock::time_point deadline_;
  bool agreement_read_ = false;
};

}  // namespace torch_bigbatch::torus
