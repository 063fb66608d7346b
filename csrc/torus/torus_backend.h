// c10d backend "torus": allreduce is the hierarchical 2D-torus of Mikami et al. 2018
// (reduce-scatter along the row, allreduce along the column, allgather along the row), composed
// from Gloo groups for CPU tensors and NCCL groups for CUDA tensors. Every other collective is
// delegated to the engine's whole-group process group, so DDP and torch.distributed run as is.
#pragma once

#include "torus/algorithm_tuner.h"
#include "torus/delegated_work.h"
#include "torus/host_pipeline.h"
#include "torus/stream_pipeline.h"
#include "torus/topology.h"
#include "torus/write_order.h"

#include <torch/csrc/distributed/c10d/Backend.hpp>

#include <functional>
#include <memory>
#include <mutex>
#include <optional>

namespace torch_bigbatch::torus {

// Which algorithm an allreduce runs, per device type (algorithm_tuner.h);
// torch_bigbatch/distributed/torus.py derives them from TorusOptions.
struct TorusSettings {
  DeviceTuning cpu, cuda;
  std::vector<PinnedClass> pinned;
  std::chrono::milliseconds timeout{std::chrono::minutes(30)};
  std::string group;  // how the tuner's log line names the group ("ranks 0-3 as 2x2")
  // The whole CPU group again, for the tuner's agreements in the background (none: it agrees
  // on the deciding call's thread, through the whole group).
  c10::intrusive_ptr<c10d::Backend> tuner;
};

class TorusBackend : public c10d::Backend {
 public:
  TorusBackend(TorusShape shape, int size, std::optional<Engines> cpu,
               std::optional<Engines> cuda, TorusSettings settings);

  const std::string getBackendName() const override { return "torus"; }
  const TorusShape& shape() const { return shape_; }
  const AlgorithmTuner& tuner() const { return tuner_; }

