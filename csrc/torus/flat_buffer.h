// The one flat, padded buffer a torus allreduce works on: the tensor itself when it is
// contiguous and its length divides by X, else a copy (non-contiguous views, lengths not
// divisible by X, allreduce_coalesced), filled by copy_in() and written back when the
// collective ends.
#pragma once

#include <ATen/ATen.h>

#include <utility>
#include <vector>

namespace torch_bigbatch::torus {

class FlatBuffer {
 public:
  FlatBuffer() = default;
  // `tensors` share one dtype and device; the flat length is a multiple of `multiple`.
  FlatBuffer(std::vector<at::Tensor> tensors, int64_t multiple);

  void copy_in();   // the tensors into `flat`, when it is a copy (a separate step: the device
                    // pipeline orders it after the engine's earlier collectives)
  void copy_out();  // the result back into the tensors, when `flat` is a copy

  // (begin, length) of the pipelining segments of `flat`: about segment_bytes each, and a
  // whole number of elements per row member (lengths are multiples of `multiple`).
  std::vector<std::pair<int64_t, int64_t>> segments(int64_t segment_bytes) const;

  at::Tensor flat;

 private:
  std::vector<at::Tensor> tensors_;
  int64_t multiple_ = 1;
  bool is_copy_ = false;
};

}  // namespace torch_bigbatch::torus
