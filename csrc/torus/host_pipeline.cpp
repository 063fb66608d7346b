#include "torus/host_pipeline.h"

#include "torus/flat_buffer.h"
#include "torus/local_reduce.h"

#include <ATen/ATen.h>
#include <c10/util/Exception.h>
#include <c10/util/StringUtil.h>

#include <atomic>
#include <cstring>
#include <functional>
#include <mutex>

namespace torch_bigbatch::torus {
namespace {

// What every exchanged region after the first phase starts with; 16 bytes keep the data
// behind it aligned for any dtype.
struct Header {
  int64_t numel;     // the sender's element count of the whole call
  int32_t kind;      // its dtype and reduce op
  int32_t mismatch;  // 1 + the first rank that saw the ranks' calls differ; 0: none seen
};
constexpr int64_t kHeaderBytes = sizeof(Header);
static_assert(kHeaderBytes == 16, "the header keeps the data 16-byte aligned");

int32_t kind_of(at::ScalarType dtype, const c10d::ReduceOp& op) {
  return static_cast<int32_t>(dtype) << 8 | static_cast<int32_t>(op.op_);
}

std::string describe_kind(int64_t numel, int32_t kind) {
  static const char* ops[] = {"SUM", "AVG", "PRODUCT", "MIN", "MAX", "BAND", "BOR", "BXOR"};
  const int op = kind & 0xff;
  return c10::str(numel, " ", static_cast<at::ScalarType>(kind >> 8), " elements with ",
                  op < 8 ? ops[op] : "another op");
}

// `total` elements cut into `parts` consecutive pieces that differ by at most one.
struct Split {
  std::vector<int64_t> sizes, offsets;
  Split() = default;
  Split(int64_t total, int64_t parts) {
    for (int64_t k = 0, offset = 0; k < parts; ++k) {
      sizes.push_back(total / parts + (k < total % parts ? 1 : 0));
      offsets.push_back(offset);
      offset += sizes.back();
    }
  }
};

// Regions [header | data of sizes[k] elements, padded to 16 bytes], back to back in bytes.
struct Regions {
  std::vector<int64_t> bytes, offsets;
  int64_t total = 0;
  Regions() = default;
  Regions(const std::vector<int64_t>& sizes, int64_t element_size) {
    for (int64_t size : sizes) {
      bytes.push_back(kHeaderBytes + (size * element_size + 15) / 16 * 16);
      offsets.push_back(total);
      total += bytes.back();
    }
  }
  at::Tensor data(const at::Tensor& buffer, size_t k, int64_t numel, at::ScalarType dtype) const {
    return buffer.narrow(0, offsets[k] + kHeaderBytes, numel * at::elementSize(dtype)).view(dtype);
  }
};

}  // namespace

struct HostPipeline::Context {
  TorusShape shape;
  Engines engines;
  int64_t segment_bytes;
  ScratchPool scratch;
  std::mutex mutex;
  std::exception_ptr failure;  // the first one: the backend is unusable after it

  std::exception_ptr first_failure() {
    std::lock_guard<std::mutex> lock(mutex);
    return failure;
  }
};

namespace {

using ContextPtr = std::shared_ptr<HostPipeline::Context>;

struct Call {
  c10::intrusive_ptr<TorusWork> work;
  FlatBuffer buffer;
  c10d::ReduceOp op;
  int64_t numel = 0;
  int32_t kind = 0;
  std::atomic<int64_t> segments_left{0};
};

struct Segment {
  std::shared_ptr<Call> call;
  int64_t index = 0, count = 0;  // for messages: segment index + 1 of count
  at::Tensor part;               // the call's elements of this segment
  Split row;                     // the segment in X parts, one per row member
  Split column;                  // this rank's row part in Y pieces, one per column member
  // The phases' buffers: the row reduce-scatter's X parts of this rank's row part (in the
  // dtype), then byte buffers of header regions.
  at::Tensor received, column_in, column_out, column_gather_in, column_gathered, row_in, row_out;
  int32_t mismatch = 0;         // as in Header
  std::string mismatch_detail;  // what this rank saw, when it saw it itself

