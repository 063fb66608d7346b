#include "torus/torus_work.h"

#include "torus/callback_threads.h"
#include "torus/deadline.h"

#include <c10/core/DeviceGuard.h>
#include <c10/core/StreamGuard.h>
#include <c10/util/Exception.h>

namespace torch_bigbatch::torus {

namespace {

std::vector<c10::Device> future_devices(const std::optional<c10::Stream>& completion) {
  if (!completion) return {};
  return {completion->device()};
}

}  // namespace

TorusWork::TorusWork(int rank, c10d::OpType op_type, std::vector<at::Tensor> outputs,
                     std::shared_ptr<DeliveryOrder> order, std::optional<c10::Stream> completion)
    : c10d::Work(rank, op_type, "torus", outputs),
      outputs_(std::move(outputs)),
      order_(std::move(order)),
      ticket_(order_ ? order_->ticket() : std::nullopt),
      completion_(completion),
      future_(c10::make_intrusive<c10::ivalue::Future>(
          c10::ListType::create(c10::TensorType::get()), future_devices(completion))) {}

TorusWork::~TorusWork() {
  if (ticket_ && !delivered_) order_->done(*ticket_);  // never delivered: the next one's turn
}

void TorusWork::complete() {
  if (claim()) end(nullptr);
}

void TorusWork::fail(const std::exception_ptr& error) {
  if (claim()) end(error);
}

void TorusWork::on_settled(std::function<void(const std::exception_ptr&)> hook) {
  std::unique_lock<std::mutex> lock(mutex_);
  if (!ended_) {
    settled_hook_ = std::move(hook);
    return;
  }
  const std::exception_ptr error = error_;
  lock.unlock();
  hook(error);
}

void TorusWork::end(std::exception_ptr error) {
  bool waited;
  std::function<void(const std::exception_ptr&)> hook;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    error_ = error;
    ended_ = true;
    waited = waiting_ > 0;  // a waiter that times out first leaves 0 behind (wait())
    hook = std::move(settled_hook_);
  }
  cv_.notify_all();
  if (hook) hook(error);
  if (!waited) hand_over();
}

// The callback thread may drop the last reference to a CUDA Work, and a callback thread's
// current device is GPU 0 without its context (a stream guard restores it with MaybeSetDevice):
// destroying an event of GPU k there switches to k and back with cudaSetDevice, which creates
// GPU 0's context (hundreds of MB on GPU 0 for every rank of another GPU). On the events' own
// device that switch does nothing, and the guard restores the thread's device as it found it.
void TorusWork::hand_over() {
  run_on_callback_thread([self = c10::intrusive_ptr<TorusWork>::reclaim_copy(this)]() mutable {
    self->deliver();
    std::optional<c10::DeviceGuard> on_its_device;
    try {
      if (self->completion_) on_its_device.emplace(self->completion_->device());
    } catch (...) {  // (a device in error: released where the thread is)
    }
    self.reset();
  });
}

void TorusWork::deliver() {
  if (delivered_) return;  // by a callback that waited for it, out of turn
  const bool in_turn = !ticket_ || order_->wait_turn_unless_late(*ticket_);
  deliver_now(in_turn ? nullptr : order_->late());
}

bool TorusWork::deliver_by(Clock::time_point until) {
  if (delivered_) return true;
  if (ticket_ && !order_->wait_turn(*ticket_, until)) return false;
  deliver_now(nullptr);
  return true;
}

void TorusWork::deliver_now(const std::exception_ptr& late) {
  if (delivered_.exchange(true)) return;
  if (ticket_) order_->delivering(*ticket_);
  // Collectives its callbacks issue on this backend are not queued behind it.
  const DeliveryOrder::Delivering delivering(order_.get());
  std::exception_ptr error = settled_error();
  if (!error) error = late;
  std::optional<c10::StreamGuard> on_completion;
  if (completion_) on_completion.emplace(*completion_);
  try {  // a callback that throws must not leave wait() waiting
    if (error) {
      future_->setError(error);
    } else {
      future_->markCompleted(c10::IValue(outputs_));
    }
  } catch (...) {
    if (!error) error = std::current_exception();
  }
  finish(error);
  if (ticket_) order_->done(*ticket_);
}

std::exception_ptr TorusWork::settled_error() {
  std::lock_guard<std::mutex> lock(mutex_);
  return error_;
}

bool TorusWork::wait_until_ended(std::optional<Clock::time_point> until) {
  std::unique_lock<std::mutex> lock(mutex_);
  ++waiting_;
  const auto ended = [this] { return ended_; };  // completed_ comes later (deliver())
  if (until) {
    cv_.wait_until(lock, *until, ended);
  } else {
    cv_.wait(lock, ended);
  }
  --waiting_;  // a waiter that gave up leaves end() to hand the Work to a callback thread
  return ended_;
}

bool TorusWork::delivered_by(std::optional<Clock::time_point> until) {
  if (!until) {
    deliver();
  } else if (!deliver_by(*until)) {
    hand_over();  // end() left it to this thread, which may not wait longer
    return false;
  }
  std::unique_lock<std::mutex> lock(mutex_);  // for the thread at it, if another one is
  const auto delivered = [this] { return completed_; };
  if (!until) {
    cv_.wait(lock, delivered);
    return true;
  }
  return cv_.wait_until(lock, *until, delivered);
}

bool TorusWork::wait(std::chrono::milliseconds timeout) {
  std::optional<Clock::time_point> until;
  if (timeout != kNoTimeout) until = deadline_after(Clock::now(), timeout);
  // As c10d::Work::wait says a timeout.
  TORCH_CHECK(wait_until_ended(until) && delivered_by(until), "Operation timed out!");
  return c10d::Work::wait(kNoTimeout);  // raises its failure
}

}  // namespace torch_bigbatch::torus
