#include "torus/stream_work.h"

#include "torus/deadline.h"

#include <c10/core/DeviceGuard.h>
#include <c10/core/impl/VirtualGuardImpl.h>
#include <c10/util/Exception.h>
#include <c10/util/StringUtil.h>

#include <tuple>

namespace torch_bigbatch::torus {
std::exception_ptr PipelineContext::phase_failed(Phase phase, int64_t segment, int64_t segments,
                                                 const std::exception_ptr& cause) const {
  return std::make_exception_ptr(C10_BUILD_ERROR(
      DistBackendError, describe_failure(shape, phase, segment, segments, message_of(cause))));
}

std::exception_ptr PipelineContext::phase_timed_out(Phase phase, int64_t segment,
                                                    int64_t segments,
                                                    std::chrono::milliseconds after) const {
  return std::make_exception_ptr(C10_BUILD_ERROR(
      DistBackendError, describe_timeout(shape, phase, segment, segments, after)));
}

StreamWork::StreamWork(std::shared_ptr<PipelineContext> context, c10d::OpType op_type,
                       std::vector<at::Tensor> outputs, DeviceWork device_work,
                       c10::Stream completion)
    : TorusWork(context->shape.rank, op_type, std::move(outputs), context->order, completion),
      context_(std::move(context)),
      device_work_(std::move(device_work)),
      deadline_(deadline_after(Clock::now(), context_->timeout)) {}

void StreamWork::poll() {
  // Queried first: an error that ended a phase early is visible by the time the event is.
  const bool done = device_done();
  if (auto error = disagreement()) return fail(error);
  if (auto error = failed_phase()) return fail(error);
  if (auto error = context_->failure->first()) return fail(error);
  if (done) return complete();
  if (Clock::now() >= deadline_) fail(timed_out(context_->timeout));
}

void StreamWork::fail(const std::exception_ptr& error) {
  if (!claim()) return;
  context_->failure->record(error);  // before the future's callbacks can issue another allreduce
  end(error);
}

bool StreamWork::device_done() const {
  return device_work_.done->query();
}

bool StreamWork::wait(std::chrono::milliseconds timeout) {
  std::exception_ptr error;
  if (timeout != kNoTimeout) {
    const auto until = deadline_after(Clock::now(), timeout);
    if (!wait_until_ended(until)) {
      fail(timed_out(timeout));
      wait_until_ended(std::nullopt);  // the watcher's end(), if it settled the work first
    }
    if (!delivered_by(until)) {  // its turn has not come: its failure is known all the same
      error = settled_error();
      TORCH_CHECK(error, "Operation timed out!");
    }
  }
  // A failure the watcher has settled is known before its turn to be delivered comes.
  if (!error) error = settled_error();
  if (!error) {
    std::lock_guard<std::mutex> lock(mutex_);
    error = exception_;
  }
  if (error) std::rethrow_exception(error);
  synchronize();
  return true;
}

void StreamWork::synchronize() {
  const c10::Device device = outputs_.front().device();
  // (An event waited for from another current device returns to it with cudaSetDevice, which
  // creates a context there if it had none: as ProcessGroupNCCL, on the tensors' device.)
  const c10::DeviceGuard on_its_device(device);
  device_work_.done->block(c10::impl::VirtualGuardImpl(device.type()).getStream(device));
  c10d::Work::synchronize();
}

// The first phase, in segment order and then in pipeline order, that `matches`.
const PhaseWork* StreamWork::first_phase(bool (*matches)(c10d::Work&)) const {
  const PhaseWork* first = nullptr;
  for (const auto& phase : device_work_.phases) {
    bool earlier = first == nullptr ||
                   std::tie(phase.segment, phase.phase) < std::tie(first->segment, first->phase);
    if (earlier && matches(*phase.work)) first = &phase;
  }
  return first;
}

std::exception_ptr StreamWork::disagreement() {
  // (No agreement tensor: its allreduce could not be enqueued, which fails the work anyway.)
  if (agreement_read_ || !device_work_.agreement.defined() || !device_work_.agreed.query())
    return nullptr;
  agreement_read_ = true;
  const int64_t* maxima = device_work_.agreement.data_ptr<int64_t>();
  const int64_t counts[2] = {-maxima[2], maxima[0]};  // smallest, largest
  if (counts[0] == counts[1] && -maxima[3] == maxima[1]) return nullptr;
  const std::string detail =
      counts[0] != counts[1]
          ? c10::str("their element counts range from ", counts[0], " to ", counts[1])
          : std::string("their dtypes or ops differ");
  return std::make_exception_ptr(C10_BUILD_ERROR(
      DistBackendError,
      describe_mismatch(context_->shape, detail, device_work_.numel, device_work_.kind)));
}

std::exception_ptr StreamWork::failed_phase() const {
  const PhaseWork* failed = first_phase([](c10d::Work& work) {
    work.isCompleted();  // lets an NCCL Work take up its communicator's asynchronous error
    return work.exception() != nullptr;
  });
  if (failed == nullptr) return nullptr;
  return context_->phase_failed(failed->phase, failed->segment, device_work_.segments,
                                failed->work->exception());
}

std::exception_ptr StreamWork::timed_out(std::chrono::milliseconds after) const {
  const PhaseWork* late =
      first_phase([](c10d::Work& work) { return !work.isCompleted(); });
  // Every phase has ended and the copy of the result is what is left: name the last phase.
  const PhaseWork& phase = late != nullptr ? *late : device_work_.phases.back();
  return context_->phase_timed_out(phase.phase, phase.segment, device_work_.segments, after);
}

}  // namespace torch_bigbatch::torus
