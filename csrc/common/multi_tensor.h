#pragma once
// A list of tensors cut into fixed-size chunks, numbered across the whole list, so that one
// parallel loop (CPU) or one kernel launch (CUDA) covers every tensor: work item c is a chunk
// of the tensor t with chunk_offsets[t] <= c < chunk_offsets[t + 1].
// Torch-free so that the CUDA kernels compile without a CUDA build of torch.

#include <cstdint>
#include <vector>

#include "common/portable.h"

namespace torch_bigbatch {

BB_HOST_DEVICE int64_t chunk_count(int64_t numel, int64_t chunk_size) {
  return (numel + chunk_size - 1) / chunk_size;
}

// Prefix sums of the chunk counts: n_tensors + 1 entries, the last one the total.
inline std::vector<int64_t> chunk_offsets(const std::vector<int64_t>& numels, int64_t chunk_size) {
  std::vector<int64_t> offsets(numels.size() + 1, 0);
  for (size_t t = 0; t < numels.size(); ++t)
    offsets[t + 1] = offsets[t] + chunk_count(numels[t], chunk_size);
  return offsets;
}

// The tensor that chunk c belongs to: the last t with offsets[t] <= c (binary search, since
// empty tensors own no chunk and leave repeated offsets).
template <typename Offset>
BB_HOST_DEVICE int tensor_of_chunk(const Offset* offsets, int n_tensors, int64_t chunk) {
  int lo = 0, hi = n_tensors - 1;
  while (lo < hi) {
    int mid = (lo + hi + 1) / 2;
    if (offsets[mid] <= chunk) lo = mid; else hi = mid - 1;
  }
  return lo;
}

}  // namespace torch_bigbatch
