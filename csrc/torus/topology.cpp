#include "torus/topology.h"

#include <c10/util/Exception.h>
#include <c10/util/StringUtil.h>

namespace torch_bigbatch::torus {

std::vector<int> TorusShape::row_ranks() const {
  std::vector<int> ranks;
  for (int i = 0; i < columns; ++i) ranks.push_back(y() * columns + i);
  return ranks;
}

std::vector<int> TorusShape::column_ranks() const {
  std::vector<int> ranks;
  for (int j = 0; j < rows; ++j) ranks.push_back(j * columns + x());
  return ranks;
}

std::string TorusShape::describe() const {
  return c10::str("rank ", rank, " at x=", x(), ", y=", y(), " of a ", columns, "x", rows,
                  " torus");
}

std::string describe_phase(const TorusShape& shape, Phase phase) {
  auto list = [](const std::vector<int>& ranks) {
    std::string text;
    for (int rank : ranks) text += (text.empty() ? "" : ", ") + std::to_string(rank);
    return "ranks " + text;
  };
  const std::string row = c10::str("row ", shape.y(), " (", list(shape.row_ranks()), ")");
  const std::string column =
      c10::str("column ", shape.x(), " (", list(shape.column_ranks()), ")");
  switch (phase) {
    case Phase::Agreement: return "comparison of the ranks' calls across the whole group";
    case Phase::RowScatter: return "reduce-scatter along " + row;
    case Phase::RowAllreduce: return "allreduce along " + row;
    case Phase::ColumnScatter: return "reduce-scatter along " + column;
    case Phase::ColumnAllreduce: return "allreduce along " + column;
    case Phase::ColumnGather: return "allgather along " + column;
    case Phase::RowGather: return "allgather along " + row;
  }
  return "unknown phase";
}

std::string describe_failure(const TorusShape& shape, Phase phase, int64_t segment,
                             int64_t segments, const std::string& message) {
  return c10::str("torus allreduce failed in the ", describe_phase(shape, phase), " (",
                  shape.describe(), "), segment ", segment + 1, " of ", segments, ": ", message);
}

std::string describe_timeout(const TorusShape& shape, Phase phase, int64_t segment,
                             int64_t segments, std::chrono::milliseconds after) {
  return c10::str("torus allreduce timed out after ", after.count(), " ms: ", shape.describe(),
                  " waits for the ", describe_phase(shape, phase), ", segment ", segment + 1,
                  " of ", segments);
}

std::string message_of(const std::exception_ptr& error) {
  try {
    std::rethrow_exception(error);
  } catch (const c10::Error& e) {
    return e.what_without_backtrace();
  } catch (const std::exception& e) {
    return e.what();
  } catch (...) {
    return "an unknown error";
  }
}

int32_t call_kind(at::ScalarType dtype, const c10d::ReduceOp& op) {
  return static_cast<int32_t>(dtype) << 8 | static_cast<int32_t>(op.op_);
}

std::string describe_call(int64_t numel, int32_t kind) {
  static const char* ops[] = {"SUM", "AVG", "PRODUCT", "MIN", "MAX", "BAND", "BOR", "BXOR"};
  const int op = kind & 0xff;
  return c10::str(numel, " ", static_cast<at::ScalarType>(kind >> 8), " elements with ",
                  op < 8 ? ops[op] : "another op");
}

std::string describe_mismatch(const TorusShape& shape, const std::string& detail, int64_t numel,
                              int32_t kind) {
  return c10::str("torus allreduce: the ranks passed different buffers (", detail,
                  "; this rank, ", shape.describe(), ", passed ", describe_call(numel, kind),
                  "): every rank must pass the same number of elements, dtype and op");
}

}  // namespace torch_bigbatch::torus
