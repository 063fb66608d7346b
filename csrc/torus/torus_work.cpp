#include "torus/torus_work.h"

#include "torus/callback_threads.h"

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
  if (!waited)
    run_on_callback_thread([self = c10::intrusive_ptr<TorusWork>::reclaim_copy(this)] {
      self->deliver();
    });
}

void TorusWork::deliver() {
  if (delivered_.exchange(true)) return;
  if (ticket_) order_->wait_turn(*ticket_);  // the Works issued before this one ended first
  const DeliveryOrder::Delivering delivering;  // collectives its callbacks issue are not queued
  std::exception_ptr error;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    error = error_;
  }
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

bool TorusWork::wait(std::chrono::milliseconds timeout) {
  {
    std::unique_lock<std::mutex> lock(mutex_);
    ++waiting_;
    const auto ended = [this] { return ended_; };  // completed_ comes later (deliver())
    if (timeout == kNoTimeout) {
      cv_.wait(lock, ended);
    } else {
      cv_.wait_for(lock, timeout, ended);
    }
    --waiting_;
    TORCH_CHECK(ended_, "Operation timed out!");  // as c10d::Work::wait says it
  }
  deliver();  // here, unless another thread is at it: then the wait below is for its end
  return c10d::Work::wait(kNoTimeout);
}

}  // namespace torch_bigbatch::torus
