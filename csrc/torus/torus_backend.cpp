#include "torus/torus_backend.h"

#include "torus/delegated_work.h"
#include "torus/local_reduce.h"

#include <ATen/MemoryOverlap.h>
#include <c10/core/DeviceGuard.h>
#include <c10/core/InferenceMode.h>
#include <c10/core/impl/VirtualGuardImpl.h>
#include <c10/util/Exception.h>

namespace torch_bigbatch::torus {
namespace {

bool pipeline_supports(at::ScalarType dtype) {
  switch (dtype) {
    case at::kBool:
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

// Whether the calling thread's current stream on `device` is capturing a graph (never on the
// host, nor on a device whose glue this build lacks).
bool capturing(const c10::Device& device) {
  const auto check = CaptureChecks::find(device.type());
  return check != nullptr && check(device);
}

// The tensors a collective reads or writes, as one list (for the write order of the torus's
// calls: write_order.h).
void add_tensors(std::vector<at::Tensor>& all, const at::Tensor& tensor) {
  all.push_back(tensor);
}
void add_tensors(std::vector<at::Tensor>& all, const std::vector<at::Tensor>& tensors) {
  all.insert(all.end(), tensors.begin(), tensors.end());
}
void add_tensors(std::vector<at::Tensor>& all,
                 const std::vector<std::vector<at::Tensor>>& lists) {
  for (const auto& tensors : lists) add_tensors(all, tensors);
}
template <typename... Parts>
std::vector<at::Tensor> tensors_of(const Parts&... parts) {
  std::vector<at::Tensor> all;
  (add_tensors(all, parts), ...);
  return all;
}

bool is_bitwise(const c10d::ReduceOp& op) {
  return op.op_ == c10d::ReduceOp::BAND || op.op_ == c10d::ReduceOp::BOR ||
         op.op_ == c10d::ReduceOp::BXOR;
}

// The host pipeline has a one-shot form for small buffers (see kOneShotBytes); its trials, and
// those of device engines ordered on the host, run by the host's clock.
DeviceTuning on_host(DeviceTuning tuning) {
  tuning.one_shot_max_bytes = kOneShotBytes;
  tuning.host_clock = true;
  return tuning;
}

DeviceTuning on_device(DeviceTuning tuning, const std::optional<Engines>& engines) {
  tuning.host_clock = engines && engines->ordered_on_host;
  return tuning;
}

}  // namespace

TorusBackend::TorusBackend(TorusShape shape, int size, std::optional<Engines> cpu,
                           std::optional<Engines> cuda, TorusSettings settings)
    : c10d::Backend(shape.rank, size),
      shape_(shape),
      timeout_(settings.timeout),
      cpu_(std::move(cpu)),
      cuda_(std::move(cuda)),
      tuner_(shape.rank, std::move(settings.group), on_host(settings.cpu),
             on_device(settings.cuda, cuda_),
             std::move(settings.pinned), cpu_ ? cpu_->whole : nullptr,
             std::move(settings.tuner), settings.timeout, failure_) {
  TORCH_CHECK(shape_.columns * shape_.rows == size, "torus shape ", shape_.columns, "x",
              shape_.rows, " does not match the group size ", size);
  TORCH_CHECK(cpu_, "torus: the CPU engines (Gloo) are missing: the tuner agrees through them");
  for (const auto* engines : {cpu_ ? &*cpu_ : nullptr, cuda_ ? &*cuda_ : nullptr}) {
    if (engines == nullptr) continue;
    TORCH_CHECK(engines->whole, "torus: an engine set has no whole-group process group");
    TORCH_CHECK((shape_.columns > 1) == bool(engines->row_scatter) &&
                    (shape_.columns > 1) == bool(engines->row_gather) &&
                    (shape_.rows > 1) == bool(engines->column),
                "torus: the row and column process groups do not match the shape ",
                shape_.columns, "x", shape_.rows);
  }
  host_ = std::make_shared<HostPipeline>(shape_, *cpu_, failure_, delivery_order_);
  if (cuda_)
    stream_ = std::make_shared<StreamPipeline>(shape_, *cuda_, timeout_, failure_, delivery_order_,
                                               writes_);
}

const Engines& TorusBackend::engines_for(c10::DeviceType device, const char* collective) const {
  if (device == c10::DeviceType::CPU && cpu_) return *cpu_;
  if (device == c10::DeviceType::CUDA && cuda_) return *cuda_;
#ifdef TORCH_BIGBATCH_WITH_CUDA
  const char* no_cuda = "; there is no CUDA device or no NCCL here)";
#else
  const char* no_cuda = "; this build of torch_bigbatch has no CUDA half: reinstall it where "
                        "nvcc is found, without TORCH_BIGBATCH_CPU_ONLY=1)";
#endif
  TORCH_CHECK(false, "torus ", collective, ": no engine for ", c10::DeviceTypeName(device),
              " tensors (the torus runs Gloo for CPU tensors and NCCL for CUDA tensors",
              device == c10::DeviceType::CUDA ? no_cuda : ")");
}

std::string TorusBackend::whole_group_failure(const char* collective) const {
  return std::string("torus ") + collective + " failed in the " + collective +
         " of the whole group (" + shape_.describe() + "): ";
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
  // Aliases from here on (the same memory, no autograd links, a version counter of their own):
  // engine threads may drop the last reference to what they hold, and a reference to the
  // caller's tensor would release its Python object there, which needs the GIL (fatal while
  // the interpreter exits); and the phases write the result with ATen ops, which would bump the
  // caller's counter where Gloo's allreduce (and the flat path) leaves it: the backward of a
  // tensor saved, then reduced, raised or not as the tuner chose.
  for (auto& tensor : tensors) tensor = tensor.variable_data();
  // The torus writes results with ATen ops, here and on its threads, all in inference mode (on
  // the aliases, which no autograd graph holds): an inference tensor, made under
  // torch.inference_mode() (an evaluation's sums), is refused an in-place op outside it, and
  // that refusal failed the backend where Gloo writes it raw.
  const c10::InferenceMode writes_anything;
  // As ProcessGroupNCCL enqueues: on the tensors' device (the tuner's and the pipeline's CUDA
  // events, recorded from another current device, return to it with cudaSetDevice, which
  // creates a context there if it had none: GPU 0's, in every rank of another GPU).
  c10::OptionalDeviceGuard on_their_device;
  if (tensors.front().is_cuda()) on_their_device.reset_device(tensors.front().device());
  const at::Tensor& first = tensors.front();
  int64_t bytes = 0;
  for (const auto& tensor : tensors) {
    TORCH_CHECK(tensor.layout() == at::kStrided, "torus ", collective,
                ": tensors must be dense, got layout ", tensor.layout());
    // (an expanded view: its result could not be written back, after every rank had sent)
    TORCH_CHECK(at::has_internal_overlap(tensor) != at::MemOverlap::Yes, "torus ", collective,
                ": a tensor whose elements share memory (an expanded view) cannot hold a result; "
                "pass a copy (.clone())");
    TORCH_CHECK(tensor.scalar_type() == first.scalar_type() && tensor.device() == first.device(),
                "torus ", collective, ": every tensor must have the dtype and device of the "
                "first (", first.scalar_type(), " on ", first.device(), "), got ",
                tensor.scalar_type(), " on ", tensor.device());
    bytes += tensor.numel() * tensor.element_size();
  }
  const at::ScalarType dtype = first.scalar_type();
  // One division of the sum for every path and device: an integer mean would round twice in
  // the torus, and Gloo has no AVG; the caller chooses how to round.
  TORCH_CHECK(op.op_ != c10d::ReduceOp::AVG || at::isFloatingType(dtype), "torus ", collective,
              ": ReduceOp.AVG needs a floating-point tensor, got ", dtype,
              " (reduce with ReduceOp.SUM and divide as your integers need)");
  if (is_bitwise(op)) {
    TORCH_CHECK(!at::isFloatingType(dtype) && !at::isComplexType(dtype), "torus ", collective,
                ": bitwise ReduceOps need an integer or bool tensor, got ", dtype);
  }
  failure_->check_usable();  // every path, the whole group's own allreduce too
  const Engines& engines = engines_for(first.device().type(), collective);
  const bool on_host = first.device().is_cpu();
  // Also a call captured into a CUDA graph (NCCL's allreduce can be captured, the pipeline and
  // the tuner's trials cannot: see CaptureChecks; Gloo's host copies cannot either).
  const bool captured = capturing(first.device());
  TORCH_CHECK(!captured || !engines.ordered_on_host, "torus ", collective,
              ": a CUDA graph cannot capture the Gloo CUDA engine (TorusOptions.cuda_engine "
              "'gloo', which works through host memory); capture with engine 'nccl'");
  // Refused here, before any path: Gloo refuses them through its Work, and a failed Work is
  // the backend's failure (every later call refused), where the call never reached the wire.
  if (on_host) {
    TORCH_CHECK(pipeline_supports(dtype) || (getSize() == 1 && at::isComplexType(dtype)),
                "torus ", collective, ": dtype ", dtype, " is not supported on CPU tensors "
                "(float, double, half, bfloat16, bool, int8, uint8, int32 and int64 are; complex "
                "ones on one rank, or through torch.distributed.all_reduce, which reduces them "
                "as real)");
    TORCH_CHECK(op.op_ != c10d::ReduceOp::PREMUL_SUM, "torus ", collective,
                ": ReduceOp.PREMUL_SUM is not supported on CPU tensors (Gloo has none); "
                "multiply, then reduce with SUM");
  }
  // What the device pipeline cannot run goes to the engine's own allreduce, which reduces it
  // (complex as real on NCCL) or refuses this call alone (a bitwise op, a dtype NCCL lacks),
  // as the engine does: refused inside the pipeline, it failed the backend for every later
  // call, or, during a class's trials, the class's decision.
  const bool pipeline_runs = pipeline_supports(dtype) && (on_host || !is_bitwise(op));
  if (getSize() == 1 || op.op_ == c10d::ReduceOp::PREMUL_SUM || captured || !pipeline_runs)
    return whole_allreduce(engines, std::move(tensors), op, op_type);
  const AlgorithmTuner::Call call = tuner_.begin(first.device(), bytes);
  c10::intrusive_ptr<c10d::Work> work;
  try {
    work = call.choice.algorithm == Algorithm::Flat
               ? whole_allreduce(engines, std::move(tensors), op, op_type)
               : pipeline_allreduce(std::move(tensors), op, op_type, collective, call.choice);
  } catch (...) {
    tuner_.abandon(call, std::current_exception());
    throw;
  }
  tuner_.finish(call, work);
  return work;
}

c10::intrusive_ptr<c10d::Work> TorusBackend::pipeline_allreduce(std::vector<at::Tensor> tensors,
                                                                const c10d::ReduceOp& op,
                                                                c10d::OpType op_type,
                                                                const char* collective,
                                                                const Choice& choice) {
  std::shared_ptr<HostPipeline> host;
  std::shared_ptr<StreamPipeline> stream;
  {
    std::lock_guard<std::mutex> lock(pipelines_mutex_);
    host = host_;
    stream = stream_;
  }
  if (tensors.front().device().is_cpu()) {
    TORCH_CHECK(host, "torus ", collective, ": the backend was shut down");
    return host->allreduce(std::move(tensors), op, op_type, choice.segment_bytes,
                           choice.one_shot);
  }
  TORCH_CHECK(stream, "torus ", collective, ": the backend was shut down");
  TORCH_INTERNAL_ASSERT(!choice.one_shot, "the stream pipeline has no one-shot form");
  return stream->allreduce(std::move(tensors), op, op_type, choice.segment_bytes);
}

namespace {

c10::intrusive_ptr<c10d::Work> engine_allreduce(c10d::Backend& whole,
                                                std::vector<at::Tensor>& tensors,
                                                const c10d::ReduceOp& op, c10d::OpType op_type) {
  if (op_type == c10d::OpType::ALLREDUCE) {
    c10d::AllreduceOptions options;
    options.reduceOp = op;
    return whole.allreduce(tensors, options);
  }
  c10d::AllreduceCoalescedOptions options;
  options.reduceOp = op;
  return whole.allreduce_coalesced(tensors, options);
}

}  // namespace

c10::intrusive_ptr<c10d::Work> TorusBackend::whole_allreduce(const Engines& engines,
                                                             std::vector<at::Tensor> tensors,
                                                             const c10d::ReduceOp& op,
                                                             c10d::OpType op_type) {
  if (tensors.front().device().is_cpu())
    return whole_allreduce_on_host(engines, std::move(tensors), op, op_type);
  return whole_allreduce_on_device(engines, std::move(tensors), op, op_type);
}

// On the host the torus divides AVG (Gloo has no AVG) and reduces contiguous copies of
// non-contiguous tensors (Gloo reads them as if they were contiguous: a wrong result), written
// back when the engine is done; the Work completes after that, on a callback thread, as the
// pipelines' do: a callback of Gloo's own Work would run on one of the group's two worker
// threads, and two callbacks that wait for another allreduce there (PowerSGD's hook does; so
// does the tuner's agreement when the nested call decides its size class) hung for ever.
c10::intrusive_ptr<c10d::Work> TorusBackend::whole_allreduce_on_host(
    const Engines& engines, std::vector<at::Tensor> tensors, const c10d::ReduceOp& op,
    c10d::OpType op_type) {
  std::vector<at::Tensor> reduced = tensors;
  c10d::ReduceOp finish_op = op;
  for (auto& tensor : reduced) {
    tensor = tensor.contiguous();  // itself when it is contiguous
    finish_op = divide_first_if_half(tensor, op, getSize());
  }
  c10::intrusive_ptr<c10d::Work> work =
      engine_allreduce(*engines.whole, reduced, engine_op(finish_op), op_type);
  auto finished = c10::make_intrusive<TorusWork>(getRank(), op_type, tensors, delivery_order_);
  work->getFuture()->addCallback([finished, reduced, op = finish_op, size = getSize(),
                                  message = whole_group_failure("allreduce"),
                                  failure = failure_](c10::ivalue::Future& done) mutable {
    const c10::InferenceMode writes_anything;  // (see torus_allreduce)
    try {
      TORCH_CHECK_WITH(DistBackendError, !done.hasError(), message,
                       done.hasError() ? done.tryRetrieveErrorMessage() : "");
      std::vector<at::Tensor> outputs = finished->result();
      for (size_t i = 0; i < reduced.size(); ++i) {
        finish_average(reduced[i], op, size);
        if (!reduced[i].is_same(outputs[i])) outputs[i].copy_(reduced[i]);
      }
      finished->complete();
    } catch (...) {
      // The backend's first failure, as the pipelines' are: the next call, on other groups
      // perhaps, is refused at once instead of waiting a timeout of its own.
      failure->record(std::current_exception());
      finished->fail(std::current_exception());
    }
  });
  return finished;
}

// On the device the engine's own Work is the caller's (through DelegatedWork, which names its
// failures): its wait() makes the current stream wait for the collective, its future carries
// the device's events, and its errors and timeouts reach it. NCCL has AVG, so the one division
// is its own; Gloo's CUDA AVG sums, then divides, so there float16 is divided first here, as
// NCCL divides it (divide_first_if_half). A layout NCCL refuses (a strided view) is reduced as
// a dense copy, copied back on the calling stream after it has waited for the collective; the
// Work's wait then also waits for that copy (on another stream it would read the old values).
c10::intrusive_ptr<c10d::Work> TorusBackend::whole_allreduce_on_device(
    const Engines& engines, std::vector<at::Tensor> tensors, const c10d::ReduceOp& op,
    c10d::OpType op_type) {
  follow_torus_calls(tensors.front().device(), &tensors);
  std::vector<at::Tensor> reduced = tensors;
  bool copied = false;
  c10d::ReduceOp engine = op;
  for (auto& tensor : reduced) {
    if (!tensor.is_contiguous(tensor.suggest_memory_format())) {
      tensor = tensor.contiguous();
      copied = true;
    }
    if (engines.ordered_on_host) engine = divide_first_if_half(tensor, op, getSize());
  }
  c10::intrusive_ptr<c10d::Work> work =
      engine_allreduce(*engines.whole, reduced, engine, op_type);
  std::shared_ptr<c10::Event> copied_back;
  if (copied) {
    engines.follow(*work);
    for (size_t i = 0; i < reduced.size(); ++i)
      if (!reduced[i].is_same(tensors[i])) tensors[i].copy_(reduced[i]);
    const c10::Device device = tensors.front().device();
    copied_back = std::make_shared<c10::Event>(device.type());
    copied_back->record(c10::impl::VirtualGuardImpl(device.type()).getStream(device));
  }
  return c10::make_intrusive<DelegatedWork>(std::move(work), whole_group_failure("allreduce"),
                                            std::move(copied_back));
}

void TorusBackend::follow_torus_calls(const c10::Device& device,
                                      const std::vector<at::Tensor>* tensors) {
  // (On the host, async collectives on one tensor race as they do over Gloo, whose two worker
  // threads run them at once: a caller waits between them.)
  if (device.is_cpu()) return;
  c10::impl::VirtualGuardImpl guard_impl(device.type());
  // (a barrier without device_ids names no index: the current device's stream waits)
  const c10::Device on = device.has_index() ? device : guard_impl.getDevice();
  // A capture cannot wait for an event recorded outside it (the pipeline never runs in one).
  if (capturing(on)) return;
  // (an event the last Work released here is destroyed on its device, as ProcessGroupNCCL's)
  const c10::DeviceGuard on_its_device(on);
  const c10::Stream current = guard_impl.getStream(on);
  if (tensors) {
    writes_->follow_writes_to(*tensors, current);
  } else {
    writes_->follow_all(current);
  }
}

c10::intrusive_ptr<c10d::Work> TorusBackend::allreduce_sparse(
    std::vector<at::Tensor>& tensors, const c10d::AllreduceOptions& opts) {
  const std::vector<at::Tensor> touched = tensors_of(tensors);
  return delegate(tensors.at(0).device(), "allreduce_sparse", &touched, [&](c10d::Backend& whole) {
    return whole.allreduce_sparse(tensors, opts);
  });
}

c10::intrusive_ptr<c10d::Work> TorusBackend::broadcast(std::vector<at::Tensor>& tensors,
                                                       const c10d::BroadcastOptions& opts) {
  const std::vector<at::Tensor> touched = tensors_of(tensors);
  return delegate(tensors.at(0).device(), "broadcast", &touched, [&](c10d::Backend& whole) {
    return whole.broadcast(tensors, opts);
  });
}

c10::intrusive_ptr<c10d::Work> TorusBackend::reduce(std::vector<at::Tensor>& tensors,
                                                    const c10d::ReduceOptions& opts) {
  const std::vector<at::Tensor> touched = tensors_of(tensors);
  return delegate(tensors.at(0).device(), "reduce", &touched, [&](c10d::Backend& whole) {
    return whole.reduce(tensors, opts);
  });
}

c10::intrusive_ptr<c10d::Work> TorusBackend::allgather(
    std::vector<std::vector<at::Tensor>>& outputs, std::vector<at::Tensor>& inputs,
    const c10d::AllgatherOptions& opts) {
  const std::vector<at::Tensor> touched = tensors_of(outputs, inputs);
  return delegate(inputs.at(0).device(), "allgather", &touched, [&](c10d::Backend& whole) {
    return whole.allgather(outputs, inputs, opts);
  });
}

c10::intrusive_ptr<c10d::Work> TorusBackend::_allgather_base(
    at::Tensor& output, at::Tensor& input, const c10d::AllgatherOptions& opts) {
  const std::vector<at::Tensor> touched = tensors_of(output, input);
  return delegate(input.device(), "all_gather_into_tensor", &touched, [&](c10d::Backend& whole) {
    return whole._allgather_base(output, input, opts);
  });
}

c10::intrusive_ptr<c10d::Work> TorusBackend::allgather_coalesced(
    std::vector<std::vector<at::Tensor>>& outputs, std::vector<at::Tensor>& inputs,
    const c10d::AllgatherOptions& opts) {
  const std::vector<at::Tensor> touched = tensors_of(outputs, inputs);
  return delegate(inputs.at(0).device(), "allgather_coalesced", &touched,
                  [&](c10d::Backend& whole) {
    return whole.allgather_coalesced(outputs, inputs, opts);
  });
}

c10::intrusive_ptr<c10d::Work> TorusBackend::allgather_into_tensor_coalesced(
    std::vector<at::Tensor>& outputs, std::vector<at::Tensor>& inputs,
    const c10d::AllgatherOptions& opts) {
  const std::vector<at::Tensor> touched = tensors_of(outputs, inputs);
  return delegate(inputs.at(0).device(), "allgather_into_tensor_coalesced", &touched,
                  [&](c10d::Backend& whole) {
    return whole.allgather_into_tensor_coalesced(outputs, inputs, opts);
  });
}

c10::intrusive_ptr<c10d::Work> TorusBackend::gather(
    std::vector<std::vector<at::Tensor>>& outputs, std::vector<at::Tensor>& inputs,
    const c10d::GatherOptions& opts) {
  const std::vector<at::Tensor> touched = tensors_of(outputs, inputs);
  return delegate(inputs.at(0).device(), "gather", &touched, [&](c10d::Backend& whole) {
    return whole.gather(outputs, inputs, opts);
  });
}

c10::intrusive_ptr<c10d::Work> TorusBackend::scatter(
    std::vector<at::Tensor>& outputs, std::vector<std::vector<at::Tensor>>& inputs,
    const c10d::ScatterOptions& opts) {
  const std::vector<at::Tensor> touched = tensors_of(outputs, inputs);
  return delegate(outputs.at(0).device(), "scatter", &touched, [&](c10d::Backend& whole) {
    return whole.scatter(outputs, inputs, opts);
  });
}

c10::intrusive_ptr<c10d::Work> TorusBackend::reduce_scatter(
    std::vector<at::Tensor>& outputs, std::vector<std::vector<at::Tensor>>& inputs,
    const c10d::ReduceScatterOptions& opts) {
  const std::vector<at::Tensor> touched = tensors_of(outputs, inputs);
  return delegate(outputs.at(0).device(), "reduce_scatter", &touched, [&](c10d::Backend& whole) {
    return whole.reduce_scatter(outputs, inputs, opts);
  });
}

c10::intrusive_ptr<c10d::Work> TorusBackend::_reduce_scatter_base(
    at::Tensor& output, at::Tensor& input, const c10d::ReduceScatterOptions& opts) {
  const std::vector<at::Tensor> touched = tensors_of(output, input);
  return delegate(input.device(), "reduce_scatter_tensor", &touched, [&](c10d::Backend& whole) {
    return whole._reduce_scatter_base(output, input, opts);
  });
}

c10::intrusive_ptr<c10d::Work> TorusBackend::reduce_scatter_tensor_coalesced(
    std::vector<at::Tensor>& outputs, std::vector<at::Tensor>& inputs,
    const c10d::ReduceScatterOptions& opts) {
  const std::vector<at::Tensor> touched = tensors_of(outputs, inputs);
  return delegate(inputs.at(0).device(), "reduce_scatter_tensor_coalesced", &touched,
                  [&](c10d::Backend& whole) {
    return whole.reduce_scatter_tensor_coalesced(outputs, inputs, opts);
  });
}

c10::intrusive_ptr<c10d::Work> TorusBackend::alltoall_base(
    at::Tensor& output, at::Tensor& input, std::vector<int64_t>& output_split_sizes,
    std::vector<int64_t>& input_split_sizes, const c10d::AllToAllOptions& opts) {
  const std::vector<at::Tensor> touched = tensors_of(output, input);
  return delegate(input.device(), "all_to_all_single", &touched, [&](c10d::Backend& whole) {
    return whole.alltoall_base(output, input, output_split_sizes, input_split_sizes, opts);
  });
}

c10::intrusive_ptr<c10d::Work> TorusBackend::alltoall(std::vector<at::Tensor>& outputs,
                                                      std::vector<at::Tensor>& inputs,
                                                      const c10d::AllToAllOptions& opts) {
  const std::vector<at::Tensor> touched = tensors_of(outputs, inputs);
  return delegate(inputs.at(0).device(), "all_to_all", &touched, [&](c10d::Backend& whole) {
    return whole.alltoall(outputs, inputs, opts);
  });
}

c10::intrusive_ptr<c10d::Work> TorusBackend::send(std::vector<at::Tensor>& tensors, int dst_rank,
                                                  int tag) {
  const std::vector<at::Tensor> touched = tensors_of(tensors);
  return delegate(tensors.at(0).device(), "send", &touched, [&](c10d::Backend& whole) {
    return whole.send(tensors, dst_rank, tag);
  });
}

c10::intrusive_ptr<c10d::Work> TorusBackend::recv(std::vector<at::Tensor>& tensors, int src_rank,
                                                  int tag) {
  const std::vector<at::Tensor> touched = tensors_of(tensors);
  return delegate(tensors.at(0).device(), "recv", &touched, [&](c10d::Backend& whole) {
    return whole.recv(tensors, src_rank, tag);
  });
}

c10::intrusive_ptr<c10d::Work> TorusBackend::recvAnysource(std::vector<at::Tensor>& tensors,
                                                           int tag) {
  const std::vector<at::Tensor> touched = tensors_of(tensors);
  return delegate(tensors.at(0).device(), "recv_anysource", &touched, [&](c10d::Backend& whole) {
    return whole.recvAnysource(tensors, tag);
  });
}

c10::intrusive_ptr<c10d::Work> TorusBackend::barrier(const c10d::BarrierOptions& opts) {
  c10::Device device = opts.device ? *opts.device
                       : cpu_      ? c10::Device(c10::DeviceType::CPU)
                                   : c10::Device(c10::DeviceType::CUDA);
  // (torch passes the device type alone, and the GPUs in device_ids: the engine's barrier runs
  // on the first)
  if (!device.is_cpu() && !device.has_index() && !opts.device_ids.empty())
    device = c10::Device(device.type(), static_cast<c10::DeviceIndex>(opts.device_ids.front()));
  c10::intrusive_ptr<c10d::Work> work = delegate(
      device, "barrier", nullptr, [&](c10d::Backend& whole) { return whole.barrier(opts); });
  if (!device.is_cpu() || !work) return work;  // (on a device: after follow_torus_calls)
  // Gloo's barrier ends after every Work this rank issued before it; the torus's own run in its
  // row and column groups, which the whole group's barrier does not see (an async allreduce
  // was still summing after it). A TorusWork ends in the backend's delivery order: after them.
  auto finished = c10::make_intrusive<TorusWork>(getRank(), c10d::OpType::BARRIER,
                                                 std::vector<at::Tensor>{}, delivery_order_);
  work->getFuture()->addCallback([finished](c10::ivalue::Future& done) {
    if (done.hasError()) {
      finished->fail(done.exception_ptr());
    } else {
      finished->complete();
    }
  });
  return finished;
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
    for (auto& group :
         {engines->whole, engines->row_scatter, engines->column, engines->row_gather})
      if (group) visit(*group);
  }
}

void TorusBackend::abort() {
  for_each_group([](c10d::Backend& group) { group.abort(); });
}

void TorusBackend::shutdown() {
  std::shared_ptr<HostPipeline> host;
  std::shared_ptr<StreamPipeline> stream;
  {
    std::lock_guard<std::mutex> lock(pipelines_mutex_);
    host.swap(host_);
    stream.swap(stream_);
  }
  host.reset();  // unless a call in flight holds it: then when that call returns
  stream.reset();
  for_each_group([](c10d::Backend& group) { group.shutdown(); });
}

}  // namespace torch_bigbatch::torus
