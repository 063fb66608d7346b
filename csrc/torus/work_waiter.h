// A thread that waits for Works that have no future to call back from (Gloo's send and recv),
// batch after batch in the order given, and then runs each batch's continuation. The host
// pipeline's direct exchanges use it, one per phase: their sends and receives move each part
// from and into its place, where Gloo's alltoall needed a staged copy of every region on both
// sides, but they have no callback to post the next phase from.
#pragma once

#include "torus/backend_failure.h"

#include <torch/csrc/distributed/c10d/Work.hpp>

#include <condition_variable>
#include <deque>
#include <exception>
#include <functional>
#include <memory>
#include <mutex>
#include <thread>
#include <vector>

namespace torch_bigbatch::torus {

// Stops a Work's waiting (Gloo's send and recv); a Work without abort() is left as it is.
void abort_quietly(const c10::intrusive_ptr<c10d::Work>& work);

class WorkWaiter {
 public:
  // Gets the first failure of a batch's Works (nullptr: all ended well); may throw, which is
  // swallowed (it must end its call itself).
  using Then = std::function<void(const std::exception_ptr&)>;

  WorkWaiter();
  ~WorkWaiter();  // fails the batches not yet waited for, without waiting for them
  WorkWaiter(const WorkWaiter&) = delete;
  WorkWaiter& operator=(const WorkWaiter&) = delete;

  // Each Work's wait() is bounded by its group's timeout. After a failure the batch's other
  // Works are aborted, not waited for: a dead peer costs one timeout, not one per Work.
  void wait_then(std::vector<c10::intrusive_ptr<c10d::Work>> works, Then then);

  // From the backend's first failure on, the batch being waited for is aborted and later ones
  // end with that failure at once: after a peer died, each batch queued behind the failed one
  // (other segments and calls) waited a timeout of its own (65-180 s for a 5 s timeout).
  void stop_at_failure(const std::shared_ptr<BackendFailure>& failure);

 private:
  struct Batch {
    std::vector<c10::intrusive_ptr<c10d::Work>> works;
    Then then;
  };
  struct Queue {
    std::mutex mutex;
    std::condition_variable ready;
    std::deque<Batch> batches;
    bool stopping = false;
    std::shared_ptr<BackendFailure> failure;                // see stop_at_failure
    std::vector<c10::intrusive_ptr<c10d::Work>> waiting;  // the batch being waited for
  };
  static void run(const std::shared_ptr<Queue>& queue);
  // Waits for one batch and runs its continuation (`stopping`: aborts it instead).
  static void settle(Queue& queue, Batch& batch, bool stopping);

  std::shared_ptr<Queue> queue_;  // shared with the thread: it may outlive this object (below)
  std::thread thread_;
};

}  // namespace torch_bigbatch::torus
