#include "torus/stream_pipeline.h"

#include "torus/flat_buffer.h"
#include "torus/local_reduce.h"
#include "torus/thread_activity.h"

#include <c10/core/Event.h>
#include <c10/core/StreamGuard.h>
#include <c10/core/impl/VirtualGuardImpl.h>
#include <c10/util/Exception.h>

#include <deque>

namespace torch_bigbatch::torus {
StreamPipeline::StreamPipeline(TorusShape shape, Engines engines,
                               std::chrono::milliseconds timeout,
                               std::shared_ptr<BackendFailure> failure,
                               std::shared_ptr<DeliveryOrder> order,
                               std::shared_ptr<WriteOrder> writes)
    : engines_(std::move(engines)),
      context_(std::make_shared<PipelineContext>(shape, timeout, std::move(failure),
                                                 std::move(order))),
      writes_(std::move(writes)) {
  if (shape.columns > 1) active_.push_back(0);
  if (shape.rows > 1) active_.push_back(1);
  if (shape.columns > 1) active_.push_back(2);
  watcher_ = std::thread([this] { watch(); });
}

StreamPipeline::~StreamPipeline() {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    stopping_ = true;
  }
  wake_.notify_one();
  watcher_.join();
}

c10::intrusive_ptr<c10d::Work> StreamPipeline::allreduce(std::vector<at::Tensor> inputs,
                                                         c10d::ReduceOp op,
                                                         c10d::OpType op_type,
                                                         int64_t segment_bytes) {
  TORCH_INTERNAL_ASSERT(!active_.empty(), "a torus of one rank has no phases");
  TORCH_CHECK(segment_bytes > 0, "torus: segment_bytes must be positive, got ", segment_bytes);
  std::lock_guard<std::mutex> ordered(enqueue_mutex_);
  context_->failure->check_usable();
  const c10::Device device = inputs.front().device();
  const DeviceStreams& streams = streams_for(device);
  DeviceWork device_work(device.type());
  std::exception_ptr error;
  try {
    error = enqueue(inputs, op, streams, segment_bytes, device_work);
  } catch (...) {
    // (out of memory for a flat buffer, say) on this rank alone, perhaps before its comparison
    // was issued: failing the pipeline keeps its next call from pairing with this one's peers.
    error = std::current_exception();
    // What was enqueued still runs: done comes after it, so that the watcher keeps the tensors
    // until then and later calls on them wait for it.
    try {
      c10::StreamGuard on_finish(streams.finish);
      finish_after_phases(streams, device);
      for (const PhaseWork& phase : device_work.phases) engines_.follow(*phase.work);
    } catch (...) {
    }
    try {
      device_work.done->record(streams.finish);
      writes_->record(inputs, device_work.done);
    } catch (...) {
    }
  }
  auto work = c10::make_intrusive<StreamWork>(context_, op_type, std::move(inputs),
                                              std::move(device_work), streams.completion);
  // A phase that could not be enqueued fails the pipeline at once; the phases enqueued before
  // it still run, and the watcher keeps their tensors until they end.
  if (error) work->fail(error);
  // The watcher holds the Work (its tensors, which Python may own) until the device is done:
  // at exit Python waits for that (thread_activity.h).
  thread_activity::started();
  {
    std::lock_guard<std::mutex> lock(mutex_);
    incoming_.push_back(work);
  }
  wake_.notify_one();
  if (error) std::rethrow_exception(error);
  return work;
}

const StreamPipeline::DeviceStreams& StreamPipeline::streams_for(c10::Device device) {
  auto found = streams_.find(device.index());
  if (found != streams_.end()) return found->second;
  c10::impl::VirtualGuardImpl guard_impl(device.type());
  auto next = [&] { return guard_impl.getStreamFromGlobalPool(device, /*isHighPriority=*/false); };
  DeviceStreams streams{{next(), next(), next()}, next(), next()};
  return streams_.emplace(device.index(), streams).first->second;
}

