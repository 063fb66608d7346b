#pragma once
// The kernels' ElementType of an ATen tensor, shared by the ops' argument checks.

#include <ATen/ATen.h>

#include "common/portable.h"

namespace torch_bigbatch {

// A TypeError naming `what` (for example "torch_bigbatch::sgd_step_: parameters") for any other
// dtype; float64 only where the op has double kernels.
inline ElementType element_type(const at::Tensor& t, bool accept_double, const char* what) {
  switch (t.scalar_type()) {
    case at::kFloat: return ElementType::Float32;
    case at::kHalf: return ElementType::Float16;
    case at::kBFloat16: return ElementType::BFloat16;
    case at::kDouble:
      if (accept_double) return ElementType::Float64;
      break;
    default: break;
  }
  TORCH_CHECK_TYPE(false, what, " must be ",
                   accept_double ? "float32, float16, bfloat16 or float64" :
                                   "float32, float16 or bfloat16", ", got ", t.scalar_type());
}

}  // namespace torch_bigbatch
