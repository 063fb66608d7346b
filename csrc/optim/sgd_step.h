#pragma once
// One call of the fused SGD/LARS step, as raw pointers: what the ATen glue hands to the CPU
// and CUDA kernels. Torch-free.

#include <cstdint>
#include <vector>

#include "sgd_math.h"

namespace torch_bigbatch::optim {

struct SgdTensor {
  void* param;
  const void* grad;
  void* buffer;  // null when the step carries no momentum buffers
  int64_t numel;
  int group;     // index into SgdStep::groups
};

struct SgdStep {
  ElementType dtype = ElementType::Float32;
  std::vector<SgdTensor> tensors;
  std::vector<SgdGroup> groups;
  const float* grad_scale = nullptr;  // AMP: gradients are divided by *grad_scale
  const float* found_inf = nullptr;   // AMP: the whole step is skipped when *found_inf != 0
  BufferMode buffer_mode = BufferMode::None;

  bool uses_lars() const {
    for (const SgdTensor& t : tensors)
      if (groups[t.group].trust_coefficient != 0.f) return true;
    return false;
  }
};

}  // namespace torch_bigbatch::optim
