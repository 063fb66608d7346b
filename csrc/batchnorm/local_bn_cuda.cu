// CUDA kernels of local BatchNorm: the four steps of local_bn.h, one launch each.
//   1. a warp per (sample, channel) row ([N, C, S] memory), or a block per (sample, 32
//      channels) walking the rows of [N, S, C] memory: sums of the sample, no atomics (the
//      forward reads the sample twice: its mean, then the deviations, the second from cache)
//   2. a warp per (group, channel): the group's sums, statistics and coefficients
//   3. a thread per channel: the groups' average statistics, or grad_weight and grad_bias
//   4. a grid-stride elementwise loop with 16-byte accesses, one wave of resident blocks
// Every sum is in a fixed order, so results are deterministic.

#include <cuda_runtime_api.h>

#include <algorithm>
#include <cstdint>
#include <limits>
#include <type_traits>

#include "batchnorm/local_bn_cuda.h"
#include "common/cuda_kernels.cuh"

namespace torch_bigbatch::batchnorm {
namespace {

constexpr int kThreads = 256;
constexpr int kWarps = kThreads / 32;
constexpr int kChannelTile = 32;  // channels of one block in channels-last step 1

// Elements per 16-byte access.
template <typename T>
constexpr int kPackWidth = 16 / sizeof(T);

template <int W>
using Width = std::integral_constant<int, W>;

// A thread's running sums of step 1: forward u = d = x - center, backward u = dy; sums of u
// and u d. One float total of many values rounds their small parts away once it dwarfs them
// (2^17 squares of about 1, one thread's share of a channels-last sample, came out 1e-3 low),
// so each float total covers kChunk values, then moves into double.
template <bool kBackward, typename A>
struct StepSums {
  static constexpr int kChunk = 1024;
  A q1 = 0, q2 = 0;
  double total1 = 0, total2 = 0;
  int count = 0;

