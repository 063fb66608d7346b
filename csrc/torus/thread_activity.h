// The tasks of this package's own threads (callback threads, the host pipeline's phase
// threads, the device pipeline's watcher) that may still release what Python owns: a future's
// Python callback, the tensors of a Work whose result Python read. At interpreter exit Python
// waits for them (an atexit hook, torch_bigbatch/distributed/torus.py): a thread that takes
// the GIL while the interpreter finalizes is ended inside a destructor, and the process aborts
// (std::terminate; a job whose every call had ended exited with SIGABRT in 4 of 16 runs).
#pragma once

#include <chrono>

namespace torch_bigbatch::torus::thread_activity {

void started();   // a task was handed to one of the threads
void finished();  // that task has ended and released what it held

// Waits until no task is left, or `timeout` (calls still in flight may never end); true when
// none is left.
bool wait_until_idle(std::chrono::milliseconds timeout);

}  // namespace torch_bigbatch::torus::thread_activity
