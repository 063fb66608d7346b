// The order in which a backend's Works end for their callers: the order they were issued in.
// A future's callbacks may issue collectives (PowerSGD's DDP hook does, for each bucket), and
// the ranks must issue those in one order too: ended on whichever callback thread was free,
// two Works that ended together ran their callbacks at once, and their collectives reached
// the group in another order on each rank (silently wrong sums of the same size; a size
// mismatch that aborted the process under PowerSGD with several buckets).
#pragma once

#include <condition_variable>
#include <cstdint>
#include <mutex>
#include <optional>
#include <set>

namespace torch_bigbatch::torus {

class DeliveryOrder {
 public:
  // The Work's place in the order, or none for a Work issued while this thread delivers
  // another (a callback's own collective): it ends as soon as it can, since the callback that
  // issued it may wait for it.
  std::optional<uint64_t> ticket();
  // Blocks until every earlier ticket is done; returns at once on a thread that delivers a Work
  // already (a callback that waits for a later Work would otherwise wait for itself).
  void wait_turn(uint64_t ticket);
  // The ticket's delivery has ended (or will never happen: a Work dropped unsettled).
  void done(uint64_t ticket);

  // Set on a thread while it delivers a Work (runs its future's callbacks).
  class Delivering {
   public:
    Delivering();
    ~Delivering();

   private:
    bool outer_;
  };

 private:
  std::mutex mutex_;
  std::condition_variable turn_;
  uint64_t issued_ = 0, next_ = 0;
  std::set<uint64_t> ended_early_;  // done, with an earlier ticket not yet done
};

}  // namespace torch_bigbatch::torus
