#include "torus/local_reduce.h"

#include <c10/util/Exception.h>

namespace torch_bigbatch::torus {

namespace {

void combine(at::Tensor& out, const at::Tensor& other, const c10d::ReduceOp& op) {
  switch (op.op_) {
    case c10d::ReduceOp::SUM:
    case c10d::ReduceOp::AVG:
      out.add_(other);
      return;
    case c10d::ReduceOp::PRODUCT:
      out.mul_(other);
      return;
    case c10d::ReduceOp::MIN:
      at::minimum_out(out, out, other);
      return;
    case c10d::ReduceOp::MAX:
      at::maximum_out(out, out, other);
      return;
    case c10d::ReduceOp::BAND:
      out.bitwise_and_(other);
      return;
    case c10d::ReduceOp::BOR:
      out.bitwise_or_(other);
      return;
    case c10d::ReduceOp::BXOR:
      out.bitwise_xor_(other);
      return;
    default:
      TORCH_CHECK(false, "torus: no local reduction for this ReduceOp");
  }
}

}  // namespace

void accumulate_rows(at::Tensor& out, const at::Tensor& rows, const c10d::ReduceOp& op) {
  for (int64_t k = 0; k < rows.size(0); ++k) combine(out, rows[k], op);
}

void reduce_rows(at::Tensor& out, const at::Tensor& rows, const c10d::ReduceOp& op) {
  switch (op.op_) {  // one pass over the rows where ATen has one
    case c10d::ReduceOp::SUM:
    case c10d::ReduceOp::AVG:
      at::sum_out(out, rows, {0});
      return;
    case c10d::ReduceOp::PRODUCT:
      at::prod_out(out, rows, 0);
      return;
    case c10d::ReduceOp::MIN:
      at::amin_out(out, rows, {0});
      return;
    case c10d::ReduceOp::MAX:
      at::amax_out(out, rows, {0});
      return;
    default:
      out.copy_(rows[0]);
      accumulate_rows(out, rows.narrow(0, 1, rows.size(0) - 1), op);
  }
}

c10d::ReduceOp engine_op(const c10d::ReduceOp& op) {
  return op.op_ == c10d::ReduceOp::AVG ? c10d::ReduceOp(c10d::ReduceOp::SUM) : op;
}

void finish_average(at::Tensor& reduced, const c10d::ReduceOp& op, int64_t group_size) {
  if (op.op_ == c10d::ReduceOp::AVG) reduced.div_(group_size);
}

}  // namespace torch_bigbatch::torus
