// Deadlines from timeouts, bounded: a timeout meant as "never" (timedelta(days=36500), say)
// added to steady_clock's int64 nanoseconds, or to a deadline of the same timeout, overflowed
// into a deadline in the past, and the call failed at once.
#pragma once

#include <algorithm>
#include <chrono>

namespace torch_bigbatch::torus {

// `wait` after `start`, at most 50 years after it: sums of a few such deadlines stay far from
// the clock's end (292 years).
inline std::chrono::steady_clock::time_point deadline_after(
    std::chrono::steady_clock::time_point start, std::chrono::milliseconds wait) {
  constexpr std::chrono::milliseconds kFarEnough = std::chrono::hours(24 * 365 * 50);
  return start + std::min(wait, kFarEnough);
}

}  // namespace torch_bigbatch::torus
