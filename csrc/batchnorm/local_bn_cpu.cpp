// CPU kernels of local BatchNorm: the four steps of local_bn.h, each one parallel loop with
// ATen's SIMD vectors. Step 1 reads the input once from memory (the forward's second pass over
// a sample's values finds them in cache); step 4 reads it once more and writes.

#include <ATen/Parallel.h>

#include "batchnorm/local_bn_op.h"
#include "common/cpu_vectors.h"

namespace torch_bigbatch::batchnorm {
namespace {

// Rows accumulated in registers before they are added to the running totals: two-level sums
// keep float's rounding error near (128 + rows / 128) ulp instead of rows ulp.
constexpr int64_t kBlockRows = 128;

// One pass on the CPU: its pointers in their types, and the four steps.
template <typename T, bool kBackward>
class CpuPass {
 public:
  explicit CpuPass(const BnPass& pass)
      : p(pass),
        L(pass.layout),
        input(static_cast<const T*>(pass.input)),
        grad_output(static_cast<const T*>(pass.grad_output)),
        result(static_cast<T*>(pass.result)),
        mean(static_cast<const A*>(pass.mean)),
        coefficients(coefficients_of<A>(pass)) {}

  void run() const {
    if (L.channels_last)
      sample_sums_channels_last();
    else
      sample_sums_rows();
    group_and_channel_steps();
    apply_coefficients();
  }

 private:
  using A = cpu_acc_t<T>;
  using Vec = AccVec<T>;
  static constexpr int64_t kStep = 2 * Vec::size();  // elements per iteration: two vectors

  // Step 1 in [N, C, S] memory: each (sample, channel) row of S values is contiguous.
  void sample_sums_rows() const {
    at::parallel_for(0, L.batch * L.channels, std::max<int64_t>(1, 32768 / L.spatial),
                     [&](int64_t first, int64_t last) {
      for (int64_t row = first; row < last; ++row) {
        const int64_t n = row / L.channels, c = row % L.channels, g = L.group_of(n);
        const T* x = input + row * L.spatial;
        const A center = kBackward ? mean[g * L.channels + c] : row_mean(x);
        const Vec k(center);
        const T* dy = kBackward ? grad_output + row * L.spatial : nullptr;
        Vec total[4] = {Vec(A(0)), Vec(A(0)), Vec(A(0)), Vec(A(0))};  // q1 and q2, lo and hi
        const auto join = [&](Vec(&q)[4]) {
          for (int i = 0; i < 4; ++i) total[i] = total[i] + q[i];
        };
        blocked_sums<4>([&](int64_t s, int64_t count, Vec(&q)[4]) {
          Vec d[2];
          load_pair(x + s, count, d[0], d[1]);
          d[0] = d[0] - k;
          d[1] = d[1] - k;
          if (kBackward) {
            Vec g2[2];
            load_pair(dy + s, count, g2[0], g2[1]);  // zeros past count: the products are 0
            for (int h = 0; h < 2; ++h) {
              q[h] = q[h] + g2[h];
              q[2 + h] = at::vec::fmadd(g2[h], d[h], q[2 + h]);
            }
          } else {
            if (count < kStep) {  // lanes past count hold 0 - center
              d[0] = Vec::set(Vec(A(0)), d[0], std::min<int64_t>(count, Vec::size()));
              d[1] = Vec::set(Vec(A(0)), d[1], std::max<int64_t>(count - Vec::size(), 0));
            }
            for (int h = 0; h < 2; ++h) {
              q[h] = q[h] + d[h];
              q[2 + h] = at::vec::fmadd(d[h], d[h], q[2 + h]);
            }
          }
        }, join);
        const A q1 = at::vec::vec_reduce_all<A>(std::plus<Vec>(), total[0] + total[1]);
        const A q2 = at::vec::vec_reduce_all<A>(std::plus<Vec>(), total[2] + total[3]);
        store_sample(sample_values<A>(p, row), center, q1, q2);
      }
    });
  }

  // Sums over a row of S contiguous values: body(s, count, q) adds the kStep values from s
  // (count of them inside the row) into the partial sums q, which join(q) adds to the totals
  // every kBlockRows steps (two-level sums: a single running sum lost precision as S grew:
  // 2.3e-4 relative error in the variance at S = 2^25, against 2.1e-6 channels-last).
  template <int K, typename Body, typename Join>
  void blocked_sums(Body body, Join join) const {
    for (int64_t block = 0; block < L.spatial; block += kBlockRows * kStep) {
      Vec q[K];
      for (auto& sum : q) sum = Vec(A(0));
      const int64_t end = std::min(block + kBlockRows * kStep, L.spatial);
      for (int64_t s = block; s < end; s += kStep) body(s, std::min(kStep, L.spatial - s), q);
      join(q);
    }
  }

