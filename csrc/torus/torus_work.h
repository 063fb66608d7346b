// The Work a torus collective returns when its phases complete on the host: wait (with
// timeout), isCompleted, exception and result come from c10d::Work, and getFuture holds the
// output tensors, as DDP's reducer expects.
#pragma once

#include <ATen/core/ivalue.h>
#include <torch/csrc/distributed/c10d/Work.hpp>

#include <vector>

namespace torch_bigbatch::torus {

class TorusWork : public c10d::Work {
 public:
  TorusWork(int rank, c10d::OpType op_type, std::vector<at::Tensor> outputs);

  void complete();
  void fail(const std::exception_ptr& error);

  std::vector<at::Tensor> result() override { return outputs_; }
  c10::intrusive_ptr<c10::ivalue::Future> getFuture() override { return future_; }

 private:
  std::vector<at::Tensor> outputs_;
  c10::intrusive_ptr<c10::ivalue::Future> future_;
};

}  // namespace torch_bigbatch::torus
