#include "torus/host_pipeline.h"

#include "torus/flat_buffer.h"
#include "torus/local_reduce.h"
#include "torus/work_waiter.h"

#include <ATen/ATen.h>
#include <c10/core/InferenceMode.h>
#include <c10/util/Exception.h>
#include <c10/util/StringUtil.h>

#include <atomic>
#include <chrono>
#include <condition_variable>
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

// What one member of a group sends to, or receives from, every other member in an exchange:
// one region [header | data, padded to 16 bytes] per other member, back to back, and none for
// itself (its own part never leaves it, and Gloo copies nothing for it). `sizes[j]` is the
// element count of member j's region; `splits` are alltoall_base's, in bytes, 0 for `me`.
struct Exchange {
  std::vector<int> members;                // whose region each is
  std::vector<int64_t> sizes, offsets;     // per region: elements, byte offset
  std::vector<int64_t> splits;             // per member: bytes
  int64_t total = 0, element_size = 0;
  at::ScalarType dtype = at::kFloat;

  Exchange() = default;
  Exchange(const std::vector<int64_t>& member_sizes, int me, const at::Tensor& like)
      : element_size(like.element_size()), dtype(like.scalar_type()) {
    for (int j = 0; j < static_cast<int>(member_sizes.size()); ++j) {
      const int64_t bytes =
          j == me ? 0 : kHeaderBytes + (member_sizes[j] * element_size + 15) / 16 * 16;
      splits.push_back(bytes);
      if (j == me) continue;
      members.push_back(j);
      sizes.push_back(member_sizes[j]);
      offsets.push_back(total);
      total += bytes;
    }
  }
  // Region k's data.
  at::Tensor data(const at::Tensor& buffer, size_t k) const {
    return buffer.narrow(0, offsets[k] + kHeaderBytes, sizes[k] * element_size).view(dtype);
  }
  // Every region's data as rows [regions, n], when the regions are of one size.
  at::Tensor rows(const at::Tensor& buffer) const {
    const int64_t count = static_cast<int64_t>(sizes.size());
    return buffer.view({count, total / count})
        .narrow(1, kHeaderBytes, sizes[0] * element_size)
        .view(dtype);
  }
};

}  // namespace

struct HostPipeline::Context {
  TorusShape shape;
  Engines engines;
  ScratchPool scratch;
  // The direct exchanges' Works, in issue order, one thread per phase (see exchange_directly).
  WorkWaiter row_scatter_waiter, column_waiter, column_gather_waiter, row_gather_waiter;
  // Held while posting to an engine: the calling thread and the phase threads post to the same
  // process groups, and ProcessGroupGloo counts its calls in a plain integer (seq_).
  mutable std::mutex posting;
  // Held while a call posts its segments: calls from several threads (a DDP hook's callbacks
  // issue some) then post one after another. Gloo pairs the messages of a peer and tag in
  // the order they were posted, so interleaved calls would pair one call's part with another's.
  std::mutex issuing;
  std::shared_ptr<BackendFailure> failure;  // the backend's: unusable after the first
  std::shared_ptr<DeliveryOrder> order;     // the backend's: in which its Works end
};

namespace {

using ContextPtr = std::shared_ptr<HostPipeline::Context>;

struct Call {
  c10::intrusive_ptr<TorusWork> work;
  FlatBuffer buffer;
  c10d::ReduceOp op;
  int64_t numel = 0;
  int32_t kind = 0;
  bool one_shot = false;  // one segment, in the one-shot form
  std::atomic<int64_t> segments_left{0};
  std::vector<char> finished_segments;       // per segment, under `mutex` (wait_for_column_turn)
  std::condition_variable segment_finished;  // notified when one is
  // What the headers told so far, over all segments: the phases of different segments check
  // them on different threads.
  std::mutex mutex;
  int32_t mismatch = 0;         // as in Header
  std::string mismatch_detail;  // what this rank saw, when it saw it itself