// Enqueues every phase of every segment, then the finish. Returns the named error of a phase
// whose collective could not be enqueued (none after it is).
std::exception_ptr StreamPipeline::enqueue(const std::vector<at::Tensor>& inputs,
                                           const c10d::ReduceOp& op,
                                           const DeviceStreams& streams, int64_t segment_bytes,
                                           DeviceWork& device_work) {
  const c10::Device device = inputs.front().device();
  const int64_t columns = context_->shape.columns;
  const c10::Stream& first = streams.phase[active_.front()];
  c10::Event inputs_ready(device.type());
  inputs_ready.record(c10::impl::VirtualGuardImpl(device.type()).getStream(device));
  inputs_ready.block(first);
  FlatBuffer buffer;
  at::Tensor reduced;  // this rank's 1/X of each segment, between the row phases
  {
    c10::StreamGuard on_first(first);
    buffer = FlatBuffer(inputs, columns);
    reduced = columns > 1 ? at::empty({buffer.flat.numel() / columns}, buffer.flat.options())
                          : buffer.flat;
  }
  const auto spans = buffer.segments(segment_bytes);
  device_work.segments = static_cast<int64_t>(spans.size());
  device_work.numel = buffer.flat.numel();
  device_work.kind = call_kind(buffer.flat.scalar_type(), op);
  std::exception_ptr error = compare_calls(first, device_work);
  device_work.buffers.insert(device_work.buffers.end(), {buffer.flat, reduced});
  if (!error) {
    // After the comparison, which the first stream follows (NCCL's whole group ran what was
    // issued before it: a broadcast into these tensors, say), and after the earlier torus calls
    // that write them (not before this call's comparison, which NCCL's whole-group stream would
    // then wait for too; the later calls' wait, as on one engine's stream).
    c10::StreamGuard on_first(first);
    writes_->follow_writes_to(inputs, first);
    buffer.copy_in();
  }

  // AVG is summed and divided once at the end: NCCL's AVG in the row and again in the column
  // would round twice (float16 is divided first: divide_first_if_half).
  const int64_t group_size = context_->shape.columns * context_->shape.rows;
  c10d::ReduceOp finish_op = op;
  if (!error) {
    c10::StreamGuard on_first(first);
    finish_op = divide_first_if_half(buffer.flat, op, group_size);
  }
  const c10d::ReduceOp engine = engine_op(finish_op);
  std::vector<PhaseWork> latest(spans.size());  // per segment: its last phase enqueued
  auto failed = [&](Phase phase, int64_t segment) {
    return context_->phase_failed(phase, segment, device_work.segments, std::current_exception());
  };
  for (size_t index : active_) {
    if (error) break;
    const Phase phase = kPhaseOrder[index];
    c10::StreamGuard on_phase(streams.phase[index]);
    for (size_t k = 0; k < spans.size(); ++k) {
      const int64_t segment = static_cast<int64_t>(k);
      auto [begin, length] = spans[k];
      at::Tensor part = buffer.flat.narrow(0, begin, length);
      at::Tensor part_reduced = reduced.narrow(0, begin / columns, length / columns);
      try {
        // This phase's stream waits for the last one (ordered_on_host: the host waits too, and
        // a failure there is the last phase's).
        if (latest[k].work) engines_.follow(*latest[k].work);
      } catch (...) {
        error = failed(latest[k].phase, segment);
        break;
      }
      try {
        latest[k] = {phase, segment, issue(phase, part, part_reduced, engine)};
      } catch (...) {
        error = failed(phase, segment);
        break;
      }
      device_work.phases.push_back(latest[k]);
    }
  }

  // Each segment's last phase ends after the phases before it, which its stream waited for, so
  // only the last is followed here: Gloo's reduce-scatter copies its result out at each wait()
  // that succeeds, and a second copy would overwrite what the later phases made of it. What
  // the phases' own streams hold ends before done too (such a copy, where the next phase then
  // could not be enqueued; the comparison of the calls, where no phase could).
  c10::StreamGuard on_finish(streams.finish);
  finish_after_phases(streams, device);
  for (const PhaseWork& last : latest) {
    try {
      if (last.work) engines_.follow(*last.work);
    } catch (...) {
      if (!error) error = failed(last.phase, last.segment);
    }
  }
  if (!error) {
    finish_average(buffer.flat, finish_op, group_size);
    buffer.copy_out();
  }
  device_work.done->record(streams.finish);
  writes_->record(inputs, device_work.done);
  return error;
}

void StreamPipeline::finish_after_phases(const DeviceStreams& streams, c10::Device device) {
  for (size_t index : active_) {
    c10::Event queued(device.type());
    queued.record(streams.phase[index]);
    queued.block(streams.finish);
  }
}

