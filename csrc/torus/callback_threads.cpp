#include "torus/callback_threads.h"

#include "torus/thread_activity.h"

#include <chrono>
#include <condition_variable>
#include <deque>
#include <mutex>
#include <thread>

namespace torch_bigbatch::torus {

namespace {

// A thread idle this long ends; the next task that finds none idle starts one again.
constexpr std::chrono::seconds kIdleEnd{30};

struct CallbackThreads {
  std::mutex mutex;
  std::condition_variable ready;
  std::deque<std::function<void()>> tasks;
  size_t idle = 0;  // threads waiting for a task: each takes one
};

// Never destroyed: its threads are detached and may still wait on it while statics end.
CallbackThreads& callback_threads() {
  static auto* threads = new CallbackThreads;
  return *threads;
}

void serve(CallbackThreads& threads) {
  std::unique_lock<std::mutex> lock(threads.mutex);
  while (true) {
    ++threads.idle;
    const bool has_task =
        threads.ready.wait_for(lock, kIdleEnd, [&] { return !threads.tasks.empty(); });
    --threads.idle;
    if (!has_task) return;
    std::function<void()> task = std::move(threads.tasks.front());
    threads.tasks.pop_front();
    lock.unlock();
    task();
    task = nullptr;  // what it holds (a Work, its tensors) is released before the next wait
    thread_activity::finished();
    lock.lock();
  }
}

}  // namespace

void run_on_callback_thread(std::function<void()> task) {
  CallbackThreads& threads = callback_threads();
  thread_activity::started();
  std::lock_guard<std::mutex> lock(threads.mutex);
  threads.tasks.push_back(std::move(task));
  if (threads.idle >= threads.tasks.size()) {
    threads.ready.notify_one();
  } else {
    std::thread(serve, std::ref(threads)).detach();
  }
}

}  // namespace torch_bigbatch::torus
