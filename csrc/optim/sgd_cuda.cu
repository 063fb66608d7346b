// CUDA kernels of the fused SGD/LARS step. The tensor table travels as a kernel parameter
// (CUDA 12.1+ allows 32 KB on sm_70+), so all of ResNet-50's 161 tensors go in one launch with
// no host-to-device copy, and a CUDA graph captures the step as it is. Blocks stride over the
// chunks of all tensors; a binary search over the chunk offsets finds each chunk's tensor.

#include <algorithm>
#include <cstdint>
#include <type_traits>
#include <vector>

#include "common/cuda_kernels.cuh"
#include "sgd_cuda.h"

#if CUDART_VERSION < 12010
#error "torch_bigbatch's CUDA kernels need CUDA 12.1+ (kernel parameters over 4 KB) and sm_70+"
#endif

namespace torch_bigbatch::optim {
namespace {

constexpr int kMaxTensors = 320;  // per launch
constexpr int kMaxGroups = 64;    // per launch (e.g. one group per layer)
constexpr int64_t kChunk = 16384; // elements per block iteration unit
constexpr int kThreads = 256;
constexpr int kBlocksPerMultiprocessor = 8;
constexpr int kPack = 4;          // elements per vector access

struct LaunchArgs {
  void* param[kMaxTensors];
  const void* grad[kMaxTensors];
  void* buffer[kMaxTensors];
  int64_t numel[kMaxTensors];
  int64_t chunk_offset[kMaxTensors + 1];
  uint8_t group[kMaxTensors];
  bool packed[kMaxTensors];  // all three pointers aligned for kPack-wide accesses
  int n_tensors;
  SgdGroup groups[kMaxGroups];
  const float* grad_scale;
  const float* found_inf;
  float* norm_partials;  // two per chunk (sum p^2, sum g^2) when the launch has LARS groups
  BufferMode mode;
  const float* first_step_pending;  // see SgdStep
};
static_assert(sizeof(LaunchArgs) <= 32764, "kernel parameters are limited to 32764 bytes");

struct Chunk {
  int tensor;
  int64_t begin, end;
};
__device__ __forceinline__ Chunk chunk_at(const LaunchArgs& args, int64_t c) {
  const int t = tensor_of_chunk(args.chunk_offset, args.n_tensors, c);
  const int64_t begin = (c - args.chunk_offset[t]) * kChunk;
  return {t, begin, min(begin + kChunk, args.numel[t])};
}

// Walks the block's threads over a chunk: visit(i, width) for kPack-wide accesses where the
// tensor's pointers are aligned (chunk.begin is a multiple of kChunk, so every pack is), then
// for single elements; width is a std::integral_constant.
template <typename Visit>
__device__ __forceinline__ void for_each_pack(const Chunk& chunk, bool packed, const Visit& visit) {
  int64_t tail = chunk.begin;
  if (packed) {
    const int64_t packs = (chunk.end - chunk.begin) / kPack;
    for (int64_t k = threadIdx.x; k < packs; k += blockDim.x)
      visit(chunk.begin + k * kPack, std::integral_constant<int, kPack>());
    tail = chunk.begin + packs * kPack;
  }
  for (int64_t i = tail + threadIdx.x; i < chunk.end; i += blockDim.x)
    visit(i, std::integral_constant<int, 1>());
}

__device__ __forceinline__ bool skip_step(const LaunchArgs& args) {
  return args.found_inf != nullptr && *args.found_inf != 0.f;
}

__device__ __forceinline__ float inverse_grad_scale(const LaunchArgs& args) {
  return args.grad_scale != nullptr ? 1.f / *args.grad_scale : 1.f;
}

// LARS, first launch: per-chunk sums of squares of p and of the unscaled g (unscaled before
// squaring: a scaled gradient's squares can overflow float where its values do not).
template <typename T>
__global__ void __launch_bounds__(kThreads, kBlocksPerMultiprocessor)
    chunk_sum_squares_kernel(const __grid_constant__ LaunchArgs args) {
  __shared__ float shared[kThreads / 32];
  if (skip_step(args)) return;
  const float unscale = inverse_grad_scale(args);
  for (int64_t c = blockIdx.x; c < args.chunk_offset[args.n_tensors]; c += gridDim.x) {
    const Chunk chunk = chunk_at(args, c);
    if (args.groups[args.group[chunk.tensor]].trust_coefficient == 0.f) continue;
    const T* param = static_cast<const T*>(args.param[chunk.tensor]);
    const T* grad = static_cast<const T*>(args.grad[chunk.tensor]);
    float pp = 0.f, gg = 0.f;
    for_each_pack(chunk, args.packed[chunk.tensor], [&](int64_t i, auto width) {
      constexpr int N = decltype(width)::value;
      const Pack<T, N> p = load_pack<N>(param, i), g = load_pack<N>(grad, i);
#pragma unroll
      for (int j = 0; j < N; ++j) {
        const float pj = to_acc(p.v[j]), gj = to_acc(g.v[j]) * unscale;
        pp += pj * pj;
        gg += gj * gj;
      }
    });
    pp = block_sum(pp, shared);
    gg = block_sum(gg, shared);
    if (threadIdx.x == 0) {
      args.norm_partials[2 * c] = pp;
      args.norm_partials[2 * c + 1] = gg;
    }
  }
}

// LARS trust ratio of tensor t from the partials of all its chunks (fixed order: deterministic).
__device__ float trust_ratio(const LaunchArgs& args, int t, float* shared) {
  float pp = 0.f, gg = 0.f;
  for (int64_t c = args.chunk_offset[t] + threadIdx.x; c < args.chunk_offset[t + 1];
       c += blockDim.x) {
    pp += args.norm_partials[2 * c];
    gg += args.norm_partials[2 * c + 1];
  }
  pp = block_sum(pp, shared);
  gg = block_sum(gg, shared);
  return lars_trust_ratio(sqrtf(pp), sqrtf(gg), args.groups[args.group[t]]);
}

template <typename T>
__global__ void __launch_bounds__(kThreads, kBlocksPerMultiprocessor)
    sgd_kernel(const __grid_constant__ LaunchArgs args) {
  __shared__ float shared[kThreads / 32];
  __shared__ int trust_tensor;  // the tensor whose ratio trust_cached holds (block-uniform)
  __shared__ float trust_cached;
  if (skip_step(args)) return;
  if (threadIdx.x == 0) trust_tensor = -1;
  __syncthreads();  // trust_tensor is read below by every thread
  const float inv_grad_scale = inverse_grad_scale(args);
  const BufferMode mode = effective_mode(args.mode, args.first_step_pending);
  for (int64_t c = blockIdx.x; c < args.chunk_offset[args.n_tensors]; c += gridDim.x) {
    const Chunk chunk = chunk_at(args, c);
    const SgdGroup& group = args.groups[args.group[chunk.tensor]];
    const float lr = group.lr_ptr != nullptr ? *group.lr_ptr : group.lr;
    float trust = 1.f;
    if (group.trust_coefficient != 0.f) {
      if (trust_tensor != chunk.tensor) {  // block-uniform: all threads enter block_sum
        const float r = trust_ratio(args, chunk.tensor, shared);
        __syncthreads();  // everyone has read trust_tensor before thread 0 changes it
        if (threadIdx.x == 0) { trust_tensor = chunk.tensor; trust_cached = r; }
        __syncthreads();
      }
      trust = trust_cached;
    }
    const SgdScalars<float> s = sgd_scalars(group, lr, inv_grad_scale, trust);
    T* __restrict__ param = static_cast<T*>(args.param[chunk.tensor]);
    const T* __restrict__ grad = static_cast<const T*>(args.grad[chunk.tensor]);
    T* __restrict__ buffer = static_cast<T*>(args.buffer[chunk.tensor]);

    for_each_pack(chunk, args.packed[chunk.tensor], [&](int64_t i, auto width) {
      constexpr int N = decltype(width)::value;
      Pack<T, N> p = load_pack<N>(param, i), b;
      const Pack<T, N> g = load_pack<N>(grad, i);
      if (mode == BufferMode::Update) b = load_pack<N>(buffer, i);
#pragma unroll
      for (int j = 0; j < N; ++j) {
        float bj = mode == BufferMode::Update ? to_acc(b.v[j]) : 0.f;
        p.v[j] = from_acc<T>(
            sgd_update(to_acc(p.v[j]), to_acc(g.v[j]), bj, s, mode, group.nesterov));
        b.v[j] = from_acc<T>(bj);
      }
      store_pack<N>(param, i, p);
      if (mode != BufferMode::None) store_pack<N>(buffer, i, b);
    });
  }
}

template <typename T>
cudaError_t launch_typed(const SgdStep& step, float* scratch, int multiprocessors,
                         cudaStream_t stream) {
  const bool lars = step.uses_lars();
  size_t next = 0;
  while (next < step.tensors.size()) {
    // Fill one launch's table with as many tensors (and their groups) as it holds.
    LaunchArgs args{};
    std::vector<int> slot_of_group(step.groups.size(), -1);
    int n_groups = 0;
    bool launch_lars = false;  // this launch has a LARS tensor
    for (; next < step.tensors.size() && args.n_tensors < kMaxTensors; ++next) {
      const SgdTensor& tensor = step.tensors[next];
      int& slot = slot_of_group[tensor.group];
      if (slot < 0) {
        if (n_groups == kMaxGroups) break;
        slot = n_groups++;
        args.groups[slot] = step.groups[tensor.group];
      }
      const int t = args.n_tensors++;
      launch_lars |= step.groups[tensor.group].trust_coefficient != 0.f;
      args.param[t] = tensor.param;
      args.grad[t] = tensor.grad;
      args.buffer[t] = tensor.buffer;
      args.numel[t] = tensor.numel;
      args.chunk_offset[t + 1] = args.chunk_offset[t] + chunk_count(tensor.numel, kChunk);
      args.group[t] = static_cast<uint8_t>(slot);
      const size_t bytes = kPack * sizeof(T);
      args.packed[t] = is_aligned(tensor.param, bytes) && is_aligned(tensor.grad, bytes) &&
                       (tensor.buffer == nullptr || is_aligned(tensor.buffer, bytes));
    }
    args.grad_scale = step.grad_scale;
    args.found_inf = step.found_inf;
    args.mode = step.buffer_mode;
    args.first_step_pending = step.first_step_pending;
    args.norm_partials = launch_lars ? scratch : nullptr;
    const int64_t chunks = args.chunk_offset[args.n_tensors];
    if (chunks == 0) continue;
    const int blocks = static_cast<int>(
        std::min<int64_t>(chunks, int64_t{multiprocessors} * kBlocksPerMultiprocessor));
    if (launch_lars) chunk_sum_squares_kernel<T><<<blocks, kThreads, 0, stream>>>(args);
    sgd_kernel<T><<<blocks, kThreads, 0, stream>>>(args);
    if (lars) scratch += 2 * chunks;
    const cudaError_t error = cudaGetLastError();
    if (error != cudaSuccess) return error;
  }
  return cudaSuccess;
}

}  // namespace

int64_t sgd_cuda_scratch_floats(const SgdStep& step) {
  if (!step.uses_lars()) return 0;
  int64_t chunks = 0;
  for (const SgdTensor& t : step.tensors) chunks += chunk_count(t.numel, kChunk);
  return 2 * chunks;
}

cudaError_t launch_sgd_cuda(const SgdStep& step, float* scratch, cudaStream_t stream) {
  int multiprocessors = 0;
  const cudaError_t error = current_multiprocessors(&multiprocessors);
  if (error != cudaSuccess) return error;
  switch (step.dtype) {
    case ElementType::Float32: return launch_typed<float>(step, scratch, multiprocessors, stream);
    case ElementType::Float16: return launch_typed<__half>(step, scratch, multiprocessors, stream);
    case ElementType::BFloat16:
      return launch_typed<__nv_bfloat16>(step, scratch, multiprocessors, stream);
    case ElementType::Float64: break;  // the op refuses it
  }
  return cudaErrorInvalidValue;
}

}  // namespace torch_bigbatch::optim