// Before any data moves, the ranks compare their calls (element count, dtype, op): one small
// allreduce of the whole group, which the first phase's stream waits for. Its result comes to
// host memory for the watcher (StreamWork::disagreement), so ranks that passed different
// buffers fail with a message that says so, even where the data phases then hang.
std::exception_ptr StreamPipeline::compare_calls(const c10::Stream& first,
                                                 DeviceWork& device_work) {
  c10::StreamGuard on_first(first);
  const auto pinned = at::TensorOptions(at::kLong).pinned_memory(true);
  at::Tensor call = at::empty({4}, pinned);
  int64_t* values = call.data_ptr<int64_t>();
  values[0] = device_work.numel;
  values[1] = device_work.kind;
  values[2] = -device_work.numel;
  values[3] = -device_work.kind;
  std::vector<at::Tensor> compared{call.to(first.device(), /*non_blocking=*/true)};
  try {
    c10d::AllreduceOptions options;
    options.reduceOp = c10d::ReduceOp::MAX;
    auto work = engines_.whole->allreduce(compared, options);
    engines_.follow(*work);  // the first phase's stream waits for it
    device_work.phases.push_back({Phase::Agreement, 0, work});
  } catch (...) {
    return context_->phase_failed(Phase::Agreement, 0, device_work.segments,
                                  std::current_exception());
  }
  device_work.agreement = at::empty({4}, pinned);
  device_work.agreement.copy_(compared[0], /*non_blocking=*/true);
  device_work.agreed.record(first);
  device_work.buffers.push_back(compared[0]);
  return nullptr;
}

c10::intrusive_ptr<c10d::Work> StreamPipeline::issue(Phase phase, at::Tensor& part,
                                                     at::Tensor& reduced,
                                                     const c10d::ReduceOp& op) {
  if (phase == Phase::RowScatter) {
    c10d::ReduceScatterOptions options;
    options.reduceOp = op;
    return engines_.row_scatter->_reduce_scatter_base(reduced, part, options);
  }
  if (phase == Phase::ColumnAllreduce) {
    c10d::AllreduceOptions options;
    options.reduceOp = op;
    std::vector<at::Tensor> tensors{reduced};
    return engines_.column->allreduce(tensors, options);
  }
  return engines_.row_gather->_allgather_base(part, reduced);
}

void StreamPipeline::watch() {
  std::deque<c10::intrusive_ptr<StreamWork>> watched;
  for (;;) {
    {
      std::unique_lock<std::mutex> lock(mutex_);
      if (watched.empty()) {
        wake_.wait(lock, [this] { return stopping_ || !incoming_.empty(); });
      } else {
        wake_.wait_for(lock, kPollInterval, [this] { return stopping_; });
      }
      for (auto& work : incoming_) watched.push_back(std::move(work));
      incoming_.clear();
      if (stopping_) break;
    }
    poll(watched);
  }
  auto shut_down =
      std::make_exception_ptr(C10_BUILD_ERROR(DistBackendError, "torus backend was shut down"));
  for (auto& work : watched) {
    work->fail(shut_down);
    // Still in flight (a hung collective, or one nobody waited for): its tensors stay allocated
    // rather than go back to the caching allocator while a stream may still write them.
    if (!device_finished(*work)) (void)work.release();
  }
  const size_t held = watched.size();
  watched.clear();
  for (size_t i = 0; i < held; ++i) thread_activity::finished();
}

void StreamPipeline::prepare_watcher(c10::Device device) {
  if (watcher_device_ == device) return;
  if (auto setup = WatcherSetups::find(device.type())) {
    setup(device);
  } else {
    c10::impl::VirtualGuardImpl(device.type()).setDevice(device);
  }
  watcher_device_ = device;
}

// Whether the device has finished with a Work's tensors. A device that cannot tell (an error, a
// driver shutting down) counts as not finished, so that nothing is freed under it.
bool StreamPipeline::device_finished(const StreamWork& work) {
  try {
    prepare_watcher(work.device());
    return work.device_done();
  } catch (...) {
    return false;
  }
}

void StreamPipeline::poll(std::deque<c10::intrusive_ptr<StreamWork>>& watched) {
  // done events complete in call order (on a device; a process drives one), so the Works after
  // the oldest one still running need no full poll: they can only fail with the pipeline.
  bool older_running = false;
  for (auto& work : watched) {
    if (work->settled()) continue;
    try {
      if (!older_running) {
        prepare_watcher(work->device());
        work->poll();
        older_running = !work->settled();
      } else if (auto failure = context_->failure->first()) {
        work->fail(failure);
      }
    } catch (...) {
      work->fail(std::current_exception());  // a device error while querying an event
    }
  }
  while (!watched.empty() && watched.front()->settled() && device_finished(*watched.front())) {
    watched.pop_front();
    thread_activity::finished();
  }
}

}  // namespace torch_bigbatch::torus
