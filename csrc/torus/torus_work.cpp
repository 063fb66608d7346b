#include "torus/torus_work.h"

#include "torus/callback_threads.h"

#include <c10/core/StreamGuard.h>

namespace torch_bigbatch::torus {

namespace {

std::vector<c10::Device> future_devices(const std::optional<c10::Stream>& completion) {
  if (!completion) return {};
  return {completion->device()};
}

}  // namespace

TorusWork::TorusWork(int rank, c10d::OpType op_type, std::vector<at::Tensor> outputs,
                     std::optional<c10::Stream> completion)
    : c10d::Work(rank, op_type, "torus", outputs),
      outputs_(std::move(outputs)),
      completion_(completion),
      future_(c10::make_intrusive<c10::ivalue::Future>(
          c10::ListType::create(c10::TensorType::get()), future_devices(completion))) {}

void TorusWork::complete() {
  if (claim()) end(nullptr);
}

void TorusWork::fail(const std::exception_ptr& error) {
  if (claim()) end(error);
}

void TorusWork::end(std::exception_ptr error) {
  run_on_callback_thread([self = c10::intrusive_ptr<TorusWork>::reclaim_copy(this),
              error = std::move(error)] {
    std::optional<c10::StreamGuard> on_completion;
    if (self->completion_) on_completion.emplace(*self->completion_);
    try {  // a callback that throws must not leave wait() waiting
      if (error) {
        self->future_->setError(error);
      } else {
        self->future_->markCompleted(c10::IValue(self->outputs_));
      }
    } catch (...) {
      self->finish(error ? error : std::current_exception());
      return;
    }
    self->finish(error);
  });
}

}  // namespace torch_bigbatch::torus
