// The torus allreduce on engines that order work by streams (NCCL, CUDA tensors). Every phase
// is enqueued at once by the calling thread on a torus side stream: after each phase,
// Work::synchronize makes the side stream wait for it, and the next group's stream waits for
// the side stream when its collective is enqueued. The host never blocks; wait() makes the
// caller's stream wait for the last phase.
#pragma once

#include "torus/topology.h"

#include <c10/core/Stream.h>
#include <torch/csrc/distributed/c10d/Types.hpp>
#include <torch/csrc/distributed/c10d/Work.hpp>

#include <vector>

namespace torch_bigbatch::torus {

c10::intrusive_ptr<c10d::Work> stream_allreduce(const TorusShape& shape, const Engines& engines,
                                                std::vector<at::Tensor> inputs,
                                                const c10d::ReduceOp& op, c10d::OpType op_type,
                                                int64_t segment_bytes, c10::Stream side);

}  // namespace torch_bigbatch::torus
