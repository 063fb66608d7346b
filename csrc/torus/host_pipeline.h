// The torus allreduce on engines whose collectives complete on the host (Gloo, CPU tensors).
//
// A buffer is cut into segments; each goes through four direct exchanges (each member sends to
// every peer at once: one step, where Gloo's ring allreduce takes 2(p-1) steps):
//   row reduce-scatter    each row member sends the k-th part of its segment to member k, which
//                         sums what it receives into its own part;
//   column reduce-scatter the same along the column with that part, cut into Y pieces;
//   column allgather      each column member sends its reduced piece to every member;
//   row allgather         each row member sends its reduced part to every member.
// A row or column of one rank skips its two phases. A column of two goes through both too (one
// exchange of the whole row part, both members summing it, did twice the column's sums: as 2x2
// on one 2-core machine 0.83x Gloo at 16 MiB against 0.89x, docs/results.md).
// The exchanges are Gloo's send and recv: every part leaves from its place in the buffer and
// the allgathers' parts arrive in theirs, sums are made in place, and only what a rank receives
// to sum goes through a scratch buffer (an alltoall needs one contiguous input and output: a
// staged copy of what is sent and of what is received). Parts differ by at most one element,
// so no buffer is padded or copied whole because of its length. A call may take the one-shot
// form instead: two alltoalls (below).
//
// Ordering without a progress thread per call: the calling thread posts every segment's row
// reduce-scatter, in call and segment order; each later phase is posted when the phase before
// it ended, by one thread per phase (WorkWaiter) that waits for that phase's sends and receives
// in posting order. So every group sees its sends and receives in the same order on every rank
// (Gloo matches them in order), phases of different segments overlap, and a phase costs one
// thread handoff.
//
// Ranks that pass different sizes fail together with a message instead of summing misaligned
// data: with a call's last segment every column member sends every other a header (the call's
// element count, dtype, op, and the first rank that saw them differ) in the column
// reduce-scatter, and every row member in the row allgather; the row passes on what the column
// saw, so every rank knows at the call's end (see check_header). Their buffers have been
// written by then, as plain Gloo writes them.
#pragma once

#include "torus/backend_failure.h"
#include "torus/delivery_order.h"
#include "torus/scratch_pool.h"
#include "torus/topology.h"
#include "torus/torus_work.h"

#include <torch/csrc/distributed/c10d/Types.hpp>

#include <memory>

namespace torch_bigbatch::torus {

// The one-shot form: two exchanges instead of up to four: each row member sends its whole
// buffer to every other and sums what it receives, then each column member its row's sum. A
// rank sends X - 1 + Y - 1 times the buffer, against about 2 times, so only where a step costs
// more than the bytes: buffers up to this size may take it ("auto" measures both forms; a fixed
// torus takes it up to this size. README, "The torus backend").
constexpr int64_t kOneShotBytes = 256 << 10;

class HostPipeline {
 public:
  HostPipeline(TorusShape shape, Engines engines, std::shared_ptr<BackendFailure> failure,
               std::shared_ptr<DeliveryOrder> order);

  // Reduces `inputs` (one dtype, CPU) in place: one tensor for allreduce, several for
  // allreduce_coalesced (reduced as one flattened buffer), in segments of about segment_bytes,
  // or, `one_shot`, whole in the one-shot form.
  c10::intrusive_ptr<c10d::Work> allreduce(std::vector<at::Tensor> inputs, c10d::ReduceOp op,
                                           c10d::OpType op_type, int64_t segment_bytes,
                                           bool one_shot);

  struct Context;  // what the phases' callbacks share: shape, engines, scratch, the failure

 private:
  std::shared_ptr<Context> context_;
};

}  // namespace torch_bigbatch::torus
