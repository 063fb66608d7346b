#include "torus/topology.h"

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

}  // namespace torch_bigbatch::torus