  at::ScalarType dtype() const { return part.scalar_type(); }
  int64_t element_size() const { return part.element_size(); }
};

using SegmentPtr = std::shared_ptr<Segment>;
using Stage = void (*)(const ContextPtr&, const SegmentPtr&);

void fail(const ContextPtr& context, Call& call, const std::exception_ptr& error) {
  {
    std::lock_guard<std::mutex> lock(context->mutex);
    if (!context->failure) context->failure = error;
  }
  call.work->fail(error);
}

// Runs `next` on the thread that completes `work`. A failed phase, an earlier failure of the
// backend (the groups' sequences may differ between ranks now) or an error in `next` fails the
// call, so nothing pairs with the wrong peer.
void then(const ContextPtr& context, const SegmentPtr& segment, Phase phase,
          const c10::intrusive_ptr<c10d::Work>& work, Stage next) {
  work->getFuture()->addCallback(
      [context, segment, phase, next](c10::ivalue::Future& future) {
        try {
          if (future.hasError()) {
            TORCH_CHECK(false, describe_failure(context->shape, phase, segment->index,
                                                segment->count, future.tryRetrieveErrorMessage()));
          }
          if (auto failure = context->first_failure()) std::rethrow_exception(failure);
          next(context, segment);
        } catch (...) {
          fail(context, *segment->call, std::current_exception());
        }
      });
}

c10::intrusive_ptr<c10d::Work> exchange(c10d::Backend& group, at::Tensor& output,
                                        at::Tensor& input, std::vector<int64_t> output_splits,
                                        std::vector<int64_t> input_splits) {
  return group.alltoall_base(output, input, output_splits, input_splits);
}

// The header in front of region 0, then region 0 copied into every other region (all of one
// size): what an allgather sends each member.
void replicate_with_header(const Segment& segment, at::Tensor& buffer, const Regions& regions) {
  const Header header{segment.call->numel, segment.call->kind, segment.mismatch};
  std::memcpy(buffer.data_ptr<uint8_t>(), &header, sizeof header);
  const int64_t count = static_cast<int64_t>(regions.offsets.size()), bytes = regions.bytes[0];
  at::Tensor rows = buffer.view({count, bytes});
  rows.narrow(0, 1, count - 1).copy_(rows[0].expand({count - 1, bytes}));
}

void write_headers(const Segment& segment, at::Tensor& buffer, const Regions& regions) {
  const Header header{segment.call->numel, segment.call->kind, segment.mismatch};
  for (int64_t offset : regions.offsets)
    std::memcpy(buffer.data_ptr<uint8_t>() + offset, &header, sizeof header);
}

// Compares the headers received from `senders` with this rank's call. A difference, or a
// mismatch a sender passes on, marks the segment; the flag travels on in this rank's headers.
// Where sizes differ the regions after the first are misaligned: their headers only flag.
void check_headers(const HostPipeline::Context& context, Segment& segment,
                   const at::Tensor& buffer, const Regions& regions,
                   const std::vector<int>& senders) {
  const Call& call = *segment.call;
  for (size_t k = 0; k < regions.offsets.size(); ++k) {
    Header header;
    std::memcpy(&header, buffer.data_ptr<uint8_t>() + regions.offsets[k], sizeof header);
    if (segment.mismatch == 0) segment.mismatch = header.mismatch;
    if (header.numel == call.numel && header.kind == call.kind) continue;
    if (segment.mismatch == 0) segment.mismatch = 1 + context.shape.rank;
    if (segment.mismatch_detail.empty() && (k == 0 || header.numel == call.numel))
      segment.mismatch_detail =
          c10::str("rank ", senders[k], " passed ", describe_kind(header.numel, header.kind));
  }
}

void after_row_scatter(const ContextPtr& context, const SegmentPtr& segment);
void after_column_allreduce(const ContextPtr& context, const SegmentPtr& segment);
void after_column_scatter(const ContextPtr& context, const SegmentPtr& segment);
void after_column_gather(const ContextPtr& context, const SegmentPtr& segment);
void after_row_gather(const ContextPtr& context, const SegmentPtr& segment);
void finish(const ContextPtr& context, const SegmentPtr& segment);

// A column of two allreduces its row parts in one exchange (each member sends its part to the
// other, both sum): the bytes of a reduce-scatter plus an allgather, in one step instead of two.
bool one_shot_column(const TorusShape& shape) { return shape.rows == 2; }

void after_row_one_shot(const ContextPtr& context, const SegmentPtr& segment);
void after_column_one_shot(const ContextPtr& context, const SegmentPtr& segment);

// The sum of `rows` ([K, n]) to every column member, and every member's to this rank.
void column_one_shot(const ContextPtr& context, const SegmentPtr& segment, const at::Tensor& rows) {
  const TorusShape& shape = context->shape;
  const int64_t size = segment->part.numel();
  const Regions whole(std::vector<int64_t>(shape.rows, size), segment->element_size());
  segment->column_in = context->scratch.take(whole.total);
  at::Tensor reduced = whole.data(segment->column_in, 0, size, segment->dtype());
  reduce_rows(reduced, rows, segment->call->op);
  replicate_with_header(*segment, segment->column_in, whole);
  segment->column_out = context->scratch.take(whole.total);
  then(context, segment, Phase::ColumnAllreduce,
       exchange(*context->engines.column, segment->column_out, segment->column_in, whole.bytes,
                whole.bytes),
       after_column_one_shot);
}

// The last exchange of a small buffer done: the sum of the `count` regions in `received` is the
// result, unless the ranks' calls differed.
void finish_one_shot(const ContextPtr& context, const SegmentPtr& segment, at::Tensor& received,
                     int64_t count) {
  const Call& call = *segment->call;
  const int64_t size = segment->part.numel(), element_size = segment->element_size();
  if (segment->mismatch == 0) {
    const Regions whole(std::vector<int64_t>(count, size), element_size);
    const at::Tensor rows = received.view({count, whole.bytes[0]})
                                .narrow(1, kHeaderBytes, size * element_size)
                                .view(segment->dtype());
    reduce_rows(segment->part, rows, call.op);
    finish_average(segment->part, call.op, context->shape.columns * context->shape.rows);
  }
  context->scratch.give(std::move(received));
  finish(context, segment);
}

// Calling thread: a small buffer to every row member (or, in a row of one, to the column).
void start_one_shot(const ContextPtr& context, const SegmentPtr& segment) {
  const TorusShape& shape = context->shape;
  const int64_t size = segment->part.numel();
  if (shape.columns == 1) return column_one_shot(context, segment, segment->part.view({1, size}));
  const Regions whole(std::vector<int64_t>(shape.columns, size), segment->element_size());
  segment->row_in = context->scratch.take(whole.total);
  whole.data(segment->row_in, 0, size, segment->dtype()).copy_(segment->part);
  replicate_with_header(*segment, segment->row_in, whole);
  segment->row_out = context->scratch.take(whole.total);
  then(context, segment, Phase::RowAllreduce,
       exchange(*context->engines.row_scatter, segment->row_out, segment->row_in, whole.bytes,
                whole.bytes),
       after_row_one_shot);
}

void after_row_one_shot(const ContextPtr& context, const SegmentPtr& segment) {
  const TorusShape& shape = context->shape;
  const int64_t size = segment->part.numel(), element_size = segment->element_size();
  const Regions whole(std::vector<int64_t>(shape.columns, size), element_size);
  check_headers(*context, *segment, segment->row_out, whole, shape.row_ranks());
  context->scratch.give(std::move(segment->row_in));
  if (shape.rows == 1) return finish_one_shot(context, segment, segment->row_out, shape.columns);
  column_one_shot(context, segment,
                  segment->row_out.view({shape.columns, whole.bytes[0]})
                      .narrow(1, kHeaderBytes, size * element_size)
                      .view(segment->dtype()));
  context->scratch.give(std::move(segment->row_out));
}

void after_column_one_shot(const ContextPtr& context, const SegmentPtr& segment) {
  const TorusShape& shape = context->shape;
  const Regions whole(std::vector<int64_t>(shape.rows, segment->part.numel()),
                      segment->element_size());
  check_headers(*context, *segment, segment->column_out, whole, shape.column_ranks());
  context->scratch.give(std::move(segment->column_in));
  finish_one_shot(context, segment, segment->column_out, shape.rows);
}

// Calling thread: the row reduce-scatter (X parts of the segment to the X row members).
void start(const ContextPtr& context, const SegmentPtr& segment) {
  if (segment->count == 1 && segment->part.numel() * segment->element_size() <= kOneShotBytes)
    return start_one_shot(context, segment);
  const TorusShape& shape = context->shape;
  if (shape.columns == 1) return after_row_scatter(context, segment);
  const int64_t size = segment->row.sizes[shape.x()];
  segment->received =
      context->scratch.take(shape.columns * size * segment->element_size()).view(segment->dtype());
  then(context, segment, Phase::RowScatter,
       exchange(*context->engines.row_scatter, segment->received, segment->part,
                std::vector<int64_t>(shape.columns, size), segment->row.sizes),
       after_row_scatter);
}

// The reduced row part, in region 0 of `row_in` (header regions of one size), to every row member.
void row_allgather(const ContextPtr& context, const SegmentPtr& segment, const Regions& row_in) {
  replicate_with_header(*segment, segment->row_in, row_in);
  const Regions row_out(segment->row.sizes, segment->element_size());
  segment->row_out = context->scratch.take(row_out.total);
  then(context, segment, Phase::RowGather,
       exchange(*context->engines.row_gather, segment->row_out, segment->row_in, row_out.bytes,
                row_in.bytes),
       after_row_gather);
}

// The sum of the X parts received: cut into the Y column pieces (column reduce-scatter), or,
// in a torus of one row, the result, sent to the row.
void after_row_scatter(const ContextPtr& context, const SegmentPtr& segment) {
  const TorusShape& shape = context->shape;
  const Call& call = *segment->call;
  const int64_t size = segment->row.sizes[shape.x()], element_size = segment->element_size();
  const at::Tensor rows = shape.columns > 1 ? segment->received.view({shape.columns, size})
                                            : segment->part.view({1, size});
  if (shape.rows == 1) {
    const Regions row_in(std::vector<int64_t>(shape.columns, size), element_size);
    segment->row_in = context->scratch.take(row_in.total);
    at::Tensor reduced = row_in.data(segment->row_in, 0, size, segment->dtype());
    reduce_rows(reduced, rows, call.op);
    finish_average(reduced, call.op, shape.columns);
    context->scratch.give(std::move(segment->received));
    return row_allgather(context, segment, row_in);
  }
  if (one_shot_column(shape)) {
    const Regions whole(std::vector<int64_t>(shape.rows, size), element_size);
    segment->column_in = context->scratch.take(whole.total);
    at::Tensor reduced = whole.data(segment->column_in, 0, size, segment->dtype());
    reduce_rows(reduced, rows, call.op);
    context->scratch.give(std::move(segment->received));
    replicate_with_header(*segment, segment->column_in, whole);
    segment->column_out = context->scratch.take(whole.total);
    then(context, segment, Phase::ColumnAllreduce,
         exchange(*context->engines.column, segment->column_out, segment->column_in, whole.bytes,
                  whole.bytes),
         after_column_allreduce);
    return;
  }
  const Split& pieces = segment->column;
  const Regions column_in(pieces.sizes, element_size);
  segment->column_in = context->scratch.take(column_in.total);
  for (int64_t j = 0; j < shape.rows; ++j) {
    at::Tensor reduced = column_in.data(segment->column_in, j, pieces.sizes[j], segment->dtype());
    reduce_rows(reduced, rows.narrow(1, pieces.offsets[j], pieces.sizes[j]), call.op);
  }
  write_headers(*segment, segment->column_in, column_in);
  context->scratch.give(std::move(segment->received));
  const Regions column_out(std::vector<int64_t>(shape.rows, pieces.sizes[shape.y()]),
                           element_size);
  segment->column_out = context->scratch.take(column_out.total);
  then(context, segment, Phase::ColumnScatter,
       exchange(*context->engines.column, segment->column_out, segment->column_in,
                column_out.bytes, column_in.bytes),
       after_column_scatter);
}

// The sum of the row parts the column's members sent is this rank's row part of the result.
void after_column_allreduce(const ContextPtr& context, const SegmentPtr& segment) {
  const TorusShape& shape = context->shape;
  const Call& call = *segment->call;
  const int64_t size = segment->row.sizes[shape.x()], element_size = segment->element_size();
  const Regions whole(std::vector<int64_t>(shape.rows, size), element_size);
  check_headers(*context, *segment, segment->column_out, whole, shape.column_ranks());
  context->scratch.give(std::move(segment->column_in));
  Regions row_in;
  at::Tensor target;  // a column of one rank: the result itself, unless the ranks' calls differ
  if (shape.columns > 1) {
    row_in = Regions(std::vector<int64_t>(shape.columns, size), element_size);
    segment->row_in = context->scratch.take(row_in.total);
    target = row_in.data(segment->row_in, 0, size, segment->dtype());
  } else if (segment->mismatch == 0) {
    target = segment->part;
  }
  if (target.defined()) {
    const at::Tensor rows = segment->column_out.view({shape.rows, whole.bytes[0]})
                                .narrow(1, kHeaderBytes, size * element_size)
                                .view(segment->dtype());
    reduce_rows(target, rows, call.op);
    finish_average(target, call.op, shape.columns * shape.rows);
  }
  context->scratch.give(std::move(segment->column_out));
  if (shape.columns > 1) return row_allgather(context, segment, row_in);
  finish(context, segment);
}

// The sum of the Y pieces received is this rank's piece of the result: to every column member.
void after_column_scatter(const ContextPtr& context, const SegmentPtr& segment) {
  const TorusShape& shape = context->shape;
  const Call& call = *segment->call;
  const int64_t size = segment->column.sizes[shape.y()], element_size = segment->element_size();
  const Regions pieces(std::vector<int64_t>(shape.rows, size), element_size);
  check_headers(*context, *segment, segment->column_out, pieces, shape.column_ranks());
  context->scratch.give(std::move(segment->column_in));
  segment->column_gather_in = context->scratch.take(pieces.total);
  at::Tensor reduced = pieces.data(segment->column_gather_in, 0, size, segment->dtype());
  const at::Tensor rows = segment->column_out.view({shape.rows, pieces.bytes[0]})
                              .narrow(1, kHeaderBytes, size * element_size)
                              .view(segment->dtype());
  reduce_rows(reduced, rows, call.op);
  finish_average(reduced, call.op, shape.columns * shape.rows);
  context->scratch.give(std::move(segment->column_out));
  replicate_with_header(*segment, segment->column_gather_in, pieces);
  const Regions gathered(segment->column.sizes, element_size);
  segment->column_gathered = context->scratch.take(gathered.total);
  then(context, segment, Phase::ColumnGather,
       exchange(*context->engines.column_gather, segment->column_gathered,
                segment->column_gather_in, gathered.bytes, pieces.bytes),
       after_column_gather);
}

// The Y reduced pieces make this rank's row part of the result: to every row member.
void after_column_gather(const ContextPtr& context, const SegmentPtr& segment) {
  const TorusShape& shape = context->shape;
  const Split& pieces = segment->column;
  const int64_t size = segment->row.sizes[shape.x()], element_size = segment->element_size();
  const Regions gathered(pieces.sizes, element_size);
  check_headers(*context, *segment, segment->column_gathered, gathered, shape.column_ranks());
  context->scratch.give(std::move(segment->column_gather_in));
  at::Tensor target = segment->part;  // a column of one rank: the result itself
  Regions row_in;
  if (shape.columns > 1) {
    row_in = Regions(std::vector<int64_t>(shape.columns, size), element_size);
    segment->row_in = context->scratch.take(row_in.total);
    target = row_in.data(segment->row_in, 0, size, segment->dtype());
  }
  if (segment->mismatch == 0 || shape.columns > 1) {
    for (int64_t j = 0; j < shape.rows; ++j)
      target.narrow(0, pieces.offsets[j], pieces.sizes[j])
          .copy_(gathered.data(segment->column_gathered, j, pieces.sizes[j], segment->dtype()));
  }
  context->scratch.give(std::move(segment->column_gathered));
  if (shape.columns > 1) return row_allgather(context, segment, row_in);
  finish(context, segment);
}

// The X reduced row parts are the segment's result.
void after_row_gather(const ContextPtr& context, const SegmentPtr& segment) {
  const TorusShape& shape = context->shape;
  const Split& parts = segment->row;
  const Regions gathered(parts.sizes, segment->element_size());
  check_headers(*context, *segment, segment->row_out, gathered, shape.row_ranks());
  context->scratch.give(std::move(segment->row_in));
  if (segment->mismatch == 0) {
    for (int64_t k = 0; k < shape.columns; ++k)
      segment->part.narrow(0, parts.offsets[k], parts.sizes[k])
          .copy_(gathered.data(segment->row_out, k, parts.sizes[k], segment->dtype()));
  }
  context->scratch.give(std::move(segment->row_out));
  finish(context, segment);
}

// Every rank ends each segment knowing whether any two ranks' calls differed (the last phase's
// headers carry what the earlier ones saw): all fail together, or the segment is done.
void finish(const ContextPtr& context, const SegmentPtr& segment) {
  Call& call = *segment->call;
  TORCH_CHECK(segment->mismatch == 0, "torus allreduce: the ranks passed different buffers (",
              segment->mismatch_detail.empty()
                  ? c10::str("rank ", segment->mismatch - 1, " saw it first")
                  : segment->mismatch_detail,
              "; this rank, ", context->shape.describe(), ", passed ",
              describe_kind(call.numel, call.kind),
              "): every rank must pass the same number of elements, dtype and op");
  if (--call.segments_left == 0) {
    call.buffer.copy_out();
    call.work->complete();
  }
}

}  // namespace

HostPipeline::HostPipeline(TorusShape shape, Engines engines, int64_t segment_bytes)
    : context_(std::make_shared<Context>()) {
  TORCH_CHECK(segment_bytes > 0, "torus: segment_bytes must be positive, got ", segment_bytes);
  context_->shape = shape;
  context_->engines = std::move(engines);
  context_->segment_bytes = segment_bytes;
}

c10::intrusive_ptr<c10d::Work> HostPipeline::allreduce(std::vector<at::Tensor> inputs,
                                                       c10d::ReduceOp op,
                                                       c10d::OpType op_type) {
  if (const std::exception_ptr failure = context_->first_failure()) {
    try {
      std::rethrow_exception(failure);
    } catch (const std::exception& e) {
      TORCH_CHECK(false, "torus backend is unusable after an earlier failure: ", e.what());
    }
  }
  const TorusShape& shape = context_->shape;
  auto call = std::make_shared<Call>();
  call->work = c10::make_intrusive<TorusWork>(shape.rank, op_type, inputs);
  call->buffer = FlatBuffer(std::move(inputs), 1);
  call->op = op;
  call->numel = call->buffer.flat.numel();
  call->kind = kind_of(call->buffer.flat.scalar_type(), op);
  if (call->numel == 0) {  // nothing to exchange
    call->work->complete();
    return call->work;
  }
  const auto spans = call->buffer.segments(context_->segment_bytes);
  call->segments_left = static_cast<int64_t>(spans.size());
  for (size_t i = 0; i < spans.size(); ++i) {
    auto segment = std::make_shared<Segment>();
    segment->call = call;
    segment->index = static_cast<int64_t>(i);
    segment->count = static_cast<int64_t>(spans.size());
    segment->part = call->buffer.flat.narrow(0, spans[i].first, spans[i].second);
    segment->row = Split(spans[i].second, shape.columns);
    segment->column = Split(segment->row.sizes[shape.x()], shape.rows);
    try {
      start(context_, segment);
    } catch (...) {
      fail(context_, *call, std::current_exception());
      break;
    }
  }
  return call->work;
}

}  // namespace torch_bigbatch::torus
