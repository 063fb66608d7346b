// The torus allreduce on engines whose collectives complete on the host (Gloo, CPU tensors).
//
// A buffer is cut into segments; each goes through four exchanges (direct: one step to every
// peer at once, where Gloo's ring allreduce takes 2(p-1) steps):
//   row reduce-scatter   each row member sends the k-th part of its segment to member k, which
//                        sums the X parts it receives (Gloo's alltoall) into its place;
//   column reduce-scatter the same along the column with that part, cut into Y pieces;
//   column allgather     each column member sends its reduced piece to every member;
//   row allgather        each row member sends its reduced part to every member, from its place
//                        in the buffer, and receives theirs in their places (Gloo's send and
//                        recv: no staging copies).
// A row or column of one rank skips its two phases. Parts differ by at most one element, so
// no buffer is padded or copied whole because of its length.
//
// Ordering without a progress thread of its own: the calling thread issues every segment's row
// reduce-scatter, in call and segment order; each later phase is issued by the callback of the
// phase before it, which runs on the single worker thread of that phase's process group in
// completion order, which is issue order (the row allgather's sends and receives, which have no
// callback, are waited for in issue order by one thread, WorkWaiter). So every group sees its
// collectives in the same order on every rank, and a phase costs one thread handoff.
//
// Ranks that pass different sizes fail together with a message instead of summing misaligned
// data: every region exchanged in the column phases starts with a header (the call's element
// count, dtype, op, and the first rank that saw them differ), and the row allgather exchanges
// one such header per call, with its last segment; across rows the column phases compare and
// pass the flag on (see check_header), within a row the row allgather does. A call fails at
// its end, on every rank.
#pragma once

#include "torus/scratch_pool.h"
#include "torus/topology.h"
#include "torus/torus_work.h"

#include <torch/csrc/distributed/c10d/Types.hpp>

#include <memory>

namespace torch_bigbatch::torus {

// Buffers up to this size take two exchanges instead of up to four: each row member sends its
// whole buffer to every other and sums what it receives, then each column member its row's sum.
// A rank sends X - 1 + Y - 1 times the buffer, against about 2 times, so only where a step
// costs more than the bytes (measured: README, "The torus backend").
constexpr int64_t kOneShotBytes = 256 << 10;

class HostPipeline {
 public:
  HostPipeline(TorusShape shape, Engines engines);

  // Reduces `inputs` (one dtype, CPU) in place: one tensor for allreduce, several for
  // allreduce_coalesced (reduced as one flattened buffer), in segments of about segment_bytes.
  c10::intrusive_ptr<c10d::Work> allreduce(std::vector<at::Tensor> inputs, c10d::ReduceOp op,
                                           c10d::OpType op_type, int64_t segment_bytes);

  struct Context;  // what the phases' callbacks share: shape, engines, scratch, first failure

 private:
  std::shared_ptr<Context> context_;
};

}  // namespace torch_bigbatch::torus