  Header header() {
    std::lock_guard<std::mutex> lock(mutex);
    return Header{numel, kind, mismatch};
  }
  bool mismatched() {
    std::lock_guard<std::mutex> lock(mutex);
    return mismatch != 0;
  }
};

// A phase's receives, posted when its segment starts (see post_receives), and the members whose
// headers they include.
struct Posted {
  std::vector<c10::intrusive_ptr<c10d::Work>> works;
  at::Tensor headers;        // [members, kHeaderBytes]: with the call's last segment
  std::vector<int> members;  // whole-group ranks of the phase's group
  int me = 0;
};

struct Segment {
  std::shared_ptr<Call> call;
  int64_t index = 0, count = 0;  // for messages: segment index + 1 of count
  at::Tensor part;               // the call's elements of this segment
  Split row;                     // the segment in X parts, one per row member
  Split column;                  // this rank's row part in Y pieces, one per column member
  // The phases' buffers: the other row members' parts of this rank's row part and the column
  // members' of its piece (in the dtype); the one-shot exchanges' byte buffers of header
  // regions.
  at::Tensor row_received, column_received, column_out, column_in, row_in, row_out;
  at::Tensor row_sum;  // this rank's row part, in place: its sum along the row, then the result
  Posted column_posted, column_gather_posted, row_gather_posted;  // until their phases