  __device__ __forceinline__ void add(A x, A dy, A center) {
    const A d = x - center;
    const A u = kBackward ? dy : d;
    q1 += u;
    q2 += u * d;
    if (++count == kChunk) flush();
  }
  __device__ __forceinline__ void flush() {
    total1 += q1;
    total2 += q2;
    q1 = q2 = 0;
    count = 0;
  }
};

// Step 1's values of a (sample, channel): the sums of dy and dy d (backward), or the sample's
// center, mean offset and M2 (forward) from the sums of d and d^2.
template <bool kBackward, typename A>
__device__ __forceinline__ void store_sample(const BnPass& p, int64_t nc, A center, double q1,
                                             double q2) {
  A* out = sample_values<A>(p, nc);
  if (kBackward) {
    out[0] = A(q1);
    out[1] = A(q2);
  } else {
    sample_moments<A>(out, center, A(q1), A(q2), A(p.layout.spatial));
  }
}

// Step 1, [N, C, S]: warp w sums the contiguous row w = n * C + c.
template <typename T, bool kBackward>
__global__ void __launch_bounds__(kThreads) sample_sums_rows(const BnPass p, bool packed) {
  using A = acc_t<T>;
  constexpr int W = kPackWidth<T>;
  const BnLayout& l = p.layout;
  const int64_t row = (int64_t(blockIdx.x) * blockDim.x + threadIdx.x) / 32;
  const int lane = threadIdx.x % 32;
  if (row >= l.batch * l.channels) return;  // whole warps
  const int64_t c = row % l.channels;
  const T* x = static_cast<const T*>(p.input) + row * l.spatial;
  const T* dy = kBackward ? static_cast<const T*>(p.grad_output) + row * l.spatial : nullptr;
  // The row's values, packed where their alignment allows: visit(i, Width<N>) at each start.
  auto each = [&](auto&& visit) {
    int64_t tail = 0;
    if (packed) {
      const int64_t packs = l.spatial / W;
#pragma unroll 4
      for (int64_t k = lane; k < packs; k += 32) visit(k * W, Width<W>());
      tail = packs * W;
    }
#pragma unroll 4
    for (int64_t i = tail + lane; i < l.spatial; i += 32) visit(i, Width<1>());
  };
  A center;
  if constexpr (kBackward) {
    center = static_cast<const A*>(p.mean)[l.group_of(row / l.channels) * l.channels + c];
  } else {
    // The first pass: the row's mean, totalled in double: a float total drifted by hundreds
    // of spreads at a mean 1e6 times the spread and millions of values, and M2 = sum d^2 -
    // (sum d)^2 / n then cancelled (as on the CPU: local_bn_cpu.cpp's row_mean).
    double total = 0;
    each([&](int64_t i, auto width) {
      constexpr int N = decltype(width)::value;
      const Pack<T, N> xs = load_pack<N>(x, i);
#pragma unroll
      for (int j = 0; j < N; ++j) total += to_acc(xs.v[j]);
    });
    center = A(warp_sum(total) / double(l.spatial));
  }
  StepSums<kBackward, A> sums;
  each([&](int64_t i, auto width) {
    constexpr int N = decltype(width)::value;
    const Pack<T, N> xs = load_pack<N>(x, i);
    Pack<T, N> dys;
    if constexpr (kBackward) dys = load_pack<N>(dy, i);
#pragma unroll
    for (int j = 0; j < N; ++j)
      sums.add(to_acc(xs.v[j]), kBackward ? to_acc(dys.v[j]) : A(0), center);
  });
  sums.flush();
  const double q1 = warp_sum(sums.total1), q2 = warp_sum(sums.total2);
  if (lane == 0) store_sample<kBackward>(p, row, center, q1, q2);
}

// Step 1, [N, S, C]: block (n, tile) has a thread per (channel of the tile, row lane); the
// warp's 32 channels are contiguous in memory, the block's 8 warps split the S rows.
template <typename T, bool kBackward>
__global__ void __launch_bounds__(kThreads) sample_sums_channels_last(const BnPass p) {
  using A = acc_t<T>;
  __shared__ double partial[2][kWarps][kChannelTile + 1];
  __shared__ A centers[kChannelTile];
  const BnLayout& l = p.layout;
  const int64_t tiles = (l.channels + kChannelTile - 1) / kChannelTile;
  const int64_t n = blockIdx.x / tiles;
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  const int64_t c = blockIdx.x % tiles * kChannelTile + lane;
  const bool active = c < l.channels;
  const T* x = static_cast<const T*>(p.input);
  const T* dy = static_cast<const T*>(p.grad_output);
  if constexpr (kBackward) {
    if (warp == 0 && active)
      centers[lane] = static_cast<const A*>(p.mean)[l.group_of(n) * l.channels + c];
  } else {  // the first pass: each channel's mean over the sample's S rows, in double
    __shared__ double totals[kWarps][kChannelTile + 1];
    double total = 0;
    if (active) {
#pragma unroll 4
      for (int64_t s = warp; s < l.spatial; s += kWarps) total += to_acc(x[l.index(n, c, s)]);
    }
    totals[warp][lane] = total;
    __syncthreads();
    if (warp == 0) {
      for (int w = 1; w < kWarps; ++w) total += totals[w][lane];
      centers[lane] = A(total / double(l.spatial));
    }
  }
  __syncthreads();  // the centers are in; the first pass's partials are read
  const A center = centers[lane];
  StepSums<kBackward, A> sums;
  if (active) {
#pragma unroll 4
    for (int64_t s = warp; s < l.spatial; s += kWarps) {
      const int64_t at = l.index(n, c, s);
      sums.add(to_acc(x[at]), kBackward ? to_acc(dy[at]) : A(0), center);
    }
  }
  sums.flush();
  double q1 = sums.total1, q2 = sums.total2;
  partial[0][warp][lane] = q1;
  partial[1][warp][lane] = q2;
  __syncthreads();
  if (warp == 0 && active) {
    for (int w = 1; w < kWarps; ++w) {
      q1 += partial[0][w][lane];
      q2 += partial[1][w][lane];
    }
    store_sample<kBackward>(p, n * l.channels + c, center, q1, q2);
  }
}

// Step 2: warp w handles (group, channel) w = g * C + c; its lanes split the group's samples.
template <typename T, bool kBackward>
__global__ void __launch_bounds__(kThreads) group_kernel(const BnPass p) {
  using A = acc_t<T>;
  const BnLayout& l = p.layout;
  const int64_t gc = (int64_t(blockIdx.x) * blockDim.x + threadIdx.x) / 32;
  const int lane = threadIdx.x % 32;
  if (gc >= l.groups * l.channels) return;  // whole warps
  const int64_t g = gc / l.channels, c = gc % l.channels;
  const int64_t begin = l.group_begin(g), end = l.group_end(g);
  const A count = A((end - begin) * l.spatial);
  const auto sample = [&](int64_t n) { return sample_values<A>(p, n * l.channels + c); };
  if constexpr (kBackward) {
    A q1 = 0, q2 = 0;
    for (int64_t n = begin + lane; n < end; n += 32) {
      q1 += sample(n)[0];
      q2 += sample(n)[1];
    }
    q1 = warp_sum(q1);
    q2 = warp_sum(q2);
    if (lane == 0) group_backward<A>(p, gc, c, q1, q2, count);
  } else {  // the M2s merge around the group's mean (local_bn.h)
    const A reference = group_reference<A>(p, g, c);
    A offsets = 0;
    for (int64_t n = begin + lane; n < end; n += 32)
      offsets += sample_offset(sample(n), reference);
    const A mean_offset = warp_sum(offsets) / A(end - begin);
    A m2 = 0;
    for (int64_t n = begin + lane; n < end; n += 32)
      m2 += merged_m2(sample(n), reference, mean_offset, A(l.spatial));
    m2 = warp_sum(m2);
    if (lane == 0) group_forward<A>(p, gc, c, reference + mean_offset, m2, count);
  }
}

// Step 3: thread c sums its channel's group values over the groups.
template <typename A>
__global__ void __launch_bounds__(kThreads) channel_kernel(const BnPass p) {
  const BnLayout& l = p.layout;
  const int64_t c = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (c >= l.channels) return;
  const A* values = static_cast<const A*>(p.group_values);
  A first = 0, second = 0;
  for (int64_t g = 0; g < l.groups; ++g) {
    first += values[2 * (g * l.channels + c)];
    second += values[2 * (g * l.channels + c) + 1];
  }
  channel_step<A>(p, c, first, second);
}

// Step 4, with v = x - mean per (group, channel): result = a v + c (forward) or a dy + b v + c.
// Packs may cross rows (7x7 maps have no 16-byte rows), so each element finds its table entry:
// the same along a row of [N, C, S], the next one along a row of [N, S, C].
template <typename T, bool kBackward, bool kChannelsLast, typename Index>
__global__ void __launch_bounds__(kThreads) apply_coefficients(const BnPass p, bool packed) {
  using A = acc_t<T>;
  constexpr int W = kPackWidth<T>;
  const BnLayout& l = p.layout;
  const Index spatial = l.spatial, channels = l.channels;
  const Index numel = Index(l.batch) * channels * spatial;
  const T* x = static_cast<const T*>(p.input);
  const T* dy = static_cast<const T*>(p.grad_output);
  T* result = static_cast<T*>(p.result);
  const Coefficients<A> coefficients = coefficients_of<A>(p);
  const A* mean = static_cast<const A*>(p.mean);
  // The entry of element e, and the first element of the next row.
  auto entry = [&](Index e, Index& row_end) -> int64_t {
    Index c, n;
    if constexpr (kChannelsLast) {
      c = e % channels;
      n = e / (spatial * channels);
      row_end = e - c + channels;
    } else {
      const Index row = e / spatial;
      c = row % channels;
      n = row / channels;
      row_end = (row + 1) * spatial;
    }
    return l.group_of(n) * l.channels + c;
  };
  auto visit = [&](Index i, auto width) {
    constexpr int N = decltype(width)::value;
    const Pack<T, N> xs = load_pack<N>(x, i);
    Pack<T, N> dys, out;
    if constexpr (kBackward) dys = load_pack<N>(dy, i);
    Index row_end;
    int64_t k = entry(i, row_end);
#pragma unroll
    for (int j = 0; j < N; ++j) {
      if (j > 0) {
        if (i + j == row_end)
          k = entry(i + j, row_end);
        else if (kChannelsLast)
          ++k;
      }
      const A v = to_acc(xs.v[j]) - mean[k];
      A r;
      if constexpr (kBackward)
        r = fma(coefficients.a[k], to_acc(dys.v[j]), fma(coefficients.b[k], v, coefficients.c[k]));
      else
        r = fma(coefficients.a[k], v, coefficients.c[k]);
      out.v[j] = from_acc<T>(r);
    }
    store_pack<N>(result, i, out);
  };
  const Index stride = Index(gridDim.x) * blockDim.x;
  const Index first = Index(blockIdx.x) * blockDim.x + threadIdx.x;
  if (packed) {
    for (Index k = first; k < numel / W; k += stride) visit(k * W, Width<W>());
  } else {
    for (Index i = first; i < numel; i += stride) visit(i, Width<1>());
  }
}

int64_t blocks_for(int64_t threads) { return (threads + kThreads - 1) / kThreads; }

// Step 4's grid: one wave of as many blocks as fit on the device (grid-stride loop).
template <typename T, bool kBackward, bool kChannelsLast, typename Index>
cudaError_t launch_apply(const BnPass& p, bool packed, int64_t work, int multiprocessors,
                         cudaStream_t stream) {
  const auto kernel = apply_coefficients<T, kBackward, kChannelsLast, Index>;
  // Resident blocks per multiprocessor: fixed for a kernel on a GPU model, so asked once, not
  // at every BatchNorm call (a process drives one model of GPU).
  static const int per_multiprocessor = [kernel] {
    int count = 0;
    cudaOccupancyMaxActiveBlocksPerMultiprocessor(&count, kernel, kThreads, 0);
    return std::max(count, 1);
  }();
  const int64_t blocks = std::min<int64_t>(work, int64_t{multiprocessors} * per_multiprocessor);
  kernel<<<blocks, kThreads, 0, stream>>>(p, packed);
  return cudaGetLastError();
}

template <typename T, bool kBackward, bool kChannelsLast>
cudaError_t launch_apply(const BnPass& p, bool packed, int multiprocessors, cudaStream_t stream) {
  constexpr int W = kPackWidth<T>;
  const int64_t numel = p.layout.batch * p.layout.channels * p.layout.spatial;
  const int64_t work = blocks_for(packed ? numel / W : numel);
  // 32-bit index math where it cannot overflow: divisions are several times cheaper.
  if (numel + work * kThreads * int64_t{W} < (int64_t{1} << 32))
    return launch_apply<T, kBackward, kChannelsLast, uint32_t>(p, packed, work, multiprocessors,
                                                               stream);
  return launch_apply<T, kBackward, kChannelsLast, int64_t>(p, packed, work, multiprocessors,
                                                            stream);
}

template <typename T, bool kBackward>
cudaError_t launch_pass(const BnPass& p, int multiprocessors, cudaStream_t stream) {
  constexpr int W = kPackWidth<T>;
  const BnLayout& l = p.layout;
  const bool aligned = is_aligned(p.input, 16) && is_aligned(p.result, 16) &&
                       (!kBackward || is_aligned(p.grad_output, 16));
  const int64_t numel = l.batch * l.channels * l.spatial;
  const int64_t sample_blocks = l.channels_last
                                    ? l.batch * ((l.channels + kChannelTile - 1) / kChannelTile)
                                    : blocks_for(32 * l.batch * l.channels);
  const int64_t group_blocks = blocks_for(32 * l.groups * l.channels);
  // A grid of 2^31 blocks or more is refused (beyond 2^32, dim3 would wrap it: samples
  // skipped, statistics wrong): billions of (sample, channel) pairs.
  if (std::max(sample_blocks, group_blocks) > std::numeric_limits<int32_t>::max())
    return cudaErrorInvalidConfiguration;

  if (l.channels_last) {
    sample_sums_channels_last<T, kBackward><<<sample_blocks, kThreads, 0, stream>>>(p);
  } else {
    const bool packed_rows = aligned && l.spatial % W == 0;
    sample_sums_rows<T, kBackward><<<sample_blocks, kThreads, 0, stream>>>(p, packed_rows);
  }
  group_kernel<T, kBackward><<<group_blocks, kThreads, 0, stream>>>(p);
  channel_kernel<acc_t<T>><<<blocks_for(l.channels), kThreads, 0, stream>>>(p);
  const cudaError_t error = cudaGetLastError();
  if (error != cudaSuccess) return error;

  const bool packed = aligned && numel % W == 0;
  return l.channels_last ? launch_apply<T, kBackward, true>(p, packed, multiprocessors, stream)
                         : launch_apply<T, kBackward, false>(p, packed, multiprocessors, stream);
}

template <typename T>
cudaError_t launch_typed(const BnPass& p, int multiprocessors, cudaStream_t stream) {
  return p.backward ? launch_pass<T, true>(p, multiprocessors, stream)
                    : launch_pass<T, false>(p, multiprocessors, stream);
}

}  // namespace

cudaError_t launch_local_bn_cuda(const BnPass& pass, cudaStream_t stream) {
  int multiprocessors = 0;
  const cudaError_t error = current_multiprocessors(&multiprocessors);
  if (error != cudaSuccess) return error;
  switch (pass.dtype) {
    case ElementType::Float32: return launch_typed<float>(pass, multiprocessors, stream);
    case ElementType::Float16: return launch_typed<__half>(pass, multiprocessors, stream);
    case ElementType::BFloat16: return launch_typed<__nv_bfloat16>(pass, multiprocessors, stream);
    case ElementType::Float64: return launch_typed<double>(pass, multiprocessors, stream);
  }
  return cudaErrorInvalidValue;
}

}  // namespace torch_bigbatch::batchnorm
