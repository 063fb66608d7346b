#include "torus/delegated_work.h"

#include "torus/topology.h"

#include <c10/core/impl/VirtualGuardImpl.h>
#include <c10/util/Exception.h>

namespace torch_bigbatch::torus {
namespace {

// The engine's error as a DistBackendError whose message starts with `context`.
std::exception_ptr named(const std::string& context, const std::exception_ptr& error) {
  if (!error) return error;
  return std::make_exception_ptr(C10_BUILD_ERROR(DistBackendError, context + message_of(error)));
}

}  // namespace

DelegatedWork::DelegatedWork(c10::intrusive_ptr<c10d::Work> engine_work, std::string context,
                             std::shared_ptr<c10::Event> copied_back)
    : c10d::Work(-1, engine_work->retrieveOpType()),
      work_(std::move(engine_work)),
      context_(std::move(context)),
      copied_back_(std::move(copied_back)) {}

void DelegatedWork::follow_the_copy_back() const {
  if (!copied_back_) return;
  const c10::Device device(copied_back_->device_type(), copied_back_->device_index());
  copied_back_->block(c10::impl::VirtualGuardImpl(device.type()).getStream(device));
}

void DelegatedWork::synchronize() {
  work_->synchronize();
  follow_the_copy_back();
}

void DelegatedWork::blockCurrentStream() {
  work_->blockCurrentStream();
  follow_the_copy_back();
}

std::exception_ptr DelegatedWork::exception() const { return named(context_, work_->exception()); }

bool DelegatedWork::wait(std::chrono::milliseconds timeout) {
  bool ended = false;
  try {
    ended = work_->wait(timeout);
  } catch (...) {
    std::rethrow_exception(named(context_, std::current_exception()));
  }
  follow_the_copy_back();
  return ended;
}

c10::intrusive_ptr<c10::ivalue::Future> DelegatedWork::getFuture() {
  std::lock_guard<std::mutex> lock(future_mutex_);
  if (!future_) {
    auto engine_future = work_->getFuture();
    future_ = engine_future->then(
        [context = context_](c10::ivalue::Future& done) -> c10::IValue {
          if (done.hasError()) std::rethrow_exception(named(context, done.exception_ptr()));
          return done.value();
        },
        engine_future->elementType());
  }
  return future_;
}

}  // namespace torch_bigbatch::torus
