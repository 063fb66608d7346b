// The Work a torus collective returns: wait (with timeout), isCompleted, exception and result
// come from c10d::Work, and getFuture holds the output tensors, as DDP's reducer expects. The
// device pipeline's StreamWork derives from it.
#pragma once

#include <ATen/core/ivalue.h>
#include <c10/core/Stream.h>
#include <torch/csrc/distributed/c10d/Work.hpp>

#include <atomic>
#include <optional>
#include <vector>

namespace torch_bigbatch::torus {

class TorusWork : public c10d::Work {
 public:
  // `completion`, for outputs on a device: a stream of that device on which the future
  // records its events.
  TorusWork(int rank, c10d::OpType op_type, std::vector<at::Tensor> outputs,
            std::optional<c10::Stream> completion = std::nullopt);

  // The first of complete() and fail() settles the Work (a later failure of the backend finds
  // it done). Either returns at once: the Work ends on a callback thread
  // (callback_threads.h), where its future's callbacks run, never on the thread that saw the
  // collective end. A callback may wait for another collective (PowerSGD's DDP hook does),
  // and on a thread of the torus it would wait for that very thread, for ever.
  void complete();
  virtual void fail(const std::exception_ptr& error);
  bool settled() const { return settled_; }

  std::vector<at::Tensor> result() override { return outputs_; }
  c10::intrusive_ptr<c10::ivalue::Future> getFuture() override { return future_; }

 protected:
  bool claim() { return !settled_.exchange(true); }  // true for the first caller only
  void end(std::exception_ptr error);                // after claim(): on a callback thread

  const std::vector<at::Tensor> outputs_;

 private:
  const std::optional<c10::Stream> completion_;
  const c10::intrusive_ptr<c10::ivalue::Future> future_;
  std::atomic<bool> settled_{false};
};

}  // namespace torch_bigbatch::torus
