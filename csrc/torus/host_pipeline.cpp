#include "torus/host_pipeline.h"

#include "torus/flat_buffer.h"
#include "torus/local_reduce.h"

#include <ATen/ATen.h>
#include <c10/util/Exception.h>
#include <c10/util/StringUtil.h>

#include <algorithm>
#include <tuple>
#include <stdexcept>

namespace torch_bigbatch::torus {

using Clock = std::chrono::steady_clock;

struct HostPipeline::Op {
  c10::intrusive_ptr<TorusWork> work;
  FlatBuffer buffer;
  c10d::ReduceOp op;
  int64_t segments_left = 0;
  Clock::time_point deadline;
};

struct HostPipeline::Segment {
  std::shared_ptr<Op> op;
  int64_t index = 0, count = 0;   // segment index of count, for messages
  int64_t begin = 0, length = 0;  // elements of op->buffer.flat; length is a multiple of X
  at::Tensor received, chunk, replicated;
  std::array<c10::intrusive_ptr<c10d::Work>, kPhases> work;
};

struct HostPipeline::Shared {
  std::mutex mutex;
  std::condition_variable wake;
  bool pending = false;  // something completed or arrived since the thread last looked
  bool stopping = false;
  std::exception_ptr failure;  // the first failure: the backend is unusable after it
  std::vector<Segment> incoming;

