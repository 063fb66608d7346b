#pragma once
// One call of the fused SGD/LARS step as raw pointers, and its math, shared by the CPU and the
// CUDA kernels. Torch-free: plain structs and floats; the update is a template over the number
// type so the CPU kernel runs it on SIMD vectors of floats and the CUDA kernel on single floats.

#include <cstdint>
#include <vector>

#include "common/multi_tensor.h"
#include "common/portable.h"

namespace torch_bigbatch::optim {

// One parameter group, named as torch.optim.SGD names its hyperparameters, plus LARS.
struct SgdGroup {
  float lr = 0.f;
  const float* lr_ptr = nullptr;  // a one-element float32 tensor on the step's device, or null
  float momentum = 0.f;
  // Extra factor on the buffer's decay: eta_{t-1} / eta_t for Goyal et al.'s eq. (10) without
  // the momentum correction (see torch_bigbatch/optim/sgd.py), otherwise 1.
  float momentum_scale = 1.f;
  float dampening = 0.f;
  float weight_decay = 0.f;
  bool nesterov = false;
  bool maximize = false;
  float trust_coefficient = 0.f;  // LARS; 0 leaves the group unadapted
  float trust_eps = 0.f;
  bool trust_clip = false;
};

enum class BufferMode : int { None, First, Update };

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
  // Update mode only: when *first_step_pending != 0 the buffers have never taken a step (every
  // earlier one was skipped by found_inf), so this step initialises them as a first step.
  const float* first_step_pending = nullptr;

  bool uses_lars() const {
    for (const SgdTensor& t : tensors)
      if (groups[t.group].trust_coefficient != 0.f) return true;
    return false;
  }
};

// The buffer mode a kernel applies; it reads the pending flag on the device, not the host.
BB_HOST_DEVICE BufferMode effective_mode(BufferMode mode, const float* first_step_pending) {
  return mode == BufferMode::Update && first_step_pending != nullptr && *first_step_pending != 0.f
             ? BufferMode::First
             : mode;
}

// The scalars of one tensor's update in one step, broadcast to the kernel's number type.
template <typename V>
struct SgdScalars {
  V grad_factor;   // (maximize ? -1 : 1) / grad_scale
  V weight_decay;
  V trust;         // LARS trust ratio; 1 for plain SGD
  V buffer_decay;  // momentum * momentum_scale
  V grad_weight;   // 1 - dampening
  V momentum;
  V lr;
  bool decays;  // weight_decay != 0: only then is wd * p added, as torch adds it (0 * inf = NaN)
};

// torch.optim.SGD's update (with LARS's trust ratio on the decayed gradient):
//   d = r * (g + wd * p);  b = d (first step) or mu*b + (1-tau)*d;
//   p = p - lr * (nesterov ? d + mu*b : b)
template <typename V>
BB_HOST_DEVICE V sgd_update(V param, V grad, V& buffer, const SgdScalars<V>& s, BufferMode mode,
                            bool nesterov) {
  V d = grad * s.grad_factor;
  if (s.decays) d = d + s.weight_decay * param;
  d = s.trust * d;
  if (mode != BufferMode::None) {
    buffer = mode == BufferMode::First ? d : s.buffer_decay * buffer + s.grad_weight * d;
    d = nesterov ? d + s.momentum * buffer : buffer;
  }
  return param - s.lr * d;
}

// LARS (You et al. 2017): lr_local = lr * trust, trust = tc*|p| / (|g| + wd*|p| + eps),
// 1 where either norm is 0 or the group is excluded; optionally clipped at 1.
BB_HOST_DEVICE float lars_trust_ratio(float param_norm, float grad_norm, const SgdGroup& group) {
  if (group.trust_coefficient == 0.f || param_norm == 0.f || grad_norm == 0.f) return 1.f;
  float trust = group.trust_coefficient * param_norm /
                (grad_norm + group.weight_decay * param_norm + group.trust_eps);
  return group.trust_clip && trust > 1.f ? 1.f : trust;
}

// Scalars shared by every element of one tensor. `lr` is read by the caller (from lr_ptr on
// the device) and `inv_grad_scale` is 1 / grad_scale, or 1 when gradients are not scaled.
BB_HOST_DEVICE SgdScalars<float> sgd_scalars(const SgdGroup& group, float lr, float inv_grad_scale,
                                            float trust) {
  SgdScalars<float> s;
  s.grad_factor = group.maximize ? -inv_grad_scale : inv_grad_scale;
  s.weight_decay = group.weight_decay;
  s.trust = trust;
  s.buffer_decay = group.momentum * group.momentum_scale;
  s.grad_weight = 1.f - group.dampening;
  s.momentum = group.momentum;
  s.lr = lr;
  s.decays = group.weight_decay != 0.f;
  return s;
}

}  // namespace torch_bigbatch::optim
