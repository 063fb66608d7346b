#include "torus/thread_activity.h"

#include <condition_variable>
#include <cstdint>
#include <mutex>

namespace torch_bigbatch::torus::thread_activity {

namespace {

struct Activity {
  std::mutex mutex;
  std::condition_variable idle;
  int64_t tasks = 0;
};

// Never destroyed: threads may still report to it while statics end.
Activity& activity() {
  static auto* state = new Activity;
  return *state;
}

}  // namespace

void started() {
  std::lock_guard<std::mutex> lock(activity().mutex);
  ++activity().tasks;
}

void finished() {
  Activity& state = activity();
  {
    std::lock_guard<std::mutex> lock(state.mutex);
    --state.tasks;
  }
  state.idle.notify_all();
}

bool wait_until_idle(std::chrono::milliseconds timeout) {
  Activity& state = activity();
  std::unique_lock<std::mutex> lock(state.mutex);
  return state.idle.wait_for(lock, timeout, [&] { return state.tasks == 0; });
}

}  // namespace torch_bigbatch::torus::thread_activity
