#include "torus/work_waiter.h"

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
  {
    std::lock_guard<std::mutex> lock(queue_->mutex);
    queue_->batches.push_back(Batch{std::move(works), std::move(then)});
  }
  queue_->ready.notify_one();
}

void WorkWaiter::run(const std::shared_ptr<Queue>& queue) {
  while (true) {
    Batch batch;
    {
      std::unique_lock<std::mutex> lock(queue->mutex);
      queue->ready.wait(lock, [&] { return queue->stopping || !queue->batches.empty(); });
      if (queue->batches.empty()) return;
      batch = std::move(queue->batches.front());
      queue->batches.pop_front();
      if (queue->stopping) {
        lock.unlock();
        for (auto& work : batch.works) abort_quietly(work);
        run_then(batch.then, std::make_exception_ptr(std::runtime_error(
                                 "the torus backend was destroyed before this call ended")));
        continue;
      }
    }
    run_then(batch.then, wait_all(batch.works));
  }
}

}  // namespace torch_bigbatch::torus
