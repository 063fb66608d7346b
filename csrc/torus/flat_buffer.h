// The one flat, padded buffer a torus allreduce works on: the tensor itself when it is
// contiguous and its length divides by X, else a copy (non-contiguous views, lengths not
// divisible by X, allreduce_coalesced) written back when the collective ends.
#pragma once

#include <ATen/ATen.h>

#include <vector>

namespace torch_bigbatch::torus {

class FlatBuffer {
 public:
  FlatBuffer() = default;
  // `tensors` share one dtype and device; the flat length is a multiple of `multiple`.
  FlatBuffer(std::vector<at::Tensor> tensors, int64_t multiple);

  void copy_out();  // the result back into the tensors, when `flat` is a copy

  at::Tensor flat;

 private:
  std::vector<at::Tensor> tensors_;
  bool is_copy_ = false;
};

}  // namespace torch_bigbatch::torus