  void notify() {
    {
      std::lock_guard<std::mutex> lock(mutex);
      pending = true;
    }
    wake.notify_one();
  }
};

HostPipeline::HostPipeline(TorusShape shape, Engines engines, int64_t segment_bytes,
                           std::chrono::milliseconds timeout)
    : shape_(shape),
      engines_(std::move(engines)),
      segment_bytes_(segment_bytes),
      timeout_(timeout),
      shared_(std::make_shared<Shared>()) {
  TORCH_CHECK(segment_bytes_ > 0, "torus: segment_bytes must be positive, got ", segment_bytes_);
  active_ = {shape_.columns > 1, shape_.rows > 1, shape_.columns > 1};
  first_phase_ = active_[kScatter] ? kScatter : kColumn;
  last_phase_ = active_[kGather] ? kGather : kColumn;
  thread_ = std::thread([this] { run(); });
}

HostPipeline::~HostPipeline() {
  {
    std::lock_guard<std::mutex> lock(shared_->mutex);
    shared_->stopping = true;
  }
  shared_->wake.notify_one();
  thread_.join();
}

c10::intrusive_ptr<c10d::Work> HostPipeline::allreduce(std::vector<at::Tensor> inputs,
                                                       c10d::ReduceOp op,
                                                       c10d::OpType op_type) {
  auto task = std::make_shared<Op>();
  task->work = c10::make_intrusive<TorusWork>(shape_.rank, op_type, inputs);
  task->buffer = FlatBuffer(std::move(inputs), shape_.columns);
  task->op = op;
  task->deadline = Clock::now() + timeout_;

  auto spans = task->buffer.segments(segment_bytes_);
  task->segments_left = static_cast<int64_t>(spans.size());
  std::vector<Segment> segments;
  for (size_t i = 0; i < spans.size(); ++i) {
    Segment segment;
    segment.op = task;
    segment.index = static_cast<int64_t>(i);
    segment.count = task->segments_left;
    std::tie(segment.begin, segment.length) = spans[i];
    segments.push_back(std::move(segment));
  }
  {
    std::lock_guard<std::mutex> lock(shared_->mutex);
    if (shared_->failure) {
      try {
        std::rethrow_exception(shared_->failure);
      } catch (const std::exception& e) {
        TORCH_CHECK(false, "torus backend is unusable after an earlier failure: ", e.what());
      }
    }
    for (auto& segment : segments) shared_->incoming.push_back(std::move(segment));
    shared_->pending = true;
  }
  shared_->wake.notify_one();
  return task->work;
}

void HostPipeline::run() {
  for (;;) {
    {
      std::unique_lock<std::mutex> lock(shared_->mutex);
      auto woken = [&] { return shared_->pending || shared_->stopping; };
      if (segments_.empty()) {
        shared_->wake.wait(lock, woken);
      } else {
        shared_->wake.wait_until(lock, segments_.front().op->deadline, woken);
      }
      if (shared_->stopping) break;
      shared_->pending = false;
      for (auto& segment : shared_->incoming) segments_.push_back(std::move(segment));
      shared_->incoming.clear();
    }
    try {
      while (advance()) {
      }
      if (!segments_.empty() && Clock::now() >= segments_.front().op->deadline) {
        const Segment& late = segments_.front();
        // The first phase not done; one not issued yet counts as not done.
        auto done = [&](int phase) {
          return !active_[phase] ||
                 (late.work[phase] && late.work[phase]->getFuture()->completed());
        };
        int phase = first_phase_;
        while (phase < last_phase_ && done(phase)) phase += 1;
        TORCH_CHECK(false, "torus allreduce timed out after ", timeout_.count(), " ms: ",
                    shape_.describe(), " waits for the ", phase_name(phase), ", segment ",
                    late.index + 1, " of ", late.count);
      }
    } catch (...) {
      fail_everything(std::current_exception());
    }
  }
  fail_everything(std::make_exception_ptr(std::runtime_error("torus backend was shut down")));
}

// Issues every phase that is ready, in segment order per phase; retires finished segments.
bool HostPipeline::advance() {
  bool moved = false;
  for (int phase = first_phase_; phase <= last_phase_; ++phase) {
    if (!active_[phase]) continue;
    while (issued_[phase] < segments_.size() && ready_for(segments_[issued_[phase]], phase) &&
           (phase != first_phase_ || issued_[phase] < kSegmentsInFlight)) {
      issue(segments_[issued_[phase]], phase);
      issued_[phase] += 1;
      moved = true;
    }
  }
  while (issued_[last_phase_] > 0 && ready_for(segments_.front(), kPhases)) {
    retire(segments_.front());
    segments_.pop_front();
    for (auto& count : issued_) count = count > 0 ? count - 1 : 0;
    moved = true;
  }
  return moved;
}

// Whether the active phase before `phase` has completed for this segment (throws its error).
bool HostPipeline::ready_for(Segment& segment, int phase) {
  int previous = phase - 1;
  while (previous >= 0 && !active_[previous]) previous -= 1;
  if (previous < 0) return true;
  if (!segment.work[previous]) return false;  // not issued yet
  auto future = segment.work[previous]->getFuture();
  if (!future->completed()) return false;
  if (future->hasError()) {
    TORCH_CHECK(false, "torus allreduce failed in the ", phase_name(previous), " (",
                shape_.describe(), "), segment ", segment.index + 1, " of ", segment.count,
                ": ", future->tryRetrieveErrorMessage());
  }
  return true;
}

void HostPipeline::issue(Segment& segment, int phase) {
  Op& op = *segment.op;
  at::Tensor part = op.buffer.flat.narrow(0, segment.begin, segment.length);
  int64_t columns = shape_.columns;
  std::vector<int64_t> equal_splits;  // empty: X equal parts
  c10::intrusive_ptr<c10d::Work> work;
  if (phase == kScatter) {
    // Each row member sends the k-th X-th of its segment to member k: a direct
    // reduce-scatter in one step, reduced locally when the X parts have arrived.
    segment.received = scratch_.take(segment.length, part);
    work = engines_.row_scatter->alltoall_base(segment.received, part, equal_splits,
                                               equal_splits);
  } else if (phase == kColumn) {
    if (active_[kScatter]) {
      reduce_received(segment);
    } else {
      segment.chunk = part;
    }
    std::vector<at::Tensor> tensors{segment.chunk};
    c10d::AllreduceOptions options;
    options.reduceOp = engine_op(op.op);
    work = engines_.column->allreduce(tensors, options);
  } else {
    if (!active_[kColumn]) reduce_received(segment);
    finish_average(segment.chunk, op.op, shape_.columns * shape_.rows);
    // Every row member receives this member's reduced part: an allgather in one step.
    segment.replicated = scratch_.take(segment.length, part);
    segment.replicated.view({columns, -1}).copy_(segment.chunk.unsqueeze(0).expand({columns, -1}));
    work = engines_.row_gather->alltoall_base(part, segment.replicated, equal_splits,
                                              equal_splits);
  }
  work->getFuture()->addCallback(
      [shared = shared_](c10::ivalue::Future&) { shared->notify(); });
  segment.work[phase] = std::move(work);
}

void HostPipeline::reduce_received(Segment& segment) {
  int64_t columns = shape_.columns;
  segment.chunk = scratch_.take(segment.length / columns, segment.received);
  reduce_rows(segment.chunk, segment.received.view({columns, -1}), segment.op->op);
  scratch_.give(std::move(segment.received));
}

void HostPipeline::retire(Segment& segment) {
  Op& op = *segment.op;
  if (active_[kGather]) {
    scratch_.give(std::move(segment.chunk));
    scratch_.give(std::move(segment.replicated));
  } else {
    finish_average(segment.chunk, op.op, shape_.columns * shape_.rows);
  }
  op.segments_left -= 1;
  if (op.segments_left == 0) {
    op.buffer.copy_out();
    op.work->complete();
  }
}

std::string HostPipeline::phase_name(int phase) const {
  auto list = [](const std::vector<int>& ranks) {
    std::string text;
    for (int rank : ranks) text += (text.empty() ? "" : ", ") + std::to_string(rank);
    return "ranks " + text;
  };
  if (phase == kScatter)
    return c10::str("reduce-scatter along row ", shape_.y(), " (", list(shape_.row_ranks()), ")");
  if (phase == kColumn)
    return c10::str("allreduce along column ", shape_.x(), " (", list(shape_.column_ranks()),
                    ")");
  return c10::str("allgather along row ", shape_.y(), " (", list(shape_.row_ranks()), ")");
}

// After one failure the groups' collective sequences may differ between ranks: every pending
// and later collective of this backend fails instead of pairing with the wrong peer.
void HostPipeline::fail_everything(const std::exception_ptr& error) {
  std::vector<Segment> incoming;
  {
    std::lock_guard<std::mutex> lock(shared_->mutex);
    if (!shared_->failure) shared_->failure = error;
    incoming.swap(shared_->incoming);
  }
  for (auto& segment : segments_) segment.op->work->fail(error);
  for (auto& segment : incoming) segment.op->work->fail(error);
  segments_.clear();
  issued_.fill(0);
}

}  // namespace torch_bigbatch::torus