  // The mean of a row of S contiguous values (the forward's first pass), its blocks' sums
  // totalled in double: with a mean far above the spread (1e6 times) and millions of values,
  // a float total drifted by hundreds of spreads, and the second pass's M2 = sum d^2 -
  // (sum d)^2 / n then cancelled (the variance 1e-3 off at S = 2^24, channels-last 6x).
  A row_mean(const T* x) const {
    double total = 0;
    blocked_sums<2>([&](int64_t s, int64_t count, Vec(&q)[2]) {
      Vec v[2];  // past count, load_pair gives zeros
      load_pair(x + s, count, v[0], v[1]);
      q[0] = q[0] + v[0];
      q[1] = q[1] + v[1];
    }, [&](Vec(&q)[2]) { total += at::vec::vec_reduce_all<A>(std::plus<Vec>(), q[0] + q[1]); });
    return A(total / double(L.spatial));
  }

  // Step 1's values of a (sample, channel): sums of dy and dy d (backward), or the sample's
  // center, mean offset and M2 from the sums of d and d^2 (forward).
  void store_sample(A* out, A center, A q1, A q2) const {
    if constexpr (kBackward) {
      out[0] = q1;
      out[1] = q2;
    } else {
      sample_moments<A>(out, center, q1, q2, A(L.spatial));
    }
  }

  // Step 1 in [N, S, C] memory: a task takes one sample and kStep channels, whose values are
  // contiguous in each of the S rows; the sums stay in registers.
  void sample_sums_channels_last() const {
    const int64_t blocks = (L.channels + kStep - 1) / kStep;
    at::parallel_for(0, L.batch * blocks, 1, [&](int64_t first, int64_t last) {
      for (int64_t task = first; task < last; ++task) {
        const int64_t n = task / blocks, c = task % blocks * kStep, g = L.group_of(n);
        const int64_t count = std::min(kStep, L.channels - c);
        Vec k[2];  // past count, k and the values load as 0: their d is 0
        if (kBackward)
          load_pair(mean + g * L.channels + c, count, k[0], k[1]);
        else
          channel_means(n, c, count, k);
        Vec total[4] = {Vec(A(0)), Vec(A(0)), Vec(A(0)), Vec(A(0))};
        for (int64_t block = 0; block < L.spatial; block += kBlockRows) {
          Vec q[4] = {Vec(A(0)), Vec(A(0)), Vec(A(0)), Vec(A(0))};
          for (int64_t s = block; s < std::min(block + kBlockRows, L.spatial); ++s) {
            const int64_t at = L.index(n, c, s);
            Vec d[2];
            load_pair(input + at, count, d[0], d[1]);
            Vec u[2];  // q1 = sum(u), q2 = sum(u d): u = dy (backward) or d (forward)
            for (int h = 0; h < 2; ++h) d[h] = d[h] - k[h];
            if constexpr (kBackward)
              load_pair(grad_output + at, count, u[0], u[1]);
            else
              u[0] = d[0], u[1] = d[1];
            for (int h = 0; h < 2; ++h) {
              q[h] = q[h] + u[h];
              q[2 + h] = at::vec::fmadd(u[h], d[h], q[2 + h]);
            }
          }
          for (int i = 0; i < 4; ++i) total[i] = total[i] + q[i];
        }
        alignas(64) A values[4][Vec::size()], centers[2][Vec::size()];
        for (int i = 0; i < 4; ++i) total[i].store(values[i]);
        for (int h = 0; h < 2; ++h) k[h].store(centers[h]);
        for (int64_t j = 0; j < count; ++j) {
          const int h = j / Vec::size(), lane = j % Vec::size();
          store_sample(sample_values<A>(p, n * L.channels + c + j), centers[h][lane],
                       values[h][lane], values[2 + h][lane]);
        }
      }
    });
  }

  // The means over the S rows of sample n's channels c .. c + count in [N, S, C] memory (the
  // forward's first pass), as two vectors; zeros past count. The blocks' sums are totalled in
  // double (see row_mean).
  void channel_means(int64_t n, int64_t c, int64_t count, Vec* means) const {
    double total[kStep] = {};
    for (int64_t block = 0; block < L.spatial; block += kBlockRows) {
      Vec q[2] = {Vec(A(0)), Vec(A(0))};
      for (int64_t s = block; s < std::min(block + kBlockRows, L.spatial); ++s) {
        Vec v[2];
        load_pair(input + L.index(n, c, s), count, v[0], v[1]);
        q[0] = q[0] + v[0];
        q[1] = q[1] + v[1];
      }
      alignas(64) A lanes[kStep];
      q[0].store(lanes);
      q[1].store(lanes + Vec::size());
      for (int64_t j = 0; j < kStep; ++j) total[j] += lanes[j];
    }
    alignas(64) A mean[kStep];
    for (int64_t j = 0; j < kStep; ++j) mean[j] = A(total[j] / double(L.spatial));
    means[0] = Vec::loadu(mean);
    means[1] = Vec::loadu(mean + Vec::size());
  }

