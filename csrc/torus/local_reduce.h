// The arithmetic the torus does itself on the host path: the reduction of the X parts a row
// member receives in the direct reduce-scatter, and AVG, which Gloo does not have.
#pragma once

#include <ATen/ATen.h>
#include <torch/csrc/distributed/c10d/Types.hpp>

namespace torch_bigbatch::torus {

// out[i] = a[i] op b[i], in one pass (out may be a or b).
void reduce_pair(at::Tensor& out, const at::Tensor& a, const at::Tensor& b,
                 const c10d::ReduceOp& op);

// out[i] = first[i] op rows[0][i] op rows[1][i] ... for rows of shape [k, n] (k may be 0);
// out may be first: what other members sent, added to this one's in place.
void reduce_into(at::Tensor& out, const at::Tensor& first, const at::Tensor& rows,
                 const c10d::ReduceOp& op);

// out[i] = member 0's [i] op member 1's [i] ... in member order, `mine` being member `me`'s and
// rows[k] member k's below `me`, k + 1's from it: the same operations, in the same order, on
// every member, so every member's result is the same to the last bit (a float sum depends on
// its order, MIN and MAX of +0 and -0 on theirs). Accumulates in rows (scratch, overwritten);
// out may be mine.
void reduce_in_member_order(at::Tensor& out, const at::Tensor& mine, int64_t me,
                            const at::Tensor& rows, const c10d::ReduceOp& op);

// The op on bytes of 0 and 1 that a bool op is: SUM, MAX and BOR are "any", PRODUCT, MIN and
// BAND "all", as Gloo reduces bools.
c10d::ReduceOp bool_as_byte_op(const c10d::ReduceOp& op);

// The op the engines run: AVG is summed, then divided once by finish_average.
c10d::ReduceOp engine_op(const c10d::ReduceOp& op);
void finish_average(at::Tensor& reduced, const c10d::ReduceOp& op, int64_t group_size);

// AVG of float16 is divided before the sum instead, as NCCL's AVG divides floating inputs: a
// sum over the ranks can pass float16's largest value, 65504, where the mean does not. Divides
// `buffer` in place where that applies and returns the op left to finish the call with: SUM
// there, else `op`.
c10d::ReduceOp divide_first_if_half(at::Tensor& buffer, const c10d::ReduceOp& op,
                                    int64_t group_size);

}  // namespace torch_bigbatch::torus
