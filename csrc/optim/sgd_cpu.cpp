// CPU kernel of torch_bigbatch::sgd_step_: one parallel loop over the chunks of every tensor,
// each chunk updated with ATen's SIMD vectors (float math for every storage type).

#include <ATen/Parallel.h>

#include <cmath>

#include "common/cpu_vectors.h"
#include "sgd_op.h"

namespace torch_bigbatch::optim {
namespace {

using Vec = at::vec::Vectorized<float>;
constexpr int64_t kChunk = 16384;  // elements per work item of the parallel loop

SgdScalars<Vec> broadcast(const SgdScalars<float>& s) {
  return {Vec(s.grad_factor), Vec(s.weight_decay), Vec(s.trust),   Vec(s.buffer_decay),
          Vec(s.grad_weight), Vec(s.momentum),     Vec(s.lr),    s.decays};
}

// The loop with the buffer mode and Nesterov as constants, so that no branch stays inside it.
template <typename T, BufferMode kMode, bool kNesterov>
void update_range(const SgdTensor& t, int64_t begin, int64_t end, const SgdScalars<float>& scalars) {
  constexpr int64_t kStep = 2 * Vec::size();
  const SgdScalars<Vec> s = broadcast(scalars);
  T* param = static_cast<T*>(t.param);
  const T* grad = static_cast<const T*>(t.grad);
  T* buffer = static_cast<T*>(t.buffer);
  for (int64_t i = begin; i < end; i += kStep) {
    const int64_t count = std::min(kStep, end - i);
    Vec p[2], g[2], b[2] = {Vec(0.f), Vec(0.f)};
    load_pair(param + i, count, p[0], p[1]);
    load_pair(grad + i, count, g[0], g[1]);
    if (kMode == BufferMode::Update) load_pair(buffer + i, count, b[0], b[1]);
    for (int k = 0; k < 2; ++k) p[k] = sgd_update(p[k], g[k], b[k], s, kMode, kNesterov);
    store_pair(param + i, count, p[0], p[1]);
    if (kMode != BufferMode::None) store_pair(buffer + i, count, b[0], b[1]);
  }
}

template <typename T>
void update_range(const SgdTensor& t, int64_t begin, int64_t end, const SgdScalars<float>& s,
                  BufferMode mode, bool nesterov) {
  switch (mode) {
    case BufferMode::None: return update_range<T, BufferMode::None, false>(t, begin, end, s);
    case BufferMode::First:
      return nesterov ? update_range<T, BufferMode::First, true>(t, begin, end, s)
                      : update_range<T, BufferMode::First, false>(t, begin, end, s);
    case BufferMode::Update:
      return nesterov ? update_range<T, BufferMode::Update, true>(t, begin, end, s)
                      : update_range<T, BufferMode::Update, false>(t, begin, end, s);
  }
}

// Sums of squares of the parameter and of the unscaled gradient over [begin, end). Unscaled
// before squaring: a scaled gradient's squares can overflow float where its values do not.
template <typename T>
std::pair<float, float> sum_squares(const SgdTensor& t, int64_t begin, int64_t end,
                                    float inv_grad_scale) {
  constexpr int64_t kStep = 2 * Vec::size();
  const Vec unscale(inv_grad_scale);
  Vec pp(0.f), gg(0.f);
  for (int64_t i = begin; i < end; i += kStep) {
    const int64_t count = std::min(kStep, end - i);
    Vec p[2], g[2];
    load_pair(static_cast<const T*>(t.param) + i, count, p[0], p[1]);
    load_pair(static_cast<const T*>(t.grad) + i, count, g[0], g[1]);
    for (int k = 0; k < 2; ++k) {
      const Vec gk = g[k] * unscale;
      pp = at::vec::fmadd(p[k], p[k], pp);
      gg = at::vec::fmadd(gk, gk, gg);
    }
  }
  return {at::vec::vec_reduce_all<float>(std::plus<Vec>(), pp),
          at::vec::vec_reduce_all<float>(std::plus<Vec>(), gg)};
}

// Calls body(tensor, chunk, first element, end element) for every chunk, in parallel.
template <typename Body>
void for_each_chunk(const SgdStep& step, const std::vector<int64_t>& offsets, const Body& body) {
  const int n = static_cast<int>(step.tensors.size());
  at::parallel_for(0, offsets.back(), 1, [&](int64_t first, int64_t last) {
    for (int64_t c = first; c < last; ++c) {
      const int t = tensor_of_chunk(offsets.data(), n, c);
      const int64_t begin = (c - offsets[t]) * kChunk;
      body(t, c, begin, std::min(begin + kChunk, step.tensors[t].numel));
    }
  });
}

template <typename T>
void run_sgd_cpu_typed(const SgdStep& step) {
  if (step.found_inf != nullptr && *step.found_inf != 0.f) return;
  const BufferMode mode = effective_mode(step.buffer_mode, step.first_step_pending);
  const float inv_grad_scale = step.grad_scale != nullptr ? 1.f / *step.grad_scale : 1.f;
  const size_t n = step.tensors.size();
  std::vector<int64_t> numels;
  for (const SgdTensor& t : step.tensors) numels.push_back(t.numel);
  const std::vector<int64_t> offsets = chunk_offsets(numels, kChunk);

  std::vector<float> trust(n, 1.f);
  if (step.uses_lars()) {
    // Per-chunk partial sums, then a fixed-order sum per tensor: deterministic norms.
    std::vector<std::pair<float, float>> partial(offsets.back());
    for_each_chunk(step, offsets, [&](int t, int64_t c, int64_t begin, int64_t end) {
      if (step.groups[step.tensors[t].group].trust_coefficient != 0.f)
        partial[c] = sum_squares<T>(step.tensors[t], begin, end, inv_grad_scale);
    });
    for (size_t t = 0; t < n; ++t) {
      double pp = 0, gg = 0;
      for (int64_t c = offsets[t]; c < offsets[t + 1]; ++c) {
        pp += partial[c].first;
        gg += partial[c].second;
      }
      trust[t] = lars_trust_ratio(static_cast<float>(std::sqrt(pp)),
                                  static_cast<float>(std::sqrt(gg)),
                                  step.groups[step.tensors[t].group]);
    }
  }

  for_each_chunk(step, offsets, [&](int t, int64_t, int64_t begin, int64_t end) {
    const SgdGroup& group = step.groups[step.tensors[t].group];
    const float lr = group.lr_ptr != nullptr ? *group.lr_ptr : group.lr;
    update_range<T>(step.tensors[t], begin, end, sgd_scalars(group, lr, inv_grad_scale, trust[t]),
                    mode, group.nesterov);
  });
}

void run_sgd_cpu(const SgdStep& step, at::TensorList) {
  switch (step.dtype) {
    case ElementType::Float32: return run_sgd_cpu_typed<float>(step);
    case ElementType::Float16: return run_sgd_cpu_typed<at::Half>(step);
    case ElementType::BFloat16: return run_sgd_cpu_typed<at::BFloat16>(step);
    case ElementType::Float64: break;  // the op refuses it
  }
}

const SgdLaunchers::Register kCpu(c10::DeviceType::CPU, &run_sgd_cpu);

}  // namespace
}  // namespace torch_bigbatch::optim