  // Steps 2 and 3: a task per channel walks its groups, then the channel's totals.
  void group_and_channel_steps() const {
    at::parallel_for(0, L.channels, 16, [&](int64_t first, int64_t last) {
      for (int64_t c = first; c < last; ++c) {
        A first_total = 0, second_total = 0;
        for (int64_t g = 0; g < L.groups; ++g) {
          const int64_t begin = L.group_begin(g), end = L.group_end(g);
          const int64_t gc = g * L.channels + c;
          const A count = A((end - begin) * L.spatial);
          const auto sample = [&](int64_t n) { return sample_values<A>(p, n * L.channels + c); };
          if constexpr (kBackward) {
            A q1 = 0, q2 = 0;
            for (int64_t n = begin; n < end; ++n) {
              q1 += sample(n)[0];
              q2 += sample(n)[1];
            }
            group_backward<A>(p, gc, c, q1, q2, count);
          } else {  // the M2s merge around the group's mean (local_bn.h)
            const A reference = group_reference<A>(p, g, c);
            A offsets = 0, m2 = 0;
            for (int64_t n = begin; n < end; ++n) offsets += sample_offset(sample(n), reference);
            const A mean_offset = offsets / A(end - begin);
            for (int64_t n = begin; n < end; ++n)
              m2 += merged_m2(sample(n), reference, mean_offset, A(L.spatial));
            group_forward<A>(p, gc, c, reference + mean_offset, m2, count);
          }
          first_total += static_cast<const A*>(p.group_values)[2 * gc];
          second_total += static_cast<const A*>(p.group_values)[2 * gc + 1];
        }
        channel_step<A>(p, c, first_total, second_total);
      }
    });
  }

  // Step 4, with v = x - mean per (group, channel): result = a v + c (forward) or a dy + b v + c.
  void apply_coefficients() const {
    // Rows of contiguous values that share coefficients ([N, C, S]) or a group ([N, S, C]).
    const int64_t rows = L.channels_last ? L.batch * L.spatial : L.batch * L.channels;
    const int64_t length = L.channels_last ? L.channels : L.spatial;
    const int64_t grain = std::max<int64_t>(1, 32768 / length);
    at::parallel_for(0, rows, grain, [&](int64_t first, int64_t last) {
      for (int64_t row = first; row < last; ++row) {
        const T* x = input + row * length;
        const T* dy = kBackward ? grad_output + row * length : nullptr;
        T* out = result + row * length;
        if (L.channels_last) {
          const int64_t base = L.group_of(row / L.spatial) * L.channels;
          for (int64_t i = 0; i < length; i += kStep) {
            const int64_t count = std::min(kStep, length - i);
            Vec v[2], center[2], a[2], c[2], g2[2], b[2];
            load_pair(x + i, count, v[0], v[1]);
            load_pair(mean + base + i, count, center[0], center[1]);
            load_pair(coefficients.a + base + i, count, a[0], a[1]);
            load_pair(coefficients.c + base + i, count, c[0], c[1]);
            if constexpr (kBackward) {
              load_pair(dy + i, count, g2[0], g2[1]);
              load_pair(coefficients.b + base + i, count, b[0], b[1]);
            }
            for (int h = 0; h < 2; ++h) {
              v[h] = v[h] - center[h];
              if constexpr (kBackward)
                v[h] = at::vec::fmadd(a[h], g2[h], at::vec::fmadd(b[h], v[h], c[h]));
              else
                v[h] = at::vec::fmadd(a[h], v[h], c[h]);
            }
            store_pair(out + i, count, v[0], v[1]);
          }
        } else {
          const int64_t gc = L.group_of(row / L.channels) * L.channels + row % L.channels;
          const Vec a(coefficients.a[gc]), b(coefficients.b[gc]), c(coefficients.c[gc]),
              center(mean[gc]);
          for (int64_t i = 0; i < length; i += kStep) {
            const int64_t count = std::min(kStep, length - i);
            Vec v[2], g2[2];
            load_pair(x + i, count, v[0], v[1]);
            if constexpr (kBackward) load_pair(dy + i, count, g2[0], g2[1]);
            for (int h = 0; h < 2; ++h) {
              v[h] = v[h] - center;
              if constexpr (kBackward)
                v[h] = at::vec::fmadd(a, g2[h], at::vec::fmadd(b, v[h], c));
              else
                v[h] = at::vec::fmadd(a, v[h], c);
            }
            store_pair(out + i, count, v[0], v[1]);
          }
        }
      }
    });
  }

  const BnPass& p;
  const BnLayout& L;
  const T* input;
  const T* grad_output;
  T* result;
  const A* mean;
  Coefficients<A> coefficients;
};

template <typename T>
void run_typed(const BnPass& p) {
  if (p.backward)
    CpuPass<T, true>(p).run();
  else
    CpuPass<T, false>(p).run();
}

void run_local_bn_cpu(const BnPass& p, const at::Tensor&) {
  switch (p.dtype) {
    case ElementType::Float32: return run_typed<float>(p);
    case ElementType::Float16: return run_typed<at::Half>(p);
    case ElementType::BFloat16: return run_typed<at::BFloat16>(p);
    case ElementType::Float64: return run_typed<double>(p);
  }
}

const BnLaunchers::Register kCpu(c10::DeviceType::CPU, &run_local_bn_cpu);

}  // namespace
}  // namespace torch_bigbatch::batchnorm
