#pragma once
// Torch-free definitions shared by the CPU and CUDA kernels, so that the .cu files compile with
// nvcc alone (CI has no CUDA build of torch).

#include <cstdint>

#if defined(__CUDACC__)
#define BB_HOST_DEVICE __host__ __device__ __forceinline__
#else
#define BB_HOST_DEVICE inline
#endif

namespace torch_bigbatch {

// The storage type of a kernel's tensors. Float16 and BFloat16 compute in float; Float64 in double.
enum class ElementType : int { Float32, Float16, BFloat16, Float64 };

}  // namespace torch_bigbatch
