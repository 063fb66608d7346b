// The arithmetic the torus does itself on the host path: the reduction of the X parts a row
// member receives in the direct reduce-scatter, and AVG, which Gloo does not have.
#pragma once

#include <ATen/ATen.h>
#include <torch/csrc/distributed/c10d/Types.hpp>

namespace torch_bigbatch::torus {

// out[i] = rows[0][i] op rows[1][i] op ... for rows of shape [X, n].
void reduce_rows(at::Tensor& out, const at::Tensor& rows, const c10d::ReduceOp& op);

// out[i] = out[i] op rows[0][i] op rows[1][i] ...: what other members sent, added to this one's.
void accumulate_rows(at::Tensor& out, const at::Tensor& rows, const c10d::ReduceOp& op);

// The op the engines run: AVG is summed, then divided once by finish_average.
c10d::ReduceOp engine_op(const c10d::ReduceOp& op);
void finish_average(at::Tensor& reduced, const c10d::ReduceOp& op, int64_t group_size);

}  // namespace torch_bigbatch::torus
