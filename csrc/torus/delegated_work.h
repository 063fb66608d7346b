// The Work of a collective the torus hands to its whole group as it is (broadcast, allgather,
// barrier, ...): the engine's own Work, whose failure says which torus collective failed and
// where, as the torus's own phases do: "torus broadcast failed in the broadcast of the whole
// group (rank 1 at x=1, y=0 of a 2x2 torus): <the engine's message>". Without it a link fault
// that strikes during DDP's buffer broadcast surfaces as a bare Gloo timeout.
#pragma once

#include <ATen/core/ivalue.h>
#include <c10/core/Event.h>
#include <torch/csrc/distributed/c10d/Work.hpp>

#include <memory>
#include <mutex>
#include <string>

namespace torch_bigbatch::torus {

class DelegatedWork : public c10d::Work {
 public:
  // context: what a failure message starts with, up to the engine's message. copied_back: where
  // the result goes back into the caller's tensors on the issuing stream after the engine's
  // collective (a layout NCCL refuses), the copy's end: a wait on another stream, which the
  // engine's Work orders after the collective only, waits for it too.
  DelegatedWork(c10::intrusive_ptr<c10d::Work> engine_work, std::string context,
                std::shared_ptr<c10::Event> copied_back = nullptr);

  bool isCompleted() override { return work_->isCompleted(); }
  bool isSuccess() const override { return work_->isSuccess(); }
  std::exception_ptr exception() const override;
  int sourceRank() const override { return work_->sourceRank(); }
  std::vector<at::Tensor> result() override { return work_->result(); }
  void synchronize() override;
  bool wait(std::chrono::milliseconds timeout) override;
  void blockCurrentStream() override;
  void abort() override { work_->abort(); }
  c10::intrusive_ptr<c10::ivalue::Future> getFuture() override;

 private:
  void follow_the_copy_back() const;  // the current stream of its device waits for it

  const c10::intrusive_ptr<c10d::Work> work_;
  const std::string context_;
  const std::shared_ptr<c10::Event> copied_back_;
  std::mutex future_mutex_;
  c10::intrusive_ptr<c10::ivalue::Future> future_;  // made on first request: not every engine
                                                    // Work has a future
};

}  // namespace torch_bigbatch::torus
