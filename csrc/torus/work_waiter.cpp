#include "torus/work_waiter.h"

#include "torus/thread_activity.h"

#include <stdexcept>

namespace torch_bigbatch::torus {

void abort_quietly(const c10::intrusive_ptr<c10d::Work>& work) {
  try {
    work->abort();
  } catch (...) {
  }
}

namespace {

std::exception_ptr wait_all(const std::vector<c10::intrusive_ptr<c10d::Work>>& works) {
  for (size_t k = 0; k < works.size(); ++k) {
    try {
      works[k]->wait();
    } catch (...) {
      for (size_t j = k + 1; j < works.size(); ++j) abort_quietly(works[j]);
      return std::current_exception();
    }
  }
  return nullptr;
}

void run_then(const WorkWaiter::Then& then, const std::exception_ptr& error) {
  try {
    then(error);
  } catch (...) {  // `then` ends its call itself; nothing is left to tell here
  }
}

}  // namespace

WorkWaiter::WorkWaiter() : queue_(std::make_shared<Queue>()) {
  thread_ = std::thread(run, queue_);
}

WorkWaiter::~WorkWaiter() {
  {
    std::lock_guard<std::mutex> lock(queue_->mutex);
    queue_->stopping = true;
  }
  queue_->ready.notify_all();
  // The last owner of the pipeline can be a continuation on this very thread.
  if (thread_.get_id() == std::this_thread::get_id()) {
    thread_.detach();
  } else {
    thread_.join();
  }
}

void WorkWaiter::wait_then(std::vector<c10::intrusive_ptr<c10d::Work>> works, Then then) {
  thread_activity::started();
  {
    std::lock_guard<std::mutex> lock(queue_->mutex);
    queue_->batches.push_back(Batch{std::move(works), std::move(then)});
  }
  queue_->ready.notify_one();
}

void WorkWaiter::stop_at_failure(const std::shared_ptr<BackendFailure>& failure) {
  {
    std::lock_guard<std::mutex> lock(queue_->mutex);
    queue_->failure = failure;
  }
  failure->on_failure([weak = std::weak_ptr<Queue>(queue_)] {
    const std::shared_ptr<Queue> queue = weak.lock();
    if (!queue) return;
    std::lock_guard<std::mutex> lock(queue->mutex);
    for (const auto& work : queue->waiting) abort_quietly(work);
  });
}

void WorkWaiter::run(const std::shared_ptr<Queue>& queue) {
  while (true) {
    Batch batch;
    bool stopping;
    {
      std::unique_lock<std::mutex> lock(queue->mutex);
      queue->ready.wait(lock, [&] { return queue->stopping || !queue->batches.empty(); });
      if (queue->batches.empty()) return;
      batch = std::move(queue->batches.front());
      queue->batches.pop_front();
      stopping = queue->stopping;
    }
    settle(*queue, batch, stopping);
    batch = Batch{};  // what it held (the call, its Work and tensors) is released here
    thread_activity::finished();
  }
}

void WorkWaiter::settle(Queue& queue, Batch& batch, bool stopping) {
  if (stopping) {
    for (auto& work : batch.works) abort_quietly(work);
    run_then(batch.then, std::make_exception_ptr(std::runtime_error(
                             "the torus backend was destroyed before this call ended")));
    return;
  }
  std::exception_ptr failed;  // the backend's failure, seen before waiting
  {
    std::lock_guard<std::mutex> lock(queue.mutex);
    failed = queue.failure ? queue.failure->first() : nullptr;
    if (!failed) queue.waiting = batch.works;  // the failure's listener aborts them
  }
  if (failed) {
    for (auto& work : batch.works) abort_quietly(work);
    return run_then(batch.then, failed);
  }
  std::exception_ptr error = wait_all(batch.works);
  {
    std::lock_guard<std::mutex> lock(queue.mutex);
    queue.waiting.clear();
    // Aborted because of another batch's failure: that one is the cause to report.
    if (error && queue.failure && queue.failure->first()) error = queue.failure->first();
  }
  run_then(batch.then, error);
}

}  // namespace torch_bigbatch::torus
