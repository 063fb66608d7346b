#include "torus/delivery_order.h"

#include "torus/deadline.h"

#include <c10/util/Exception.h>
#include <c10/util/StringUtil.h>

#include <algorithm>
#include <vector>

namespace torch_bigbatch::torus {

namespace {
// The orders whose Works this thread delivers, innermost last (a callback may deliver a Work
// of another backend, waiting for it).
thread_local std::vector<const DeliveryOrder*> delivering_orders;
}  // namespace

DeliveryOrder::Delivering::Delivering(const DeliveryOrder* order) {
  delivering_orders.push_back(order);
}

DeliveryOrder::Delivering::~Delivering() { delivering_orders.pop_back(); }

bool DeliveryOrder::delivering_here() const {
  return std::find(delivering_orders.begin(), delivering_orders.end(), this) !=
         delivering_orders.end();
}

std::optional<uint64_t> DeliveryOrder::ticket() {
  if (delivering_here()) return std::nullopt;
  std::lock_guard<std::mutex> lock(mutex_);
  return issued_++;
}

bool DeliveryOrder::wait_turn(uint64_t ticket, Clock::time_point until) {
  if (delivering_here()) return true;
  std::unique_lock<std::mutex> lock(mutex_);
  // `>`: the ticket was delivered out of turn (done() passes over it).
  return turn_.wait_until(lock, until, [&] { return next_ >= ticket; });
}

bool DeliveryOrder::wait_turn_unless_late(uint64_t ticket) {
  if (delivering_here()) return true;
  std::unique_lock<std::mutex> lock(mutex_);
  while (next_ < ticket) {
    const auto head = delivering_since_.find(next_);
    if (head == delivering_since_.end()) {
      turn_.wait(lock);  // its collective is still running; delivering() and done() notify
    } else if (Clock::now() >= deadline_after(head->second, timeout_)) {
      return false;
    } else {
      turn_.wait_until(lock, deadline_after(head->second, timeout_));
    }
  }
  return true;
}

void DeliveryOrder::delivering(uint64_t ticket) {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    delivering_since_.emplace(ticket, Clock::now());
  }
  turn_.notify_all();
}

void DeliveryOrder::done(uint64_t ticket) {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    delivering_since_.erase(ticket);
    ended_early_.insert(ticket);
    while (!ended_early_.empty() && *ended_early_.begin() == next_) {
      ended_early_.erase(ended_early_.begin());
      ++next_;
    }
  }
  turn_.notify_all();
}

std::exception_ptr DeliveryOrder::late() {
  auto error = std::make_exception_ptr(C10_BUILD_ERROR(
      DistBackendError,
      c10::str("torus: the callbacks of an earlier collective of this group ran longer than the "
               "timeout (", timeout_.count(), " ms) while this collective waited for them (its "
               "callbacks run after theirs, in the order the collectives were issued); a "
               "callback that waits for a later collective's future waits for ever: wait for "
               "its Work (work.wait()) instead")));
  failure_->record(error);
  return failure_->first();
}

}  // namespace torch_bigbatch::torus