  at::ScalarType dtype() const { return part.scalar_type(); }
  int64_t element_size() const { return part.element_size(); }
};

using SegmentPtr = std::shared_ptr<Segment>;
using Stage = void (*)(const ContextPtr&, const SegmentPtr&);

void fail(const ContextPtr& context, Call& call, const std::exception_ptr& error) {
  context->failure->record(error);
  call.work->fail(error);
}

// A failed segment's receives that no phase will wait for: aborted, so none of them waits on.
void abandon_receives(Segment& segment) {
  for (Posted* posted :
       {&segment.column_posted, &segment.column_gather_posted, &segment.row_gather_posted}) {
    for (const auto& work : posted->works) abort_quietly(work);
    posted->works.clear();
  }
}

// After `phase` ended (`error`: its first failure, null when it ended well): runs `next`. A
// failed phase, an earlier failure of the backend (the groups' sequences may differ between
// ranks now) or an error in `next` fails the call, so nothing pairs with the wrong peer.
void advance(const ContextPtr& context, const SegmentPtr& segment, Phase phase,
             const std::exception_ptr& error, Stage next) {
  try {
    if (error) {
      TORCH_CHECK_WITH(DistBackendError, false,
                       describe_failure(context->shape, phase, segment->index, segment->count,
                                        message_of(error)));
    }
    if (auto failure = context->failure->first()) std::rethrow_exception(failure);
    const c10::InferenceMode writes_anything;  // (see TorusBackend::torus_allreduce)
    next(context, segment);
  } catch (...) {
    abandon_receives(*segment);
    fail(context, *segment->call, std::current_exception());
  }
}

// Runs `next` once `work` ended, on `waiter`'s thread (see advance). Not in a callback of the
// Work's future: that runs on the engine's worker thread, and the continuation can drop the last
// reference to this pipeline, whose engines' destructors join their worker threads: a Gloo
// worker joining itself aborts the process ("Resource deadlock avoided", seen in CI at a job's
// end). A WorkWaiter that ends up destroying itself detaches its thread instead.
void then(const ContextPtr& context, const SegmentPtr& segment, Phase phase,
          c10::intrusive_ptr<c10d::Work> work, WorkWaiter& waiter, Stage next) {
  waiter.wait_then({std::move(work)}, [context, segment, phase,
                                       next](const std::exception_ptr& error) {
    advance(context, segment, phase, error, next);
  });
}

void write_headers(const Segment& segment, at::Tensor& buffer, const Exchange& exchange) {
  const Header header = segment.call->header();
  for (int64_t offset : exchange.offsets)
    std::memcpy(buffer.data_ptr<uint8_t>() + offset, &header, sizeof header);
}

// What an allgather sends: this member's part, which the caller has put in region 0, with the
// header, in every region (all of one size).
void replicate(const Segment& segment, at::Tensor& buffer, const Exchange& exchange) {
  write_headers(segment, buffer, exchange);
  const int64_t count = static_cast<int64_t>(exchange.sizes.size());
  at::Tensor rows = buffer.view({count, exchange.total / count});
  rows.narrow(0, 1, count - 1).copy_(rows[0].expand({count - 1, rows.size(1)}));
}

// Compares a header that `sender` (a rank of the whole group) sent with this rank's call. A
// difference, or a mismatch the sender passes on, marks the call; the flag travels on in this
// rank's headers. `aligned`: the header is where the sender wrote it (where sizes differ, the
// regions after the first are misaligned: their headers only flag).
void check_header(const HostPipeline::Context& context, Call& call, const Header& header,
                  int sender, bool aligned) {
  std::lock_guard<std::mutex> lock(call.mutex);
  if (call.mismatch == 0) call.mismatch = header.mismatch;
  if (header.numel == call.numel && header.kind == call.kind) return;
  if (call.mismatch == 0) call.mismatch = 1 + context.shape.rank;
  if (call.mismatch_detail.empty() && (aligned || header.numel == call.numel))
    call.mismatch_detail =
        c10::str("rank ", sender, " passed ", describe_call(header.numel, header.kind));
}

// The headers of an exchange's regions, received from the members of `group`.
void check_headers(const HostPipeline::Context& context, Segment& segment,
                   const at::Tensor& buffer, const Exchange& exchange,
                   const std::vector<int>& group) {
  for (size_t k = 0; k < exchange.offsets.size(); ++k) {
    Header header;
    std::memcpy(&header, buffer.data_ptr<uint8_t>() + exchange.offsets[k], sizeof header);
    check_header(context, *segment.call, header, group[exchange.members[k]], k == 0);
  }
}

// The allgather of a group: `in` holds this member's part in region 0; every member's region
// arrives in `out` (the regions of `received`); `waiter` runs `next` once it ended.
void allgather(const ContextPtr& context, const SegmentPtr& segment, c10d::Backend& group,
               WorkWaiter& waiter, at::Tensor& in, const Exchange& sent, at::Tensor& out,
               const Exchange& received, Phase phase, Stage next) {
  replicate(*segment, in, sent);
  out = context->scratch.take(received.total);
  std::vector<int64_t> output_splits = received.splits, input_splits = sent.splits;
  c10::intrusive_ptr<c10d::Work> work;
  {
    std::lock_guard<std::mutex> lock(context->posting);
    work = group.alltoall_base(out, in, output_splits, input_splits);
  }
  then(context, segment, phase, std::move(work), waiter, next);
}

void after_row_scatter(const ContextPtr& context, const SegmentPtr& segment);
void after_column_scatter(const ContextPtr& context, const SegmentPtr& segment);
void column_done(const ContextPtr& context, const SegmentPtr& segment);
void after_row_one_shot(const ContextPtr& context, const SegmentPtr& segment);
void after_column_one_shot(const ContextPtr& context, const SegmentPtr& segment);
void finish(const ContextPtr& context, const SegmentPtr& segment);

int64_t row_size(const TorusShape& shape, const Segment& segment) {
  return segment.row.sizes[shape.x()];
}
Exchange column_one_shot_in(const TorusShape& shape, const Segment& segment, int64_t size) {
  return Exchange(std::vector<int64_t>(shape.rows, size), shape.y(), segment.part);
}

// Direct exchanges (Gloo's send and recv) move each part from its place and into its place:
// an alltoall needs one contiguous input and output, so it stages a copy of what a member sends
// and of what it receives. The headers that an alltoall's regions carry are exchanged once per
// call instead, with its last segment; ranks whose calls differ have written the caller's
// buffer by then, as a plain Gloo allreduce does, and all of them fail at the call's end.
//
// Every message is tagged with its phase (and whether it is a header), so phases may share a
// group: the column's reduce-scatter and allgather share one, one TCP connection per peer, each
// phase still waiting on a thread of its own. With a group for each, the allgather's flow
// started cold on the node's link after the reduce-scatter's: 2 nodes x 2 at 1 Gbit/s ran
// 1.25-1.40x Gloo at 4-64 MiB against 1.34-1.47x shared (four runs taking turns;
// docs/results.md, section 3).
int data_tag(Phase phase) { return 2 * static_cast<int>(phase); }
int header_tag(Phase phase) { return 2 * static_cast<int>(phase) + 1; }

struct Transfer {
  int peer;  // its rank in the phase's group
  at::Tensor data;
};

// Posts `tensor` to or from `peer` of `group`; a failure names the phase.
c10::intrusive_ptr<c10d::Work> post(const HostPipeline::Context& context, const Segment& segment,
                                    c10d::Backend& group, Phase phase, bool send,
                                    at::Tensor tensor, int peer, int tag) {
  std::vector<at::Tensor> tensors{std::move(tensor)};
  try {  // Gloo posts at once: a peer known to be gone fails here
    std::lock_guard<std::mutex> lock(context.posting);
    return send ? group.send(tensors, peer, tag) : group.recv(tensors, peer, tag);
  } catch (...) {
    TORCH_CHECK_WITH(DistBackendError, false,
                     describe_failure(context.shape, phase, segment.index, segment.count,
                                      message_of(std::current_exception())));
  }
}

// Posts a phase's receives (and, with the call's last segment, those of the headers of the
// other `members`, whole-group ranks, when there are any; this rank is `me`). A Gloo send
// waits until its receive is posted (Gloo's rendezvous: the receiver announces it, then the
// data flows), so each phase posts its receives when the segment starts: a peer's part then
// leaves as soon as the peer has it, instead of waiting a round trip that, on a rate-limited
// link, queues behind the data already in flight.
Posted post_receives(const ContextPtr& context, const SegmentPtr& segment, c10d::Backend& group,
                     std::vector<int> members, int me, const std::vector<Transfer>& receives,
                     Phase phase) {
  Posted posted;
  posted.members = std::move(members);
  posted.me = me;
  const int64_t count = static_cast<int64_t>(posted.members.size());
  if (segment->index + 1 == segment->count && count > 0) {
    posted.headers = at::empty({count, kHeaderBytes}, at::TensorOptions().dtype(at::kByte));
    for (int j = 0; j < count; ++j)
      if (j != me)
        posted.works.push_back(post(*context, *segment, group, phase, false, posted.headers[j], j,
                                    header_tag(phase)));
  }
  for (const Transfer& transfer : receives)
    if (transfer.data.numel() > 0)
      posted.works.push_back(post(*context, *segment, group, phase, false, transfer.data,
                                  transfer.peer, data_tag(phase)));
  return posted;
}

// Posts `sends` on `group`, with the call's last segment this rank's header to every member the
// receives expect one from; `waiter` runs `next` once the sends and the receives ended (see
// advance).
void exchange_directly(const ContextPtr& context, const SegmentPtr& segment, c10d::Backend& group,
                       Posted posted, const std::vector<Transfer>& sends, WorkWaiter& waiter,
                       Phase phase, Stage next) {
  std::vector<c10::intrusive_ptr<c10d::Work>> works;
  if (posted.headers.defined()) {
    const Header header = segment->call->header();
    at::Tensor sent = at::empty({kHeaderBytes}, at::TensorOptions().dtype(at::kByte));
    std::memcpy(sent.data_ptr<uint8_t>(), &header, sizeof header);
    for (int j = 0; j < static_cast<int>(posted.members.size()); ++j)
      if (j != posted.me)
        works.push_back(post(*context, *segment, group, phase, true, sent, j, header_tag(phase)));
  }
  for (const Transfer& transfer : sends)
    if (transfer.data.numel() > 0)
      works.push_back(post(*context, *segment, group, phase, true, transfer.data, transfer.peer,
                           data_tag(phase)));
  works.insert(works.end(), posted.works.begin(), posted.works.end());
  posted.works.clear();
  waiter.wait_then(std::move(works), [context, segment, posted = std::move(posted), phase,
                                      next](const std::exception_ptr& error) {
    if (!error && posted.headers.defined()) {
      for (int j = 0; j < static_cast<int>(posted.members.size()); ++j) {
        if (j == posted.me) continue;
        Header header;
        std::memcpy(&header, posted.headers[j].data_ptr<uint8_t>(), sizeof header);
        check_header(*context, *segment->call, header, posted.members[j], true);
      }
    }
    advance(context, segment, phase, error, next);
  });
}

// This rank's row part of the result, in its place, to every row member; theirs arrive in theirs
// (posted when the segment started).
void row_allgather(const ContextPtr& context, const SegmentPtr& segment) {
  const TorusShape& shape = context->shape;
  const int x = shape.x();
  const at::Tensor mine = segment->part.narrow(0, segment->row.offsets[x], segment->row.sizes[x]);
  std::vector<Transfer> sends;
  for (int j = 0; j < shape.columns; ++j)
    if (j != x) sends.push_back({j, mine});
  exchange_directly(context, segment, *context->engines.row_gather,
                    std::move(segment->row_gather_posted), sends, context->row_gather_waiter,
                    Phase::RowGather, finish);
}

// Calling thread. The one-shot form: every row member's whole buffer to every other (or, in a
// row of one, straight to the column).
void start_one_shot(const ContextPtr& context, const SegmentPtr& segment) {
  const TorusShape& shape = context->shape;
  const int64_t size = segment->part.numel();
  if (shape.columns == 1) {
    const Exchange sent = column_one_shot_in(shape, *segment, size);
    segment->column_in = context->scratch.take(sent.total);
    sent.data(segment->column_in, 0).copy_(segment->part);
    return allgather(context, segment, *context->engines.column, context->column_waiter,
                     segment->column_in, sent, segment->column_out, sent, Phase::ColumnAllreduce,
                     after_column_one_shot);
  }
  const Exchange sent(std::vector<int64_t>(shape.columns, size), shape.x(), segment->part);
  segment->row_in = context->scratch.take(sent.total);
  sent.data(segment->row_in, 0).copy_(segment->part);
  allgather(context, segment, *context->engines.row_scatter, context->row_scatter_waiter,
            segment->row_in, sent, segment->row_out, sent, Phase::RowAllreduce,
            after_row_one_shot);
}

// This member's buffer plus the row's: the result (one row), or what goes to the column.
void after_row_one_shot(const ContextPtr& context, const SegmentPtr& segment) {
  const TorusShape& shape = context->shape;
  Call& call = *segment->call;
  const int64_t size = segment->part.numel();
  const Exchange peers(std::vector<int64_t>(shape.columns, size), shape.x(), segment->part);
  check_headers(*context, *segment, segment->row_out, peers, shape.row_ranks());
  at::Tensor sum = segment->part;  // in place: this member's buffer
  if (shape.rows > 1) {
    const Exchange sent = column_one_shot_in(shape, *segment, size);
    segment->column_in = context->scratch.take(sent.total);
    sum = sent.data(segment->column_in, 0);
  } else if (call.mismatched()) {
    sum = at::empty_like(segment->part);
  }
  reduce_in_member_order(sum, segment->part, shape.x(), peers.rows(segment->row_out), call.op);
  context->scratch.give(std::move(segment->row_in));
  context->scratch.give(std::move(segment->row_out));
  if (shape.rows == 1) {
    finish_average(sum, call.op, shape.columns);
    return finish(context, segment);
  }
  const Exchange sent = column_one_shot_in(shape, *segment, size);
  allgather(context, segment, *context->engines.column, context->column_waiter,
            segment->column_in, sent, segment->column_out, sent, Phase::ColumnAllreduce,
            after_column_one_shot);
}

// The row's sum plus the column's: the result.
void after_column_one_shot(const ContextPtr& context, const SegmentPtr& segment) {
  const TorusShape& shape = context->shape;
  Call& call = *segment->call;
  const Exchange peers = column_one_shot_in(shape, *segment, segment->part.numel());
  check_headers(*context, *segment, segment->column_out, peers, shape.column_ranks());
  at::Tensor result = call.mismatched() ? at::empty_like(segment->part) : segment->part;
  reduce_in_member_order(result, peers.data(segment->column_in, 0), shape.y(),
                         peers.rows(segment->column_out), call.op);
  finish_average(result, call.op, shape.columns * shape.rows);
  context->scratch.give(std::move(segment->column_in));
  context->scratch.give(std::move(segment->column_out));
  finish(context, segment);
}

// Calling thread: the receives of the phases after the row reduce-scatter (see post_receives):
// the column's contributions to this rank's piece into scratch, the column's pieces of the
// result and the row's parts of it into their places.
// Each arrives only after this rank sent what was in that place: a peer sends its reduced
// part after it received this rank's contribution to it.
void post_later_receives(const ContextPtr& context, const SegmentPtr& segment) {
  const TorusShape& shape = context->shape;
  const Engines& engines = context->engines;
  const int x = shape.x(), y = shape.y();
  const int64_t size = row_size(shape, *segment);
  const at::Tensor row_part = segment->part.narrow(0, segment->row.offsets[x], size);
  if (shape.rows > 1) {
    const Split& pieces = segment->column;
    segment->column_received =
        context->scratch.take((shape.rows - 1) * pieces.sizes[y] * segment->element_size())
            .view(segment->dtype())
            .view({shape.rows - 1, pieces.sizes[y]});
    std::vector<Transfer> contributions, results;
    for (int j = 0, k = 0; j < shape.rows; ++j) {
      if (j == y) continue;
      contributions.push_back({j, segment->column_received[k++]});
      results.push_back({j, row_part.narrow(0, pieces.offsets[j], pieces.sizes[j])});
    }
    segment->column_posted = post_receives(context, segment, *engines.column, shape.column_ranks(),
                                           y, contributions, Phase::ColumnScatter);
    // No headers in the column allgather: the column reduce-scatter compared the column's calls.
    segment->column_gather_posted = post_receives(context, segment, *engines.column, {}, y,
                                                  results, Phase::ColumnGather);
  }
  if (shape.columns > 1) {
    const Split& parts = segment->row;
    std::vector<Transfer> results;
    for (int j = 0; j < shape.columns; ++j)
      if (j != x) results.push_back({j, segment->part.narrow(0, parts.offsets[j], parts.sizes[j])});
    segment->row_gather_posted = post_receives(context, segment, *engines.row_gather,
                                               shape.row_ranks(), x, results, Phase::RowGather);
  }
}

// Calling thread: the row reduce-scatter, direct: the other row members' parts of the segment
// go to them from their places, and their contributions to this rank's part arrive in
// `row_received`.
void start(const ContextPtr& context, const SegmentPtr& segment) {
  if (segment->call->one_shot) return start_one_shot(context, segment);
  post_later_receives(context, segment);
  const TorusShape& shape = context->shape;
  if (shape.columns == 1) return after_row_scatter(context, segment);
  const Split& parts = segment->row;
  const int x = shape.x();
  const int64_t size = row_size(shape, *segment);
  segment->row_received =
      context->scratch.take((shape.columns - 1) * size * segment->element_size())
          .view(segment->dtype())
          .view({shape.columns - 1, size});
  std::vector<Transfer> sends, receives;
  for (int j = 0, k = 0; j < shape.columns; ++j) {
    if (j == x) continue;
    sends.push_back({j, segment->part.narrow(0, parts.offsets[j], parts.sizes[j])});
    receives.push_back({j, segment->row_received[k++]});
  }
  // No headers here: the row allgather exchanges them (the caller's buffer must not change
  // before this phase's sends ended, and a header exchange adds a step to every call).
  c10d::Backend& row = *context->engines.row_scatter;
  exchange_directly(context, segment, row,
                    post_receives(context, segment, row, {}, x, receives, Phase::RowScatter),
                    sends, context->row_scatter_waiter, Phase::RowScatter, after_row_scatter);
}

// A column of two across nodes: the row members' column exchanges share their node's link,
// one TCP flow each, and those flows share it unevenly: one member's column ended while the
// other's still had a third of its bytes to send alone, at a lower rate (2 nodes x 2 at
// 1 Gbit/s, 16 MiB: 150 ms against the 141 ms of one flow). So a segment's column waits until
// the segment kColumnWindow before it has finished on this rank: its row allgather needs every
// row member's column of it, so the members' flows stay within that many segments of each
// other and end together (docs/results.md, section 3: 145 ms in 2 MiB segments). Every wait
// is for an earlier segment, whose phases wait for none later: no cycle, on any rank. Longer
// columns go without: a column of four ran slower with it (4 nodes x 2 at 1 Gbit/s).
constexpr int64_t kColumnWindow = 2;

void wait_for_column_turn(const ContextPtr& context, Segment& segment) {
  // A row of one has no flows to even out, and there this runs on the calling thread (start()),
  // which must not wait: an async allreduce would block its caller, and two groups' calls
  // issued in opposite orders on two ranks waited for each other until the timeout.
  if (context->shape.columns == 1 || context->shape.rows != 2 || segment.index < kColumnWindow)
    return;
  Call& call = *segment.call;
  std::unique_lock<std::mutex> lock(call.mutex);
  while (!call.finished_segments[segment.index - kColumnWindow]) {
    // A failed call's segments never finish: the failure is the backend's, seen here.
    if (auto failure = context->failure->first()) std::rethrow_exception(failure);
    call.segment_finished.wait_for(lock, std::chrono::milliseconds(50));
  }
}

// This rank's row part plus what the row members sent is the part reduced along the row, in
// place: the result (one row), or what the column reduce-scatters.
void after_row_scatter(const ContextPtr& context, const SegmentPtr& segment) {
  const TorusShape& shape = context->shape;
  const Call& call = *segment->call;
  const int64_t size = row_size(shape, *segment);
  // This rank's place in the segment (all of it with one column), from where the row allgather
  // sends it; with several columns the row members' contributions are added to it here.
  segment->row_sum = shape.columns > 1
                         ? segment->part.narrow(0, segment->row.offsets[shape.x()], size)
                         : segment->part;
  at::Tensor& sum = segment->row_sum;
  if (shape.columns > 1) reduce_into(sum, sum, segment->row_received, call.op);
  context->scratch.give(std::move(segment->row_received));
  if (shape.rows == 1) {
    finish_average(sum, call.op, shape.columns);
    return row_allgather(context, segment);
  }
  wait_for_column_turn(context, *segment);
  // The column reduce-scatter, direct: the row sum's Y pieces go to the column members that
  // reduce them, from their places.
  const int y = shape.y();
  const Split& pieces = segment->column;
  std::vector<Transfer> sends;
  for (int j = 0; j < shape.rows; ++j)
    if (j != y) sends.push_back({j, sum.narrow(0, pieces.offsets[j], pieces.sizes[j])});
  exchange_directly(context, segment, *context->engines.column, std::move(segment->column_posted),
                    sends, context->column_waiter, Phase::ColumnScatter, after_column_scatter);
}

// This rank's piece plus the column members' contributions, in place, is its piece of the
// result: to every column member (theirs arrive in their places).
void after_column_scatter(const ContextPtr& context, const SegmentPtr& segment) {
  const TorusShape& shape = context->shape;
  const Call& call = *segment->call;
  const Split& pieces = segment->column;
  const int y = shape.y();
  at::Tensor piece = segment->row_sum.narrow(0, pieces.offsets[y], pieces.sizes[y]);
  reduce_into(piece, piece, segment->column_received, call.op);
  finish_average(piece, call.op, shape.columns * shape.rows);
  context->scratch.give(std::move(segment->column_received));
  std::vector<Transfer> sends;
  for (int j = 0; j < shape.rows; ++j)
    if (j != y) sends.push_back({j, piece});
  exchange_directly(context, segment, *context->engines.column,
                    std::move(segment->column_gather_posted), sends,
                    context->column_gather_waiter, Phase::ColumnGather, column_done);
}

// The column's result is in place: the row's allgather follows (in a torus of one column, the
// end).
void column_done(const ContextPtr& context, const SegmentPtr& segment) {
  if (context->shape.columns > 1) return row_allgather(context, segment);
  finish(context, segment);
}

// Every rank ends a call's last segment knowing whether any two ranks' calls differed (the
// last phase's headers carry what the earlier ones saw): all fail together, or the call is done.
void finish(const ContextPtr& context, const SegmentPtr& segment) {
  Call& call = *segment->call;
  {
    std::lock_guard<std::mutex> lock(call.mutex);
    call.finished_segments[segment->index] = 1;
  }
  call.segment_finished.notify_all();
  if (--call.segments_left > 0) return;
  {
    std::lock_guard<std::mutex> lock(call.mutex);
    TORCH_CHECK_WITH(DistBackendError, call.mismatch == 0,
                     describe_mismatch(context->shape,
                                       call.mismatch_detail.empty()
                                           ? c10::str("rank ", call.mismatch - 1, " saw it first")
                                           : call.mismatch_detail,
                                       call.numel, call.kind));
  }
  call.buffer.copy_out();
  call.work->complete();
}

}  // namespace

