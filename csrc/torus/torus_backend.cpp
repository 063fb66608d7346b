#include "torus/torus_backend.h"

#include "torus/local_reduce.h"

#include <c10/util/Exception.h>

namespace torch_bigbatch::torus {
namespace {

bool host_pipeline_supports(at::ScalarType dtype) {
  switch (dtype) {
    case at::kFloat:
    case at::kDouble:
    case at::kHalf:
    case at::kBFloat16:
    case at::kChar:
    case at::kByte:
    case at::kInt:
    case at::kLong:
      return true;
    default:
      return false;
  }
}

bool is_bitwise(const c10d::ReduceOp& op) {
  return op.op_ == c10d::ReduceOp::BAND || op.op_ == c10d::ReduceOp::BOR ||
         op.op_ == c10d::ReduceOp::BXOR;
}

}  // namespace

TorusBackend::TorusBackend(TorusShape shape, int size, std::optional<Engines> cpu,
                           std::optional<Engines> cuda, TorusSettings settings)
    : c10d::Backend(shape.rank, size),
      shape_(shape),
      settings_(settings),
      cpu_(std::move(cpu)),
      cuda_(std::move(cuda)) {
  TORCH_CHECK(shape_.columns * shape_.rows == size, "torus shape ", shape_.columns, "x",
              shape_.rows, " does not match the group size ", size);
  TORCH_CHECK(cpu_ || cuda_, "torus: no engine for any device");
  for (const auto* engines : {cpu_ ? &*cpu_ : nullptr, cuda_ ? &*cuda_ : nullptr}) {
    if (engines == nullptr) continue;
    TORCH_CHECK(engines->whole, "torus: an engine set has no whole-group process group");
    TORCH_CHECK((shape_.columns > 1) == bool(engines->row_scatter) &&
                    (shape_.columns > 1) == bool(engines->row_gather) &&
                    (shape_.rows > 1) == bool(engines->column),
                "torus: the row and column process groups do not match the shape ",
                shape_.columns, "x", shape_.rows);
  }
  if (cpu_) {
    host_ = std::make_unique<HostPipeline>(shape_, *cpu_, settings_.segment_bytes,
                                           settings_.timeout);
  }
  if (cuda_) {
    stream_ = std::make_unique<StreamPipeline>(shape_, *cuda_, settings_.segment_bytes,
                                               settings_.timeout);
  }
}

const Engines& TorusBackend::engines_for(c10::DeviceType device, const char* collective) const {
  if (device == c10::DeviceType::CPU && cpu_) return *cpu_;
  if (device == c10::DeviceType::CUDA && cuda_) return *cuda_;
  TORCH_CHECK(false, "torus ", collective, ": no engine for ", c10::DeviceTypeName(device),
              " tensors (the torus runs Gloo for CPU tensors and NCCL for CUDA tensors",
              device == c10::DeviceType::CUDA ? "; NCCL is not available here)" : ")");
}

c10d::Backend& TorusBackend::whole_for(const at::Tensor& tensor, const char* collective) const {
  return *engines_for(tensor.device().type(), collective).whole;
}

c10::intrusive_ptr<c10d::Work> TorusBackend::allreduce(std::vector<at::Tensor>& tensors,
                                                       const c10d::AllreduceOptions& opts) {
  TORCH_CHECK(tensors.size() == 1, "torus allreduce takes one tensor per call, got ",
              tensors.size());
  if (tensors[0].is_sparse()) return allreduce_sparse(tensors, opts);
  return torus_allreduce(tensors, opts.reduceOp, c10d::OpType::ALLREDUCE, "allreduce");
}

c10::intrusive_ptr<c10d::Work> TorusBackend::allreduce_coalesced(
    std::vector<at::Tensor>& tensors, const c10d::AllreduceCoalescedOptions& opts) {
  TORCH_CHECK(!tensors.empty(), "torus allreduce_coalesced: no tensors");
  return torus_allreduce(tensors, opts.reduceOp, c10d::OpType::ALLREDUCE_COALESCED,
                         "allreduce_coalesced");
}

c10::intrusive_ptr<c10d::Work> TorusBackend::torus_allreduce(std::vector<at::Tensor> tensors,
                                                             const c10d::ReduceOp& op,
                                                             c10d::OpType op_type,
                                                             const char* collective) {
  // Detached aliases from here on (the same memory, no autograd links): engine threads and the
  // progress thread may drop the last reference to what they hold, and a reference to the
  // caller's tensor would release its Python object there, which needs the GIL: fatal while
  // the interpreter exits.
  for (auto& tensor : tensors) tensor = tensor.detach();
  const at::Tensor& first = tensors.front();
  int64_t bytes = 0;
  for (const auto& tensor : tensors) {
    TORCH_CHECK(tensor.layout() == at::kStrided, "torus ", collective,
                ": tensors must be dense, got layout ", tensor.layout());
    TORCH_CHECK(tensor.scalar_type() == first.scalar_type() && tensor.device() == first.device(),
                "torus ", collective, ": every tensor must have the dtype and device of the "
                "first (", first.scalar_type(), " on ", first.device(), "), got ",
                tensor.scalar_type(), " on ", tensor.device());
    bytes += tensor.numel() * tensor.element_size();
  }
  const Engines& engines = engines_for(first.device().type(), collective);
  bool on_host = first.device().is_cpu();
  if (is_bitwise(op)) {
    TORCH_CHECK(!at::isFloatingType(first.scalar_type()) && !at::isComplexType(first.scalar_type()),
                "torus ", collective, ": bitwise ReduceOps need an integer tensor, got ",
                first.scalar_type());
  }

  // Small buffers, one-rank groups and PREMUL_SUM: one collective of the whole group.
  if (bytes < settings_.flat_threshold_bytes || getSize() == 1 ||
      op.op_ == c10d::ReduceOp::PREMUL_SUM) {
    bool emulate_average = on_host && op.op_ == c10d::ReduceOp::AVG;  // Gloo has no AVG
    c10d::ReduceOp engine = emulate_average ? engine_op(op) : op;
    c10::intrusive_ptr<c10d::Work> work;
    if (op_type == c10d::OpType::ALLREDUCE) {
      c10d::AllreduceOptions options;
      options.reduceOp = engine;
      work = engines.whole->allreduce(tensors, options);
    } else {
      c10d::AllreduceCoalescedOptions options;
      options.reduceOp = engine;
      work = engines.whole->allreduce_coalesced(tensors, options);
    }
    if (!emulate_average) return work;
    auto averaged = c10::make_intrusive<TorusWork>(getRank(), op_type, tensors);
    work->getFuture()->addCallback(
        [averaged, op, size = getSize()](c10::ivalue::Future& summed) {
          if (summed.hasError()) return averaged->fail(summed.exception_ptr());
          for (auto& tensor : averaged->result()) finish_average(tensor, op, size);
          averaged->complete();
        });
    return averaged;
  }

  if (on_host) {
    TORCH_CHECK(host_pipeline_supports(first.scalar_type()), "torus ", collective,
                ": dtype ", first.scalar_type(), " is not supported on CPU tensors");
    TORCH_CHECK(op.op_ != c10d::ReduceOp::AVG || at::isFloatingType(first.scalar_type()),
                "torus ", collective, ": ReduceOp.AVG needs a floating-point tensor, got ",
                first.scalar_type());
    TORCH_CHECK(host_, "torus ", collective, ": the backend was shut down");
    return host_->allreduce(std::move(tensors), op, op_type);
  }
  TORCH_CHECK(stream_, "torus ", collective, ": the backend was shut down");
  return stream_->allreduce(std::move(tensors), op, op_type);
}

c10::intrusive_ptr<c10d::Work> TorusBackend::allreduce_sparse(
    std::vector<at::Tensor>& tensors, const c10d::AllreduceOptions& opts) {
  return whole_for(tensors.at(0), "allreduce_sparse").allreduce_sparse(tensors, opts);
}

c10::intrusive_ptr<c10d::Work> TorusBackend::broadcast(std::vector<at::Tensor>& tensors,
                                                       const c10d::BroadcastOptions& opts) {
  return whole_for(tensors.at(0), "broadcast").broadcast(tensors, opts);
}

c10::intrusive_ptr<c10d::Work> TorusBackend::reduce(std::vector<at::Tensor>& tensors,
                                                    const c10d::ReduceOptions& opts) {
  return whole_for(tensors.at(0), "reduce").reduce(tensors, opts);
}

c10::intrusive_ptr<c10d::Work> TorusBackend::allgather(
    std::vector<std::vector<at::Tensor>>& outputs, std::vector<at::Tensor>& inputs,
    const c10d::AllgatherOptions& opts) {
  return whole_for(inputs.at(0), "allgather").allgather(outputs, inputs, opts);
}

c10::intrusive_ptr<c10d::Work> TorusBackend::_allgather_base(
    at::Tensor& output, at::Tensor& input, const c10d::AllgatherOptions& opts) {
  return whole_for(input, "all_gather_into_tensor")._allgather_base(output, input, opts);
}

c10::intrusive_ptr<c10d::Work> TorusBackend::allgather_coalesced(
    std::vector<std::vector<at::Tensor>>& outputs, std::vector<at::Tensor>& inputs,
    const c10d::AllgatherOptions& opts) {
  return whole_for(inputs.at(0), "allgather_coalesced").allgather_coalesced(outputs, inputs, opts);
}

c10::intrusive_ptr<c10d::Work> TorusBackend::allgather_into_tensor_coalesced(
    std::vector<at::Tensor>& outputs, std::vector<at::Tensor>& inputs,
    const c10d::AllgatherOptions& opts) {
  return whole_for(inputs.at(0), "allgather_into_tensor_coalesced")
      .allgather_into_tensor_coalesced(outputs, inputs, opts);
}

c10::intrusive_ptr<c10d::Work> TorusBackend::gather(
    std::vector<std::vector<at::Tensor>>& outputs, std::vector<at::Tensor>& inputs,
    const c10d::GatherOptions& opts) {
  return whole_for(inputs.at(0), "gather").gather(outputs, inputs, opts);
}

c10::intrusive_ptr<c10d::Work> TorusBackend::scatter(
    std::vector<at::Tensor>& outputs, std::vector<std::vector<at::Tensor>>& inputs,
    const c10d::ScatterOptions& opts) {
  return whole_for(outputs.at(0), "scatter").scatter(outputs, inputs, opts);
}

c10::intrusive_ptr<c10d::Work> TorusBackend::reduce_scatter(
    std::vector<at::Tensor>& outputs, std::vector<std::vector<at::Tensor>>& inputs,
    const c10d::ReduceScatterOptions& opts) {
  return whole_for(outputs.at(0), "reduce_scatter").reduce_scatter(outputs, inputs, opts);
}

c10::intrusive_ptr<c10d::Work> TorusBackend::_reduce_scatter_base(
    at::Tensor& output, at::Tensor& input, const c10d::ReduceScatterOptions& opts) {
  return whole_for(input, "reduce_scatter_tensor")._reduce_scatter_base(output, input, opts);
}

c10::intrusive_ptr<c10d::Work> TorusBackend::reduce_scatter_tensor_coalesced(
    std::vector<at::Tensor>& outputs, std::vector<at::Tensor>& inputs,
    const c10d::ReduceScatterOptions& opts) {
  return whole_for(inputs.at(0), "reduce_scatter_tensor_coalesced")
      .reduce_scatter_tensor_coalesced(outputs, inputs, opts);
}

c10::intrusive_ptr<c10d::Work> TorusBackend::alltoall_base(
    at::Tensor& output, at::Tensor& input, std::vector<int64_t>& output_split_sizes,
    std::vector<int64_t>& input_split_sizes, const c10d::AllToAllOptions& opts) {
  return whole_for(input, "all_to_all_single")
      .alltoall_base(output, input, output_split_sizes, input_split_sizes, opts);
}

c10::intrusive_ptr<c10d::Work> TorusBackend::alltoall(std::vector<at::Tensor>& outputs,
                                                      std::vector<at::Tensor>& inputs,
                                                      const c10d::AllToAllOptions& opts) {
  return whole_for(inputs.at(0), "all_to_all").alltoall(outputs, inputs, opts);
}

c10::intrusive_ptr<c10d::Work> TorusBackend::send(std::vector<at::Tensor>& tensors, int dst_rank,
                                                  int tag) {
  return whole_for(tensors.at(0), "send").send(tensors, dst_rank, tag);
}

c10::intrusive_ptr<c10d::Work> TorusBackend::recv(std::vector<at::Tensor>& tensors, int src_rank,
                                                  int tag) {
  return whole_for(tensors.at(0), "recv").recv(tensors, src_rank, tag);
}

c10::intrusive_ptr<c10d::Work> TorusBackend::recvAnysource(std::vector<at::Tensor>& tensors,
                                                           int tag) {
  return whole_for(tensors.at(0), "recv_anysource").recvAnysource(tensors, tag);
}

c10::intrusive_ptr<c10d::Work> TorusBackend::barrier(const c10d::BarrierOptions& opts) {
  c10::DeviceType device = opts.device ? opts.device->type()
                           : cpu_      ? c10::DeviceType::CPU
                                       : c10::DeviceType::CUDA;
  return engines_for(device, "barrier").whole->barrier(opts);
}

void TorusBackend::monitoredBarrier(const c10d::BarrierOptions& opts, bool wait_all_ranks) {
  engines_for(c10::DeviceType::CPU, "monitored_barrier").whole->monitoredBarrier(opts,
                                                                                wait_all_ranks);
}

void TorusBackend::setSequenceNumberForGroup() {
  engines_for(cpu_ ? c10::DeviceType::CPU : c10::DeviceType::CUDA, "sequence numbers")
      .whole->setSequenceNumberForGroup();
}

uint64_t TorusBackend::getSequenceNumberForGroup() {
  return engines_for(cpu_ ? c10::DeviceType::CPU : c10::DeviceType::CUDA, "sequence numbers")
      .whole->getSequenceNumberForGroup();
}

void TorusBackend::for_each_group(const std::function<void(c10d::Backend&)>& visit) {
  for (auto* engines : {cpu_ ? &*cpu_ : nullptr, cuda_ ? &*cuda_ : nullptr}) {
    if (engines == nullptr) continue;
    for (auto& group : {engines->whole, engines->row_scatter, engines->column, engines->row_gather})
      if (group) visit(*group);
  }
}

void TorusBackend::abort() {
  for_each_group([](c10d::Backend& group) { group.abort(); });
}

void TorusBackend::shutdown() {
  host_.reset();
  stream_.reset();
  for_each_group([](c10d::Backend& group) { group.shutdown(); });
}

}  // namespace torch_bigbatch::torus
