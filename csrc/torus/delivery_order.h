// The order in which a backend's Works end for their callers: the order they were issued in.
// A future's callbacks may issue collectives (PowerSGD's DDP hook does, for each bucket), and
// the ranks must issue those in one order too: ended on whichever callback thread was free,
// two Works that ended together ran their callbacks at once, and their collectives reached
// the group in another order on each rank (silently wrong sums of the same size; a size
// mismatch that aborted the process under PowerSGD with several buckets).
#pragma once

#include "torus/backend_failure.h"

#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <exception>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <set>

namespace torch_bigbatch::torus {

class DeliveryOrder {
 public:
  using Clock = std::chrono::steady_clock;

  // `timeout`: the process group's; how long the callbacks of the Work whose turn it is may
  // run before the Works after it end anyway, with late()'s error, which is the backend's
  // failure (`failure`): a rank whose Work ended so would pair its next calls with other ones.
  DeliveryOrder(std::chrono::milliseconds timeout, std::shared_ptr<BackendFailure> failure)
      : timeout_(timeout), failure_(std::move(failure)) {}

  // The Work's place in the order, or none for a Work issued while this thread delivers
  // another of this order (a callback's own collective): it ends as soon as it can, since the
  // callback that issued it may wait for it.
  std::optional<uint64_t> ticket();
  // Blocks until every earlier ticket is done (true), or until `until` (false). Returns true at
  // once on a thread that delivers a Work of this order already: a callback that waits for a
  // later Work delivers it itself, out of turn, or it would wait for itself.
  bool wait_turn(uint64_t ticket, Clock::time_point until);
  // The same without a limit of the caller's: false once the Work whose turn it is has run its
  // callbacks for the timeout (a collective still running ends by its own timeout).
  bool wait_turn_unless_late(uint64_t ticket);
  // The ticket's callbacks start (its Work is delivered).
  void delivering(uint64_t ticket);
  // The ticket's delivery has ended (or will never happen: a Work dropped unsettled).
  void done(uint64_t ticket);
  // The error of a Work whose turn did not come (wait_turn_unless_late), recorded as the
  // backend's failure: an earlier Work's callback has not returned (one that waits for this
  // Work's future, say, which only this Work's delivery completes: a permanent hang otherwise).
  std::exception_ptr late();

  // Marks a thread, while it delivers a Work of `order` (runs its future's callbacks), as
  // delivering that order's Works: another backend's Works, issued or waited for there, keep
  // their places in their own order (their callbacks may issue collectives too).
  class Delivering {
   public:
    explicit Delivering(const DeliveryOrder* order);
    ~Delivering();
  };

 private:
  bool delivering_here() const;  // this thread delivers a Work of this order

  const std::chrono::milliseconds timeout_;
  const std::shared_ptr<BackendFailure> failure_;
  std::mutex mutex_;
  std::condition_variable turn_;
  uint64_t issued_ = 0, next_ = 0;
  std::set<uint64_t> ended_early_;  // done, with an earlier ticket not yet done
  std::map<uint64_t, Clock::time_point> delivering_since_;  // callbacks running, not yet done
};

}  // namespace torch_bigbatch::torus
