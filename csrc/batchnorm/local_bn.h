#pragma once
// One pass of local (ghost) BatchNorm as raw pointers: what the ATen glue hands to the CPU and
// CUDA kernels, and the per-(group, channel) math both share. Torch-free.
//
// The input is viewed as [N, C, S] (S: the product of the spatial sizes). Samples are split
// into consecutive groups of group_size; a tail of one sample joins the group before it (a
// group of one sample has no variance). Both passes run the same four steps:
//   1. per (sample, channel): over its S values
//        forward   their mean m and sum of squared deviations M2, in two passes (the mean,
//                  then sum(d) and sum(d^2) with d = x - mean, the second pass from cache)
//        backward  sum(dy), sum(dy * d)   with d = x - mean[g, c]
//   2. per (group, channel): its samples' values give the group's statistics (forward: their
//      means and M2s merged as Chan et al.'s parallel variance does, the means taken relative
//      to the group's first sample's center) or gradient sums (backward), and the
//      coefficients of step 4
//   3. per channel: the averages over groups of the group means and unbiased variances, which
//      the running statistics move towards (forward), or grad_weight and grad_bias (backward)
//   4. per element, with v = x - mean[g, c]: y = a v + c (forward), dx = a dy + b v + c
//      (backward); centering first keeps float exact where |mean| is large against the spread
// Centering each sample at its own mean keeps the variance accurate in float whatever the
// data: no sum of squares cancels against a large mean or an outlying value (a one-pass sum
// shifted by the group's first value lost 1e-3 to 1e-2 of the variance to one outlier there).
// The merge never rounds a sample's mean to float: a center is kept apart from the mean's
// offset from it, and centers are subtracted from each other exactly (rounding each sample's
// mean, as before, lost 2e-5 of the variance where |mean| = 1e4 std, 2e-3 at 1e6).

#include <cmath>
#include <cstdint>

#include "common/portable.h"

namespace torch_bigbatch::batchnorm {

struct BnLayout {
  int64_t batch = 0, channels = 0, spatial = 0;  // N, C, S
  bool channels_last = false;  // memory order [N, S, C] rather than [N, C, S]
  int64_t group_size = 0;      // samples per group
  int64_t groups = 0;          // group_count(batch, group_size)

