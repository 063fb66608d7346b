// The torus allreduce on engines whose collectives complete on the host (Gloo, CPU tensors).
//
// A buffer is cut into segments; each goes through up to three phases: reduce-scatter along
// the row, allreduce along the column, allgather along the row. One progress thread issues
// every phase, in call order and segment order, so each group sees its collectives in the same
// order on every rank whatever the timing, while segment k+1 scatters as segment k crosses the
// column. Callbacks of the engines' futures only wake the thread.
#pragma once

#include "torus/scratch_pool.h"
#include "torus/topology.h"
#include "torus/torus_work.h"

#include <torch/csrc/distributed/c10d/Types.hpp>

#include <array>
#include <chrono>
#include <condition_variable>
#include <deque>
#include <memory>
#include <mutex>
#include <thread>

namespace torch_bigbatch::torus {

class HostPipeline {
 public:
  HostPipeline(TorusShape shape, Engines engines, int64_t segment_bytes,
               std::chrono::milliseconds timeout);
  ~HostPipeline();
  HostPipeline(const HostPipeline&) = delete;
  HostPipeline& operator=(const HostPipeline&) = delete;

  // Reduces `inputs` (one dtype, CPU) in place: one tensor for allreduce, several for
  // allreduce_coalesced (reduced as one flattened buffer).
  c10::intrusive_ptr<c10d::Work> allreduce(std::vector<at::Tensor> inputs, c10d::ReduceOp op,
                                           c10d::OpType op_type);

 private:
  enum Phase { kScatter = 0, kColumn = 1, kGather = 2, kPhases = 3 };
  // Segments started and not yet retired: two keep the row and the column busy at once; more
  // only add scratch memory and contention (measured on loopback: 4 was no faster than 2).
  static constexpr size_t kSegmentsInFlight = 2;
  struct Op;
  struct Segment;
  struct Shared;  // what the calling thread, the progress thread and callbacks share

  void run();
  bool advance();
  bool ready_for(Segment& segment, int phase);
  void issue(Segment& segment, int phase);
  void reduce_received(Segment& segment);
  void retire(Segment& segment);
  std::string phase_name(int phase) const;
  void fail_everything(const std::exception_ptr& error);

  const TorusShape shape_;
  const Engines engines_;
  const int64_t segment_bytes_;
  const std::chrono::milliseconds timeout_;
  std::array<bool, kPhases> active_;  // a row or column of one rank has no phase
  int first_phase_, last_phase_;

  std::shared_ptr<Shared> shared_;
  // Owned by the progress thread.
  std::deque<Segment> segments_;
  std::array<size_t, kPhases> issued_{};  // per phase: segments from the front already issued
  ScratchPool scratch_;
  std::thread thread_;
};

}  // namespace torch_bigbatch::torus
