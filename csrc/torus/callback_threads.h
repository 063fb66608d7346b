// Where torus Works end: their futures' callbacks run on threads of this package's, and a task
// that finds none of them idle starts another. A callback may wait for a later collective
// (PowerSGD's DDP hook does), whose end must then not queue behind it: torch's inter-op pool,
// which these ends used before, has a fixed number of threads (one after
// set_num_interop_threads(1)), and callbacks holding all of them waited for ever.
#pragma once

#include <functional>

namespace torch_bigbatch::torus {

// Runs `task` on an idle callback thread, or on a new one. `task` must not throw.
void run_on_callback_thread(std::function<void()> task);

}  // namespace torch_bigbatch::torus
