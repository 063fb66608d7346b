#include "torus/stream_pipeline.h"

#include "torus/flat_buffer.h"

#include <ATen/core/ivalue.h>
#include <c10/core/Event.h>
#include <c10/core/StreamGuard.h>
#include <c10/core/impl/VirtualGuardImpl.h>

namespace torch_bigbatch::torus {
namespace {

class StreamWork : public c10d::Work {
 public:
  StreamWork(int rank, c10d::OpType op_type, std::vector<at::Tensor> outputs, c10::Event done,
             c10::intrusive_ptr<c10::ivalue::Future> future,
             std::vector<c10::intrusive_ptr<c10d::Work>> phases)
      : c10d::Work(rank, op_type, "torus", outputs),
        outputs_(std::move(outputs)),
        done_(std::move(done)),
        future_(std::move(future)),
        phases_(std::move(phases)) {}

  bool isCompleted() override { return done_.query(); }
  bool isSuccess() const override { return true; }
  void synchronize() override {
    c10::Device device = outputs_.front().device();
    done_.block(c10::impl::VirtualGuardImpl(device.type()).getStream(device));
  }
  bool wait(std::chrono::milliseconds /*timeout: the engines' own watchdogs apply*/) override {
    synchronize();
    return true;
  }
  std::vector<at::Tensor> result() override { return outputs_; }
  c10::intrusive_ptr<c10::ivalue::Future> getFuture() override { return future_; }

 private:
  std::vector<at::Tensor> outputs_;
  c10::Event done_;
  c10::intrusive_ptr<c10::ivalue::Future> future_;
  std::vector<c10::intrusive_ptr<c10d::Work>> phases_;  // kept alive with their buffers
};

}  // namespace

c10::intrusive_ptr<c10d::Work> stream_allreduce(const TorusShape& shape, const Engines& engines,
                                                std::vector<at::Tensor> inputs,
                                                const c10d::ReduceOp& op, c10d::OpType op_type,
                                                int64_t segment_bytes, c10::Stream side) {
  c10::Device device = inputs.front().device();
  c10::impl::VirtualGuardImpl guard_impl(device.type());
  c10::Event inputs_ready(device.type());
  inputs_ready.record(guard_impl.getStream(device));
  inputs_ready.block(side);
  c10::StreamGuard on_side(side);
  for (auto& input : inputs) input.record_stream(side);  // the allocator must not reuse it early

  const int64_t columns = shape.columns;
  FlatBuffer buffer(inputs, columns);
  at::Tensor chunk = columns > 1 ? at::empty({buffer.flat.numel() / columns}, buffer.flat.options())
                                 : buffer.flat;
  struct Segment {
    at::Tensor part, chunk;
    c10::intrusive_ptr<c10d::Work> scatter, column;
  };
  std::vector<Segment> segments;
  for (auto [begin, length] : buffer.segments(segment_bytes)) {
    segments.push_back({buffer.flat.narrow(0, begin, length),
                        chunk.narrow(0, begin / columns, length / columns), {}, {}});
  }

  // NCCL has AVG: over X in the row and over Y in the column it averages over X*Y.
  std::vector<c10::intrusive_ptr<c10d::Work>> phases;
  if (engines.row_scatter) {
    c10d::ReduceScatterOptions options;
    options.reduceOp = op;
    for (auto& s : segments) {
      s.scatter = engines.row_scatter->_reduce_scatter_base(s.chunk, s.part, options);
      phases.push_back(s.scatter);
    }
  }
  if (engines.column) {
    c10d::AllreduceOptions options;
    options.reduceOp = op;
    for (auto& s : segments) {
      if (s.scatter) s.scatter->synchronize();
      std::vector<at::Tensor> tensors{s.chunk};
      s.column = engines.column->allreduce(tensors, options);
      phases.push_back(s.column);
    }
  }
  if (engines.row_gather) {
    for (auto& s : segments) {
      (s.column ? s.column : s.scatter)->synchronize();
      phases.push_back(engines.row_gather->_allgather_base(s.part, s.chunk));
    }
  }
  phases.back()->synchronize();
  buffer.copy_out();

  auto future = c10::make_intrusive<c10::ivalue::Future>(
      c10::ListType::create(c10::TensorType::get()), std::vector<c10::Device>{device});
  future->markCompleted(c10::IValue(inputs));  // records an event on the side stream
  c10::Event done(device.type());
  done.record(side);
  return c10::make_intrusive<StreamWork>(shape.rank, op_type, std::move(inputs), std::move(done),
                                         std::move(future), std::move(phases));
}

}  // namespace torch_bigbatch::torus