HostPipeline::HostPipeline(TorusShape shape, Engines engines,
                           std::shared_ptr<BackendFailure> failure,
                           std::shared_ptr<DeliveryOrder> order)
    : context_(std::make_shared<Context>()) {
  context_->order = std::move(order);
  context_->shape = shape;
  context_->engines = std::move(engines);
  context_->failure = std::move(failure);
  for (WorkWaiter* waiter : {&context_->row_scatter_waiter, &context_->column_waiter,
                             &context_->column_gather_waiter, &context_->row_gather_waiter})
    waiter->stop_at_failure(context_->failure);
}

c10::intrusive_ptr<c10d::Work> HostPipeline::allreduce(std::vector<at::Tensor> inputs,
                                                       c10d::ReduceOp op, c10d::OpType op_type,
                                                       int64_t segment_bytes, bool one_shot) {
  TORCH_CHECK(one_shot || segment_bytes > 0, "torus: segment_bytes must be positive, got ",
              segment_bytes);
  std::lock_guard<std::mutex> issuing(context_->issuing);
  context_->failure->check_usable();  // also where another call failed since the backend checked
  const TorusShape& shape = context_->shape;
  auto call = std::make_shared<Call>();
  call->work = c10::make_intrusive<TorusWork>(shape.rank, op_type, inputs, context_->order);
  call->buffer = FlatBuffer(std::move(inputs), 1);
  call->buffer.copy_in();
  call->numel = call->buffer.flat.numel();
  call->kind = call_kind(call->buffer.flat.scalar_type(), op);  // the caller's, compared
  // Gloo reduces no bool: its bytes of 0 and 1, "any" or "all" as the caller's op says (the
  // Work keeps the caller's bool tensors, as Gloo's does).
  if (call->buffer.flat.scalar_type() == at::kBool) {
    call->buffer.flat = call->buffer.flat.view(at::kByte);
    op = bool_as_byte_op(op);
  }
  call->op = divide_first_if_half(call->buffer.flat, op, shape.columns * shape.rows);
  // An empty call still exchanges its headers (the one-shot form, of headers alone): were it
  // to end at once, a rank passing an empty tensor where the others pass data would pair its
  // next call with their current one, and both could end with wrong sums and no error.
  call->one_shot = one_shot || call->numel == 0;
  const auto spans = call->one_shot
                         ? std::vector<std::pair<int64_t, int64_t>>{{0, call->numel}}
                         : call->buffer.segments(segment_bytes);
  call->segments_left = static_cast<int64_t>(spans.size());
  call->finished_segments.assign(spans.size(), 0);
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
      abandon_receives(*segment);
      fail(context_, *call, std::current_exception());
      break;
    }
  }
  return call->work;
}

}  // namespace torch_bigbatch::torus
