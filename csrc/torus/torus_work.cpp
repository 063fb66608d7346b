#include "torus/torus_work.h"

namespace torch_bigbatch::torus {

TorusWork::TorusWork(int rank, c10d::OpType op_type, std::vector<at::Tensor> outputs)
    : c10d::Work(rank, op_type, "torus", outputs),
      outputs_(std::move(outputs)),
      future_(c10::make_intrusive<c10::ivalue::Future>(
          c10::ListType::create(c10::TensorType::get()))) {}

void TorusWork::complete() {
  future_->markCompleted(c10::IValue(outputs_));
  finish();
}

void TorusWork::fail(const std::exception_ptr& error) {
  if (future_->completed()) return;  // a later failure of the backend: this op was done
  future_->setError(error);
  finish(error);
}

}  // namespace torch_bigbatch::torus
