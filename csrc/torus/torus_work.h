// The Work a torus collective returns: isCompleted, exception and result come from c10d::Work,
// wait (with timeout) too, except that the waiting thread ends the Work itself; getFuture
// holds the output tensors, as DDP's reducer expects. The device pipeline's StreamWork derives
// from it (with its own wait).
#pragma once

#include "torus/delivery_order.h"

#include <ATen/core/ivalue.h>
#include <c10/core/Stream.h>
#include <torch/csrc/distributed/c10d/Work.hpp>

#include <atomic>
#include <functional>
#include <memory>
#include <optional>
#include <vector>

namespace torch_bigbatch::torus {

class TorusWork : public c10d::Work {
 public:
  // `order`: the backend's, in which its Works end (delivery_order.h). `completion`, for
  // outputs on a device: a stream of that device on which the future records its events.
  TorusWork(int rank, c10d::OpType op_type, std::vector<at::Tensor> outputs,
            std::shared_ptr<DeliveryOrder> order,
            std::optional<c10::Stream> completion = std::nullopt);
  ~TorusWork() override;

  // The first of complete() and fail() settles the Work (a later failure of the backend finds
  // it done). Either returns at once: the Work ends, and its future's callbacks run, on a
  // thread that waits for it in wait(), or else on a callback thread (callback_threads.h),
  // never on the thread that saw the collective end. A callback may wait for another
  // collective (PowerSGD's DDP hook does), and on a thread of the torus it would wait for that
  // very thread, for ever.
  void complete();
  virtual void fail(const std::exception_ptr& error);
  bool settled() const { return settled_; }

  // Runs `hook` (one per Work) with the failure, or null, as soon as the collective has ended,
  // on the thread that saw it end (at once if it has), before the callers hear of it: their
  // turn comes in the backend's delivery order, which the tuner's timing must not wait for.
  void on_settled(std::function<void(const std::exception_ptr&)> hook);

  // c10d::Work::wait, except that the waiting thread ends the Work itself once the collective
  // has ended and its turn has come: one thread handoff fewer than through a callback thread.
  // Bounded by `timeout` (the wait for its turn too).
  bool wait(std::chrono::milliseconds timeout = kNoTimeout) override;

  std::vector<at::Tensor> result() override { return outputs_; }
  c10::intrusive_ptr<c10::ivalue::Future> getFuture() override { return future_; }

 protected:
  using Clock = DeliveryOrder::Clock;

  bool claim() { return !settled_.exchange(true); }  // true for the first caller only
  void end(std::exception_ptr error);                // after claim()
  // Until the collective has ended (settled), or `until` (none: no limit); whether it has.
  bool wait_until_ended(std::optional<Clock::time_point> until);
  // After the collective has ended: until the Work has ended for its callers (its future and
  // then the Work), here if its turn comes first (without `until`, or late: see deliver()), or
  // on the thread already at it. False when `until` came first: a callback thread ends it in
  // its turn.
  bool delivered_by(std::optional<Clock::time_point> until);
  std::exception_ptr settled_error();  // the collective's failure, once ended

  const std::vector<at::Tensor> outputs_;

 private:
  // The Work's end for its callers, once, on whichever thread comes first. deliver() waits for
  // its turn, or ends it with the order's late() error once the Work whose turn it is has run
  // its callbacks for the timeout; deliver_by(until) gives up at `until` and returns false. The
  // turn comes before the claim: a thread that claimed and then waited for its turn blocked a
  // callback that waits for this Work, for ever.
  void deliver();
  bool deliver_by(Clock::time_point until);
  void deliver_now(const std::exception_ptr& late);
  void hand_over();  // deliver() on a callback thread

  const std::shared_ptr<DeliveryOrder> order_;
  const std::optional<uint64_t> ticket_;
  const std::optional<c10::Stream> completion_;
  const c10::intrusive_ptr<c10::ivalue::Future> future_;
  std::atomic<bool> settled_{false};
  std::atomic<bool> delivered_{false};
  // Under c10d::Work's mutex_: end() has run (with error_), and the threads inside wait().
  bool ended_ = false;
  std::exception_ptr error_;
  std::function<void(const std::exception_ptr&)> settled_hook_;
  int waiting_ = 0;
};

}  // namespace torch_bigbatch::torus
