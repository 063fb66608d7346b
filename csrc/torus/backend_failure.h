// The first failure of a torus backend's allreduces, shared by its host pipeline, its device
// pipeline and its algorithm tuner. After it the backend refuses every allreduce, on every
// path: the groups' message sequences may differ between ranks then, and a later message could
// pair with the wrong peer's.
#pragma once

#include <exception>
#include <functional>
#include <mutex>
#include <vector>

namespace torch_bigbatch::torus {

class BackendFailure {
 public:
  void record(const std::exception_ptr& error);  // keeps the first
  std::exception_ptr first() const;
  // Calls `listener` once, at the first failure (at once if there was one); it must not throw.
  void on_failure(std::function<void()> listener);
  // Throws "torus backend is unusable after an earlier failure: <its message>" after one.
  void check_usable() const;

 private:
  mutable std::mutex mutex_;
  std::exception_ptr failure_;
  std::vector<std::function<void()>> listeners_;  // until the first failure
};

}  // namespace torch_bigbatch::torus
