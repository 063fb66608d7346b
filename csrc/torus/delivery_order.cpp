#include "torus/delivery_order.h"

namespace torch_bigbatch::torus {

namespace {
thread_local bool delivering = false;
}  // namespace

DeliveryOrder::Delivering::Delivering() : outer_(!delivering) { delivering = true; }

DeliveryOrder::Delivering::~Delivering() {
  if (outer_) delivering = false;
}

std::optional<uint64_t> DeliveryOrder::ticket() {
  if (delivering) return std::nullopt;
  std::lock_guard<std::mutex> lock(mutex_);
  return issued_++;
}

void DeliveryOrder::wait_turn(uint64_t ticket) {
  if (delivering) return;
  std::unique_lock<std::mutex> lock(mutex_);
  turn_.wait(lock, [&] { return next_ == ticket; });
}

void DeliveryOrder::done(uint64_t ticket) {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    ended_early_.insert(ticket);
    while (!ended_early_.empty() && *ended_early_.begin() == next_) {
      ended_early_.erase(ended_early_.begin());
      ++next_;
    }
  }
  turn_.notify_all();
}

}  // namespace torch_bigbatch::torus
