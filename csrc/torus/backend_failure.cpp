#include "torus/backend_failure.h"

#include "torus/topology.h"

#include <c10/util/Exception.h>

namespace torch_bigbatch::torus {

void BackendFailure::record(const std::exception_ptr& error) {
  std::lock_guard<std::mutex> lock(mutex_);
  if (!failure_) failure_ = error;
}

std::exception_ptr BackendFailure::first() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return failure_;
}

void BackendFailure::check_usable() const {
  if (const std::exception_ptr error = first()) {
    TORCH_CHECK(false, "torus backend is unusable after an earlier failure: ", message_of(error));
  }
}

}  // namespace torch_bigbatch::torus
