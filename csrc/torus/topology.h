// The process groups a torus backend composes, for one device type. The torus moves no bytes
// itself: Gloo (CPU) or NCCL (CUDA) groups do, and the torus orders their collectives.
#pragma once

#include <torch/csrc/distributed/c10d/Backend.hpp>

#include <chrono>
#include <string>
#include <vector>

namespace torch_bigbatch::torus {

// Rank r of the group sits at column x = r mod X of row y = r div X.
struct TorusShape {
  int columns = 1;  // X: ranks per row
  int rows = 1;     // Y: ranks per column
  int rank = 0;

  int x() const { return rank % columns; }
  int y() const { return rank / columns; }
  std::vector<int> row_ranks() const;
  std::vector<int> column_ranks() const;
  std::string describe() const;  // "rank 5 at x=1, y=1 of a 4x4 torus"
};

// The phases of a torus allreduce. The host pipeline runs the column as a reduce-scatter and an
// allgather of its own, or as one allreduce, and small buffers as an allreduce along the row
// and one along the column; the stream pipeline runs NCCL's allreduce along the column.
// The stream pipeline first compares the ranks' calls across the whole group (Agreement).
enum class Phase {
  Agreement, RowScatter, RowAllreduce, ColumnScatter, ColumnAllreduce, ColumnGather, RowGather
};

// "reduce-scatter along row 1 (ranks 2, 3)": what a failure message names.
std::string describe_phase(const TorusShape& shape, Phase phase);

// How both pipelines report a failed or late phase of segment `segment` (0-based) of `segments`:
// "torus allreduce failed in the reduce-scatter along row 1 (ranks 2, 3) (rank 2 at x=0, y=1 of
// a 2x2 torus), segment 1 of 4: <the engine's message>" and "torus allreduce timed out after
// 5000 ms: rank 2 at x=0, y=1 of a 2x2 torus waits for the allgather along row 1 (ranks 2, 3),
// segment 1 of 4".
std::string describe_failure(const TorusShape& shape, Phase phase, int64_t segment,
                             int64_t segments, const std::string& message);
std::string describe_timeout(const TorusShape& shape, Phase phase, int64_t segment,
                             int64_t segments, std::chrono::milliseconds after);

// An error's message without its backtrace ("an unknown error" for what is not an exception).
std::string message_of(const std::exception_ptr& error);

// What an allreduce call is, as ranks compare it: its dtype and reduce op in one number, and
// "1000 Float elements with SUM".
int32_t call_kind(at::ScalarType dtype, const c10d::ReduceOp& op);
std::string describe_call(int64_t numel, int32_t kind);

// How both pipelines report ranks that passed different buffers: "torus allreduce: the ranks
// passed different buffers (<detail>; this rank, <where>, passed <call>): every rank must pass
// the same number of elements, dtype and op".
std::string describe_mismatch(const TorusShape& shape, const std::string& detail, int64_t numel,
                              int32_t kind);

// The row has a group per phase, so that phases of different segments run at once and every
// group sees its collectives in one fixed order; the column one group (on the host its
// reduce-scatter and allgather tell their messages apart by tag: host_pipeline.cpp).
struct Engines {
  c10::intrusive_ptr<c10d::Backend> whole;          // every rank: flat and delegated collectives
  c10::intrusive_ptr<c10d::Backend> row_scatter;    // this rank's row (null when X == 1)
  c10::intrusive_ptr<c10d::Backend> column;         // this rank's column (null when Y == 1): its
                                                    // reduce-scatter (host) or allreduce (CUDA)
  c10::intrusive_ptr<c10d::Backend> row_gather;     // this rank's row again (null when X == 1)
  // Whether the Works of these engines on device tensors order the caller's stream only once
  // they have run on the host: Gloo's CUDA collectives copy through host memory on its worker
  // threads and record the event their synchronize() waits for only at the end (before that it
  // orders nothing). NCCL's order the stream at once.
  bool ordered_on_host = false;

  // Makes the current stream wait for `work`, one of these engines' Works on device tensors:
  // at once, or (ordered_on_host) after the host has waited for it; throws its failure then.
  void follow(c10d::Work& work) const {
    if (ordered_on_host) {
      work.wait();  // then synchronize(), by Work::wait's contract
    } else {
      work.synchronize();
    }
  }
};

}  // namespace torch_bigbatch::torus
