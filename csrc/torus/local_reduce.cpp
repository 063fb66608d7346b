#include "torus/local_reduce.h"

#include <c10/util/Exception.h>

namespace torch_bigbatch::torus {

void reduce_rows(at::Tensor& out, const at::Tensor& rows, const c10d::ReduceOp& op) {
  switch (op.op_) {
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
    case c10d::ReduceOp::BAND:
    case c10d::ReduceOp::BOR:
    case c10d::ReduceOp::BXOR: {
      out.copy_(rows[0]);
      for (int64_t k = 1; k < rows.size(0); ++k) {
        if (op.op_ == c10d::ReduceOp::BAND) out.bitwise_and_(rows[k]);
        if (op.op_ == c10d::ReduceOp::BOR) out.bitwise_or_(rows[k]);
        if (op.op_ == c10d::ReduceOp::BXOR) out.bitwise_xor_(rows[k]);
      }
      return;
    }
    default:
      TORCH_CHECK(false, "torus: no local reduction for this ReduceOp");
  }
}

c10d::ReduceOp engine_op(const c10d::ReduceOp& op) {
  return op.op_ == c10d::ReduceOp::AVG ? c10d::ReduceOp(c10d::ReduceOp::SUM) : op;
}

void finish_average(at::Tensor& reduced, const c10d::ReduceOp& op, int64_t group_size) {
  if (op.op_ == c10d::ReduceOp::AVG) reduced.div_(group_size);
}

}  // namespace torch_bigbatch::torus