  c10::intrusive_ptr<c10d::Work> allreduce(std::vector<at::Tensor>& tensors,
                                           const c10d::AllreduceOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> allreduce_coalesced(
      std::vector<at::Tensor>& tensors, const c10d::AllreduceCoalescedOptions& opts) override;

  // Delegated to the whole group of the tensors' engine.
  c10::intrusive_ptr<c10d::Work> allreduce_sparse(std::vector<at::Tensor>& tensors,
                                                  const c10d::AllreduceOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> broadcast(std::vector<at::Tensor>& tensors,
                                           const c10d::BroadcastOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> reduce(std::vector<at::Tensor>& tensors,
                                        const c10d::ReduceOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> allgather(std::vector<std::vector<at::Tensor>>& outputs,
                                           std::vector<at::Tensor>& inputs,
                                           const c10d::AllgatherOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> _allgather_base(at::Tensor& output, at::Tensor& input,
                                                 const c10d::AllgatherOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> allgather_coalesced(
      std::vector<std::vector<at::Tensor>>& outputs, std::vector<at::Tensor>& inputs,
      const c10d::AllgatherOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> allgather_into_tensor_coalesced(
      std::vector<at::Tensor>& outputs, std::vector<at::Tensor>& inputs,
      const c10d::AllgatherOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> gather(std::vector<std::vector<at::Tensor>>& outputs,
                                        std::vector<at::Tensor>& inputs,
                                        const c10d::GatherOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> scatter(std::vector<at::Tensor>& outputs,
                                         std::vector<std::vector<at::Tensor>>& inputs,
                                         const c10d::ScatterOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> reduce_scatter(std::vector<at::Tensor>& outputs,
                                                std::vector<std::vector<at::Tensor>>& inputs,
                                                const c10d::ReduceScatterOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> _reduce_scatter_base(
      at::Tensor& output, at::Tensor& input, const c10d::ReduceScatterOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> reduce_scatter_tensor_coalesced(
      std::vector<at::Tensor>& outputs, std::vector<at::Tensor>& inputs,
      const c10d::ReduceScatterOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> alltoall_base(at::Tensor& output, at::Tensor& input,
                                               std::vector<int64_t>& output_split_sizes,
                                               std::vector<int64_t>& input_split_sizes,
                                               const c10d::AllToAllOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> alltoall(std::vector<at::Tensor>& outputs,
                                          std::vector<at::Tensor>& inputs,
                                          const c10d::AllToAllOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> send(std::vector<at::Tensor>& tensors, int dst_rank,
                                      int tag) override;
  c10::intrusive_ptr<c10d::Work> recv(std::vector<at::Tensor>& tensors, int src_rank,
                                      int tag) override;
  c10::intrusive_ptr<c10d::Work> recvAnysource(std::vector<at::Tensor>& tensors,
                                               int tag) override;
  c10::intrusive_ptr<c10d::Work> barrier(const c10d::BarrierOptions& opts) override;
  void monitoredBarrier(const c10d::BarrierOptions& opts, bool wait_all_ranks) override;
  void setSequenceNumberForGroup() override;
  uint64_t getSequenceNumberForGroup() override;
  void abort() override;
  void shutdown() override;

  // The engines of `device`'s tensors, or an error that names `collective` and why there are
  // none (also for a query about a device the group cannot run).
  const Engines& engines_for(c10::DeviceType device, const char* collective) const;

 private:
  // "torus broadcast failed in the broadcast of the whole group (rank 1 at ...): "
  std::string whole_group_failure(const char* collective) const;
  // On a device, before a collective of the whole group's engine is issued (whose stream waits
  // for the current one): the current stream waits for the torus allreduces in flight that
  // write memory `tensors` overlap (none: every one on the device, for a barrier), so that the
  // collective runs after them, as one engine runs its collectives in issue order
  // (write_order.h).
  void follow_torus_calls(const c10::Device& device, const std::vector<at::Tensor>* tensors);
  // A collective the whole group runs as it is, its failure named (DelegatedWork); `touched`:
  // its tensors (follow_torus_calls).
  template <typename Call>
  c10::intrusive_ptr<c10d::Work> delegate(const c10::Device& device, const char* collective,
                                          const std::vector<at::Tensor>* touched, Call&& call) {
    c10d::Backend& whole = *engines_for(device.type(), collective).whole;
    // On a device the pipeline's comparison runs on the whole group: after its failure (this
    // rank's call may have ended before its comparison), a collective here could pair with the
    // peers' comparison.
    if (!device.is_cpu()) failure_->check_usable();
    follow_torus_calls(device, touched);
    c10::intrusive_ptr<c10d::Work> work = call(whole);
    // No Work: the engine ran it on the caller's stream already (NCCL for asyncOp=false, from
    // torch 2.8); torch.distributed then waits for nothing, and neither do we.
    if (!work) return work;
    return c10::make_intrusive<DelegatedWork>(std::move(work), whole_group_failure(collective));
  }
  c10::intrusive_ptr<c10d::Work> torus_allreduce(std::vector<at::Tensor> tensors,
                                                 const c10d::ReduceOp& op,
                                                 c10d::OpType op_type, const char* collective);
  c10::intrusive_ptr<c10d::Work> pipeline_allreduce(std::vector<at::Tensor> tensors,
                                                    const c10d::ReduceOp& op,
                                                    c10d::OpType op_type, const char* collective,
                                                    const Choice& choice);
  c10::intrusive_ptr<c10d::Work> whole_allreduce(const Engines& engines,
                                                 std::vector<at::Tensor> tensors,
                                                 const c10d::ReduceOp& op, c10d::OpType op_type);
  c10::intrusive_ptr<c10d::Work> whole_allreduce_on_host(const Engines& engines,
                                                         std::vector<at::Tensor> tensors,
                                                         const c10d::ReduceOp& op,
                                                         c10d::OpType op_type);
  c10::intrusive_ptr<c10d::Work> whole_allreduce_on_device(const Engines& engines,
                                                           std::vector<at::Tensor> tensors,
                                                           const c10d::ReduceOp& op,
                                                           c10d::OpType op_type);
  void for_each_group(const std::function<void(c10d::Backend&)>& visit);

  const TorusShape shape_;
  const std::chrono::milliseconds timeout_;
  std::optional<Engines> cpu_, cuda_;
  // The first failure of any allreduce: the tuner and both pipelines record it and refuse after.
  const std::shared_ptr<BackendFailure> failure_ = std::make_shared<BackendFailure>();
  // The order in which its Works end: the order they were issued in (delivery_order.h), CPU and
  // CUDA calls alike (callbacks of either may issue collectives on this group).
  const std::shared_ptr<DeliveryOrder> delivery_order_ =
      std::make_shared<DeliveryOrder>(timeout_, failure_);
  AlgorithmTuner tuner_;
  // Shared with the calls in flight: shutdown() drops them while another thread may be in an
  // allreduce (a DDP hook's), which keeps its pipeline until it returns.
  std::mutex pipelines_mutex_;  // guards host_ and stream_ themselves
  std::shared_ptr<HostPipeline> host_;
  std::shared_ptr<StreamPipeline> stream_;
  // Which torus calls in flight write which memory, for the whole group's collectives too.
  const std::shared_ptr<WriteOrder> writes_ = std::make_shared<WriteOrder>();
};

}  // namespace torch_bigbatch::torus
