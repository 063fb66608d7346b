#include "torus/backend_failure.h"

#include "torus/topology.h"

#include <c10/util/Exception.h>

namespace torch_bigbatch::torus {

void BackendFailure::record(const std::exception_ptr& error) {
  std::vector<std::function<void()>> listeners;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    if (failure_) return;
    failure_ = error;
    listeners.swap(listeners_);
  }
  for (const auto& listener : listeners) listener();
}

void BackendFailure::on_failure(std::function<void()> listener) {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    if (!failure_) {
      listeners_.push_back(std::move(listener));
      return;
    }
  }
  listener();
}

std::exception_ptr BackendFailure::first() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return failure_;
}

void BackendFailure::check_usable() const {
  if (const std::exception_ptr error = first()) {
    TORCH_CHECK_WITH(DistBackendError, false,
                     "torus backend is unusable after an earlier failure: ", message_of(error));
  }
}

}  // namespace torch_bigbatch::torus
