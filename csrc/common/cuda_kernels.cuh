#pragma once
// Helpers shared by the CUDA kernels: conversions to the accumulation type (float, or double
// for double), aligned multi-element accesses, warp and block sums, the device's size.

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime_api.h>

#include <cstdint>

namespace torch_bigbatch {

// The accumulation type of a storage type.
template <typename T> struct AccumulateType { using type = float; };
template <> struct AccumulateType<double> { using type = double; };
template <typename T> using acc_t = typename AccumulateType<T>::type;

__device__ __forceinline__ float to_acc(float x) { return x; }
__device__ __forceinline__ double to_acc(double x) { return x; }
__device__ __forceinline__ float to_acc(__half x) { return __half2float(x); }
__device__ __forceinline__ float to_acc(__nv_bfloat16 x) { return __bfloat162float(x); }
template <typename T> __device__ __forceinline__ T from_acc(acc_t<T> x) { return x; }
template <> __device__ __forceinline__ __half from_acc<__half>(float x) {
  return __float2half_rn(x);
}
template <> __device__ __forceinline__ __nv_bfloat16 from_acc<__nv_bfloat16>(float x) {
  return __float2bfloat16_rn(x);
}

// N consecutive elements, loaded and stored as one access (N * sizeof(T) bytes, aligned).
template <typename T, int N>
struct alignas(N * sizeof(T)) Pack {
  T v[N];
};
template <int N, typename T>
__device__ __forceinline__ Pack<T, N> load_pack(const T* data, int64_t i) {
  return *reinterpret_cast<const Pack<T, N>*>(data + i);
}
template <int N, typename T>
__device__ __forceinline__ void store_pack(T* data, int64_t i, const Pack<T, N>& pack) {
  *reinterpret_cast<Pack<T, N>*>(data + i) = pack;
}

inline bool is_aligned(const void* p, size_t bytes) {
  return reinterpret_cast<uintptr_t>(p) % bytes == 0;
}

// The number of multiprocessors of the current device, which sizes the grids.
inline cudaError_t current_multiprocessors(int* count) {
  int device = 0;
  const cudaError_t error = cudaGetDevice(&device);
  if (error != cudaSuccess) return error;
  return cudaDeviceGetAttribute(count, cudaDevAttrMultiProcessorCount, device);
}

// Sum over the warp; every lane gets the result.
template <typename A>
__device__ __forceinline__ A warp_sum(A x) {
  for (int offset = 16; offset > 0; offset /= 2) x += __shfl_xor_sync(0xffffffffu, x, offset);
  return x;
}

// Sum over the block; every thread gets the result. `shared` holds one value per warp.
template <typename A>
__device__ A block_sum(A x, A* shared) {
  x = warp_sum(x);
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  __syncthreads();  // `shared` may still be read from the previous call
  if (lane == 0) shared[warp] = x;
  __syncthreads();
  x = lane < blockDim.x / 32 ? shared[lane] : A(0);
  return warp_sum(x);
}

}  // namespace torch_bigbatch