  BB_HOST_DEVICE int64_t group_of(int64_t n) const {
    const int64_t g = n / group_size;
    return g < groups ? g : groups - 1;
  }
  BB_HOST_DEVICE int64_t group_begin(int64_t g) const { return g * group_size; }
  BB_HOST_DEVICE int64_t group_end(int64_t g) const {
    return g == groups - 1 ? batch : (g + 1) * group_size;
  }
  BB_HOST_DEVICE int64_t index(int64_t n, int64_t c, int64_t s) const {
    return channels_last ? (n * spatial + s) * channels + c : (n * channels + c) * spatial + s;
  }
};

// Groups of group_size samples; a tail of one sample joins the last full group.
BB_HOST_DEVICE int64_t group_count(int64_t batch, int64_t group_size) {
  const int64_t groups = batch / group_size + (batch % group_size >= 2 ? 1 : 0);
  return groups > 0 ? groups : 1;
}

// Every tensor of a pass. "acc" is the accumulation type: double for double inputs, else float.
struct BnPass {
  BnLayout layout;
  ElementType dtype = ElementType::Float32;
  bool backward = false;
  const void* input = nullptr;        // x
  const void* grad_output = nullptr;  // dy (backward), laid out like x
  void* result = nullptr;             // y (forward) or dx (backward), laid out like x
  const void* weight = nullptr;       // [C] acc, or null for 1
  const void* bias = nullptr;         // [C] acc, or null for 0 (forward)
  void* mean = nullptr;               // [G, C] acc: written by the forward, read by the backward
  void* invstd = nullptr;             // [G, C] acc: 1 / sqrt(biased variance + eps)
  void* average_mean = nullptr;       // [C] acc: the groups' average mean (forward)
  void* average_var = nullptr;        // [C] acc: the groups' average unbiased variance (forward)
  void* grad_weight = nullptr;        // [C] acc (backward)
  void* grad_bias = nullptr;          // [C] acc (backward)
  double eps = 1e-5;
  // Scratch, acc: step 1's values [N, C, kSampleValues], step 2's per-group values for step 3
  // [G, C, 2]
  // and step 4's coefficients [3, G, C] (a, b, c; the centers are `mean`).
  void* sample_sums = nullptr;
  void* group_values = nullptr;
  void* coefficients = nullptr;
};

// Step 4's coefficients, one [G, C] table each (the centers are the `mean` table).
template <typename A>
struct Coefficients {
  A* a;
  A* b;
  A* c;
};
template <typename A>
BB_HOST_DEVICE Coefficients<A> coefficients_of(const BnPass& p) {
  A* tables = static_cast<A*>(p.coefficients);
  const int64_t table = p.layout.groups * p.layout.channels;
  return {tables, tables + table, tables + 2 * table};
}

// Step 1's values per (sample, channel): forward, its center, its mean's offset from the
// center and its M2 (sample_moments); backward, sum(dy) and sum(dy d) (the third unused).
constexpr int64_t kSampleValues = 3;
template <typename A>
BB_HOST_DEVICE A* sample_values(const BnPass& p, int64_t nc) {  // nc = n * C + c
  return static_cast<A*>(p.sample_sums) + kSampleValues * nc;
}

template <typename A>
BB_HOST_DEVICE bool is_finite(A x) { return x - x == A(0); }

// Step 1's values of one (sample, channel) from its S values' first-pass mean `center` and
// second-pass sums of d = x - center: the center, the mean's offset from it (the mean is
// their sum, not rounded here) and the sum of squared deviations (M2), corrected for the
// rounding of `center`.
// An infinite center (an inf among the values) is the mean itself, as in nn.BatchNorm; its d
// are inf or NaN, so M2 is NaN there, as nn.BatchNorm's variance is. Finite values whose
// squares overflow give an infinite M2, as nn.BatchNorm's variance is (sum * sum overflowed
// too: inf - inf was NaN); (sum d)^2 / n <= sum d^2, so sum * (sum / count) does not.
template <typename A>
BB_HOST_DEVICE void sample_moments(A* out, A center, A sum, A sum_squares, A count) {
  out[0] = center;
  out[1] = is_finite(center) ? sum / count : A(0);
  out[2] = is_finite(sum_squares) ? sum_squares - sum * (sum / count) : sum_squares;
}

// Step 2's merge of a group's samples, forward, relative to a reference: its first sample's
// center (0 where that is not finite, so an inf center stays the mean). The group's mean is
// reference + the mean of the samples' offsets, its M2 the sum of merged_m2 over its samples.
template <typename A>
BB_HOST_DEVICE A group_reference(const BnPass& p, int64_t group, int64_t c) {
  const A center = sample_values<A>(p, p.layout.group_begin(group) * p.layout.channels + c)[0];
  return is_finite(center) ? center : A(0);
}
// A sample's mean minus the reference: the centers' difference is exact in float where they
// are close, and the offsets are small.
template <typename A>
BB_HOST_DEVICE A sample_offset(const A* moments, A reference) {
  return (moments[0] - reference) + moments[1];
}
// A sample's part of its group's M2: its own plus S times its mean's distance from the group's.
template <typename A>
BB_HOST_DEVICE A merged_m2(const A* moments, A reference, A mean_offset, A spatial) {
  const A shift = sample_offset(moments, reference) - mean_offset;
  return moments[2] + spatial * shift * shift;
}

// Step 2 of one (group, channel), forward, from its mean and M2 over `count` values: the
// statistics, the values step 3 averages (mean, unbiased variance) and y = a (x - mean) + c.
template <typename A>
BB_HOST_DEVICE void group_forward(const BnPass& p, int64_t gc, int64_t c, A mean, A m2,
                                  A count) {
  A variance = m2 / count;
  variance = variance < A(0) ? A(0) : variance;  // rounding below 0; NaN stays NaN
  const A invstd = A(1) / sqrt(variance + A(p.eps));
  const A weight = p.weight != nullptr ? static_cast<const A*>(p.weight)[c] : A(1);
  const A bias = p.bias != nullptr ? static_cast<const A*>(p.bias)[c] : A(0);
  static_cast<A*>(p.mean)[gc] = mean;
  static_cast<A*>(p.invstd)[gc] = invstd;
  A* values = static_cast<A*>(p.group_values) + 2 * gc;
  values[0] = mean;
  values[1] = variance * count / (count - A(1));
  const Coefficients<A> coefficients = coefficients_of<A>(p);
  coefficients.a[gc] = weight * invstd;
  coefficients.c[gc] = bias;
}

// Backward, from sum(dy) and sum(dy (x - mean)): the parts of grad_bias and grad_weight, and
//   dx = w invstd (dy - mean(dy) - (x - mean) invstd^2 mean(dy (x - mean)))
//      = a dy + b (x - mean) + c.
template <typename A>
BB_HOST_DEVICE void group_backward(const BnPass& p, int64_t gc, int64_t c, A sum_dy, A sum_dy_xmu,
                                   A count) {
  const A invstd = static_cast<const A*>(p.invstd)[gc];
  const A weight = p.weight != nullptr ? static_cast<const A*>(p.weight)[c] : A(1);
  A* values = static_cast<A*>(p.group_values) + 2 * gc;
  values[0] = sum_dy;
  values[1] = sum_dy_xmu * invstd;
  const A a = weight * invstd;
  const A projection = sum_dy_xmu / count * invstd * invstd;
  const Coefficients<A> coefficients = coefficients_of<A>(p);
  coefficients.a[gc] = a;
  coefficients.b[gc] = -a * projection;
  coefficients.c[gc] = -a * (sum_dy / count);
}

// Step 3 of channel c from the sums over groups of its two group values.
template <typename A>
BB_HOST_DEVICE void channel_step(const BnPass& p, int64_t c, A first, A second) {
  if (p.backward) {
    static_cast<A*>(p.grad_bias)[c] = first;
    static_cast<A*>(p.grad_weight)[c] = second;
  } else {
    // nn.BatchNorm moves its running statistics towards its one batch's mean and unbiased
    // variance; with groups, towards their averages.
    const A groups = A(p.layout.groups);
    static_cast<A*>(p.average_mean)[c] = first / groups;
    static_cast<A*>(p.average_var)[c] = second / groups;
  }
}

}  // namespace torch_bigbatch::batchnorm
