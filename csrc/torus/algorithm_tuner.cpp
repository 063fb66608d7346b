#include "torus/algorithm_tuner.h"

#include "torus/deadline.h"
#include "torus/topology.h"
#include "torus/torus_work.h"

#include <c10/core/StreamGuard.h>
#include <c10/core/impl/VirtualGuardImpl.h>
#include <c10/util/Exception.h>
#include <c10/util/StringUtil.h>

#include <algorithm>
#include <cstdio>
#include <deque>
#include <iostream>
#include <thread>

namespace torch_bigbatch::torus {
namespace {

using Clock = std::chrono::steady_clock;

// How much faster than the flat allreduce a torus must be in trials to be chosen (see decide).
constexpr double kFlatMargin = 0.05;

// Sizes here are powers of two or segment sizes: whole units.
std::string format_bytes(int64_t bytes) {
  static const char* units[] = {"B", "KiB", "MiB", "GiB", "TiB"};
  int unit = 0;
  while (bytes >= 1024 && bytes % 1024 == 0 && unit < 4) {
    bytes /= 1024;
    ++unit;
  }
  return c10::str(bytes, " ", units[unit]);
}

// "cpu allreduces over 2 KiB up to 4 KiB"
std::string describe_class(c10::DeviceType device, int size_class) {
  const int64_t top = int64_t(1) << size_class;
  return c10::str(c10::DeviceTypeName(device, /*lower_case=*/true), " allreduces ",
                  size_class == 0 ? "" : c10::str("over ", format_bytes(top / 2), " "), "up to ",
                  format_bytes(top));
}

double median(std::vector<double> values) {
  std::sort(values.begin(), values.end());
  const size_t middle = values.size() / 2;
  return values.size() % 2 ? values[middle] : (values[middle - 1] + values[middle]) / 2;
}

std::string format_milliseconds(double seconds) {
  char text[32];
  std::snprintf(text, sizeof text, "%.3g ms", seconds * 1e3);
  return text;
}

}  // namespace

// One timed trial call. On the host its Work's future ends it; on a device, events.
struct Trial {
  size_t candidate = 0;
  int call = 0;  // its index among the candidate's trials: 0 is the warm-up
  Clock::time_point start;
  std::optional<c10::Event> start_event, end_event;
  c10::intrusive_ptr<c10d::Work> device_work;  // a device trial's Work, for its failure

  std::mutex mutex;
  std::condition_variable ended_cv;
  bool ended = false;  // on the host: the Work ended; on a device: its end event was recorded
  std::exception_ptr failure;
  double seconds = 0;

  // Ends the trial with `error`: its call failed (on the host, or before it was issued).
  void fail(const std::exception_ptr& error) {
    std::lock_guard<std::mutex> lock(mutex);
    failure = error;
    ended = true;
    ended_cv.notify_all();
  }

  // A device trial's call was issued and its end event recorded after `work`.
  void recorded(c10::intrusive_ptr<c10d::Work> work) {
    std::lock_guard<std::mutex> lock(mutex);
    device_work = std::move(work);
    ended = true;
    ended_cv.notify_all();
  }

  // The trial's time, once it has ended; throws its failure, or a timeout at `deadline`. A
  // device trial is first waited for on the host until its end event is recorded: the decision
  // may run on another thread while this trial's call is still being issued, and an event
  // never recorded reads as complete.
  double wait(Clock::time_point deadline) {
    {
      std::unique_lock<std::mutex> lock(mutex);
      TORCH_CHECK(ended_cv.wait_until(lock, deadline, [this] { return ended; }),
                  "its trial calls did not end in time");
      if (failure) std::rethrow_exception(failure);
      if (!end_event) return seconds;
    }
    const auto query = EventQueries::get(end_event->device_type(), "torus allreduce trials");
    while (!query(*end_event)) {
      TORCH_CHECK(Clock::now() < deadline, "its trial calls did not end in time");
      std::this_thread::sleep_for(std::chrono::microseconds(100));
    }
    if (auto error = device_work->exception()) std::rethrow_exception(error);
    return start_event->elapsedTime(*end_event) / 1000.0;
  }
};

// A class's trials, and each candidate's time agreed among the ranks (see decide), made on the
// tuner's thread (AgreementThread) or on the deciding call's.
struct Agreement {
  c10::DeviceType device = c10::DeviceType::CPU;
  int size_class = 0;
  std::vector<std::shared_ptr<Trial>> trials;
  size_t candidates = 0;
  Clock::time_point deadline;  // for the trials to end

  std::mutex mutex;
  std::condition_variable done_cv;
  bool done = false;
  std::vector<double> seconds;  // per candidate
  std::exception_ptr failure;   // the decision's, as recorded in the backend's failure

  void end(std::vector<double> agreed, std::exception_ptr error) {
    std::lock_guard<std::mutex> lock(mutex);
    seconds = std::move(agreed);
    failure = error;
    done = true;
    done_cv.notify_all();
  }

  bool failed() {
    std::lock_guard<std::mutex> lock(mutex);
    return failure != nullptr;
  }

  // The agreed times once the tuner's thread has them; its failure, or a timeout at `until`.
  std::vector<double> result(Clock::time_point until) {
    std::unique_lock<std::mutex> lock(mutex);
    TORCH_CHECK(done_cv.wait_until(lock, until, [this] { return done; }),
                "the ranks' agreement did not end in time");
    if (failure) std::rethrow_exception(failure);
    return seconds;
  }
};

namespace {

// The decision of `agreement`'s class failed with `error`: recorded as the backend's failure (no
// later call may post to the group: its agreement may be queued on some ranks and not on
// others), and returned.
std::exception_ptr decision_failure(const Agreement& agreement, const std::exception_ptr& error,
                                    BackendFailure& failure) {
  try {
    // The likely cause where no peer failed: ranks that issue asynchronous collectives in
    // different orders (a p2p exchange around an async allreduce): this call waits for
    // peers that wait for it to return.
    TORCH_CHECK_WITH(DistBackendError, false, "torus allreduce: choosing the algorithm of ",
                     describe_class(agreement.device, agreement.size_class), " failed: ",
                     message_of(error),
                     " (the call that decides a class waits until every rank's trial calls of "
                     "it have ended: where ranks issue asynchronous collectives in different "
                     "orders, fix the algorithm, TorusOptions(algorithm=\"flat\" or "
                     "\"torus\"), or pin a table)");
  } catch (...) {
    failure.record(std::current_exception());
    return std::current_exception();
  }
  return nullptr;  // (unreachable)
}

// Each candidate's median over this rank's timed trials, then the least over the ranks (one
// MIN allreduce of `agree`); throws the decision's failure.
std::vector<double> agree_on_times(Agreement& agreement, c10d::Backend& agree,
                                   std::chrono::milliseconds timeout, BackendFailure& failure) {
  std::vector<double> best(agreement.candidates);
  try {
    // After any failure the ranks' agreements may be out of step: none is posted again.
    if (auto earlier = failure.first()) std::rethrow_exception(earlier);
    std::vector<std::vector<double>> times(agreement.candidates);
    for (const auto& trial : agreement.trials) {
      const double seconds = trial->wait(agreement.deadline);
      if (trial->call > 0) times[trial->candidate].push_back(seconds);
    }
    for (size_t i = 0; i < best.size(); ++i) best[i] = median(times[i]);
    if (auto earlier = failure.first()) std::rethrow_exception(earlier);  // (while it waited)
    // The least median over the ranks counts, so every rank compares the same numbers. A
    // rank's time runs from its own issue, so it includes waiting for the ranks that issue
    // later: in a training step, their lag in the backward pass (the demo's bucket across
    // emulated nodes at 1 Gbit/s: 36-50 ms for either algorithm, where the allreduce alone
    // takes about 5). The rank that issues last waits for nobody. A call's least time over the
    // ranks, taken call by call, favoured algorithms whose ranks end unevenly (the one that
    // issued last can end first); a median over a rank's own calls does not, as each starts
    // where its previous one ended.
    std::vector<at::Tensor> agreed{at::tensor(best, at::kDouble)};
    c10d::AllreduceOptions options;
    options.reduceOp = c10d::ReduceOp::MIN;
    agree.allreduce(agreed, options)->wait(timeout);
    best.assign(agreed[0].data_ptr<double>(), agreed[0].data_ptr<double>() + best.size());
  } catch (...) {
    std::rethrow_exception(decision_failure(agreement, std::current_exception(), failure));
  }
  return best;
}

}  // namespace

// The tuner's thread: agrees on the classes posted to it, one after another in posting order.
class AgreementThread {
 public:
  AgreementThread(c10::intrusive_ptr<c10d::Backend> agree, std::chrono::milliseconds timeout,
                  std::shared_ptr<BackendFailure> failure)
      : queue_(std::make_shared<Queue>()) {
    thread_ = std::thread(run, queue_, std::move(agree), timeout, std::move(failure));
  }

  // Joined when idle; detached while it agrees (each of its waits is bounded by the timeout,
  // and it holds what it uses): a group destroyed after a peer died would otherwise wait.
  ~AgreementThread() {
    bool idle;
    {
      std::lock_guard<std::mutex> lock(queue_->mutex);
      queue_->stopping = true;
      idle = !queue_->busy;
    }
    queue_->ready.notify_all();
    idle ? thread_.join() : thread_.detach();
  }

  void post(std::shared_ptr<Agreement> agreement) {
    {
      std::lock_guard<std::mutex> lock(queue_->mutex);
      queue_->agreements.push_back(std::move(agreement));
    }
    queue_->ready.notify_all();
  }

 private:
  struct Queue {
    std::mutex mutex;
    std::condition_variable ready;
    std::deque<std::shared_ptr<Agreement>> agreements;
    bool stopping = false, busy = false;
  };

  static void run(std::shared_ptr<Queue> queue, c10::intrusive_ptr<c10d::Backend> agree,
                  std::chrono::milliseconds timeout, std::shared_ptr<BackendFailure> failure) {
    while (true) {
      std::shared_ptr<Agreement> agreement;
      {
        std::unique_lock<std::mutex> lock(queue->mutex);
        queue->ready.wait(lock, [&] { return queue->stopping || !queue->agreements.empty(); });
        if (queue->stopping) return;
        agreement = std::move(queue->agreements.front());
        queue->agreements.pop_front();
        queue->busy = true;
      }
      try {
        agreement->end(agree_on_times(*agreement, *agree, timeout, *failure), nullptr);
      } catch (...) {
        agreement->end({}, std::current_exception());
      }
      std::lock_guard<std::mutex> lock(queue->mutex);
      queue->busy = false;
    }
  }

  std::shared_ptr<Queue> queue_;
  std::thread thread_;
};

std::string Choice::describe() const {
  if (algorithm == Algorithm::Flat) return "flat";
  if (one_shot) return "torus (one shot)";
  return c10::str("torus (", format_bytes(segment_bytes), " segments)");
}

int size_class_of(int64_t bytes) {
  int k = 0;
  while (k < kMaxSizeClass && (int64_t(1) << k) < bytes) ++k;
  return k;
}

AlgorithmTuner::AlgorithmTuner(int rank, std::string group, DeviceTuning cpu, DeviceTuning cuda,
                               std::vector<PinnedClass> pinned,
                               c10::intrusive_ptr<c10d::Backend> agree,
                               c10::intrusive_ptr<c10d::Backend> background,
                               std::chrono::milliseconds timeout,
                               std::shared_ptr<BackendFailure> failure, int calls_per_candidate)
    : rank_(rank),
      group_(std::move(group)),
      cpu_(cpu),
      cuda_(cuda),
      agree_(std::move(agree)),
      background_(std::move(background)),
      timeout_(timeout),
      calls_per_candidate_(calls_per_candidate),
      failure_(std::move(failure)) {
  TORCH_CHECK(calls_per_candidate_ >= 2, "torus: the tuner needs a warm-up call and a timed one");
  for (const auto& entry : pinned) {
    TORCH_CHECK(entry.size_class >= 0 && entry.size_class <= kMaxSizeClass,
                "torus: a pinned size class must be in [0, ", kMaxSizeClass, "], got ",
                entry.size_class);
    TORCH_CHECK(!entry.choice.one_shot || tuning(entry.device).one_shot_max_bytes > 0,
                "torus: the one-shot torus runs on CPU tensors only, got it pinned for ",
                c10::DeviceTypeName(entry.device, /*lower_case=*/true));
    TORCH_CHECK(!entry.choice.one_shot ||
                    (int64_t(1) << entry.size_class) <= tuning(entry.device).one_shot_max_bytes,
                "torus: the one-shot torus runs buffers of up to ",
                tuning(entry.device).one_shot_max_bytes, " bytes, got it pinned for ",
                describe_class(entry.device, entry.size_class));
    ClassState& state = classes_[{entry.device, entry.size_class}];
    state.decided = entry.choice;
    state.source = "pinned";
  }
}

AlgorithmTuner::~AlgorithmTuner() = default;

const DeviceTuning& AlgorithmTuner::tuning(c10::DeviceType device) const {
  return device == c10::DeviceType::CPU ? cpu_ : cuda_;
}

// The flat allreduce, then the torus with its segments, its one-shot form where the class's
// buffers may take it, and the torus with each alternative segment size that cuts the class's
// largest buffer into another number of segments than those before it; a size smaller than the
// default only where it makes at least 8 segments. Every candidate is one more chance for noisy
// trials to pick a loser (a 1 MiB class across emulated nodes took 512 KiB segments in trials
// and ran 0.80x Gloo), and two to four segments pipeline little. Both forms of the torus where
// the one-shot one may run: it sends X - 1 + Y - 1 buffers per rank against about 2, and which
// costs less depends on the links (256 KiB across emulated nodes at 1 Gbit/s: one-shot
// 0.8-1.25x Gloo over nine runs, the four-phase form 1.5-2x over four; on one machine as 4x4,
// where steps cost more than bytes, one-shot takes 0.4-0.7x the four-phase form's time in
// trials up to 256 KiB).
std::vector<Choice> AlgorithmTuner::candidates(const DeviceTuning& tuning, int size_class) const {
  std::vector<Choice> result{{Algorithm::Flat, 0}, {Algorithm::Torus, tuning.segment_bytes}};
  const int64_t top = int64_t(1) << size_class;
  if (top <= tuning.one_shot_max_bytes) result.push_back({Algorithm::Torus, 0, true});
  auto segments = [top](int64_t size) { return (top - 1) / size + 1; };  // (no overflow)
  std::vector<int64_t> counts{segments(tuning.segment_bytes)};
  for (int64_t other : tuning.alternative_segment_bytes) {
    if (std::find(counts.begin(), counts.end(), segments(other)) != counts.end()) continue;
    if (other < tuning.segment_bytes && segments(other) < 8) continue;
    counts.push_back(segments(other));
    result.push_back({Algorithm::Torus, other});
  }
  return result;
}

// The choice of the modes that measure nothing; none under TuningMode::Measure.
std::optional<Choice> AlgorithmTuner::fixed_choice(const DeviceTuning& tuning,
                                                   int64_t bytes) const {
  // (an empty buffer, 0 bytes, takes the one-shot form only where there is one)
  const bool one_shot = tuning.one_shot_max_bytes > 0 && bytes <= tuning.one_shot_max_bytes;
  const Choice torus = one_shot ? Choice{Algorithm::Torus, 0, true}
                                : Choice{Algorithm::Torus, tuning.segment_bytes};
  const Choice flat{Algorithm::Flat, 0};
  switch (tuning.mode) {
    case TuningMode::Torus:
      return torus;
    case TuningMode::Flat:
      return flat;
    case TuningMode::Limit:
      return bytes <= tuning.torus_max_bytes ? torus : flat;
    case TuningMode::Measure:
      break;
  }
  return std::nullopt;
}

std::optional<Choice> AlgorithmTuner::chosen(c10::DeviceType device, int64_t bytes) const {
  std::lock_guard<std::mutex> lock(mutex_);
  if (auto choice = fixed_choice(tuning(device), bytes)) return choice;
  auto found = classes_.find({device, size_class_of(bytes)});
  return found != classes_.end() ? found->second.decided : std::nullopt;
}

AlgorithmTuner::Call AlgorithmTuner::begin(c10::Device device, int64_t bytes) {
  std::lock_guard<std::mutex> lock(mutex_);
  failure_->check_usable();  // under the lock: also after a decision that failed meanwhile
  const DeviceTuning& tuning = this->tuning(device.type());
  const std::optional<Choice> fixed = fixed_choice(tuning, bytes);
  Call call = fixed ? Call{*fixed, nullptr} : measured_call(device, bytes, tuning);
  const bool is_torus = call.choice.algorithm == Algorithm::Torus;
  ++counts_[c10::str(c10::DeviceTypeName(device.type(), true), is_torus ? " torus" : " flat")];
  return call;
}

// Under TuningMode::Measure: the next trial of the class, its decision after the last trial,
// or the decided choice.
AlgorithmTuner::Call AlgorithmTuner::measured_call(c10::Device device, int64_t bytes,
                                                   const DeviceTuning& tuning) {
  const int size_class = size_class_of(bytes);
  ClassState& state = classes_[{device.type(), size_class}];
  if (state.candidates.empty() && !state.decided) {
    state.candidates = candidates(tuning, size_class);
    state.source = "measuring";
  }
  const int64_t trials = calls_per_candidate_ * static_cast<int64_t>(state.candidates.size());
  if (!state.decided && state.trial_calls == trials) {
    if (state.agreement && state.calls_while_agreeing < kCallsWhileAgreeing) {
      ++state.calls_while_agreeing;
      return {state.candidates.front(), nullptr};  // flat, on every rank
    }
    decide(device.type(), size_class, state);
  }
  if (state.decided) return {*state.decided, nullptr};

  auto trial = std::make_shared<Trial>();
  trial->candidate = static_cast<size_t>(state.trial_calls / calls_per_candidate_);
  trial->call = static_cast<int>(state.trial_calls % calls_per_candidate_);
  ++state.trial_calls;
  if (tuning.host_clock) {
    trial->start = Clock::now();
  } else {
    trial->start_event.emplace(device.type(), c10::EventFlag::BACKEND_DEFAULT);
    trial->end_event.emplace(device.type(), c10::EventFlag::BACKEND_DEFAULT);
    trial->start_event->record(c10::impl::VirtualGuardImpl(device.type()).getStream(device));
  }
  state.trials.push_back(trial);
  if (tuning.host_clock && background_ && state.trial_calls == trials) {  // agree meanwhile
    state.agreement = agreement(device.type(), size_class, state);
    if (!agreements_)
      agreements_ = std::make_unique<AgreementThread>(background_, timeout_, failure_);
    agreements_->post(state.agreement);
  }
  return {state.candidates[trial->candidate], trial};
}

std::shared_ptr<Agreement> AlgorithmTuner::agreement(c10::DeviceType device, int size_class,
                                                     ClassState& state) const {
  auto agreement = std::make_shared<Agreement>();
  agreement->device = device;
  agreement->size_class = size_class;
  agreement->trials = state.trials;
  agreement->candidates = state.candidates.size();
  agreement->deadline = deadline_after(Clock::now(), timeout_);
  return agreement;
}

void AlgorithmTuner::finish(const Call& call, const c10::intrusive_ptr<c10d::Work>& work) {
  const std::shared_ptr<Trial>& trial = call.trial;
  if (!trial) return;
  if (!trial->end_event) {
    auto ended = [trial](const std::exception_ptr& error) {
      if (error) return trial->fail(error);
      std::lock_guard<std::mutex> lock(trial->mutex);
      trial->seconds = std::chrono::duration<double>(Clock::now() - trial->start).count();
      trial->ended = true;
      trial->ended_cv.notify_all();
    };
    // A torus Work's future ends in the backend's delivery order (delivery_order.h): a
    // decision made inside the callback of an earlier Work would wait for itself.
    if (auto* torus_work = dynamic_cast<TorusWork*>(work.get()))
      return torus_work->on_settled(ended);
    work->getFuture()->addCallback([ended](c10::ivalue::Future& future) {
      ended(future.hasError() ? future.exception_ptr() : nullptr);
    });
    return;
  }
  // On a stream of the tuner's that waits for the Work: the caller's streams get no new wait.
  const c10::Device device = trial->start_event->device();
  const c10::Stream stream = timing_stream(device);
  c10::StreamGuard on_timing(stream);
  work->synchronize();
  trial->end_event->record(stream);
  trial->recorded(work);
}

void AlgorithmTuner::abandon(const Call& call, const std::exception_ptr& error) {
  if (call.trial) call.trial->fail(error);
}

c10::Stream AlgorithmTuner::timing_stream(c10::Device device) {
  std::lock_guard<std::mutex> lock(streams_mutex_);
  auto found = timing_streams_.find(device.index());
  if (found != timing_streams_.end()) return found->second;
  c10::Stream stream = c10::impl::VirtualGuardImpl(device.type())
                           .getStreamFromGlobalPool(device, /*isHighPriority=*/false);
  return timing_streams_.emplace(device.index(), stream).first->second;
}

void AlgorithmTuner::decide(c10::DeviceType device, int size_class, ClassState& state) {
  const size_t count = state.candidates.size();
  const int64_t timed = calls_per_candidate_ - 1;
  std::vector<double> best;
  if (!state.agreement) {  // on a device: here, on this call's thread (see the header)
    best = agree_on_times(*agreement(device, size_class, state), *agree_, timeout_, *failure_);
  } else {
    try {  // the tuner's thread ends it within the timeout after the trials' deadline, unless
           // an earlier class's agreement held it: a bound all the same
      best = state.agreement->result(deadline_after(state.agreement->deadline,
                                                    2 * timeout_ + std::chrono::seconds(1)));
    } catch (...) {  // its own failure is the decision's, recorded; a late end is not
      std::exception_ptr error = std::current_exception();
      if (!state.agreement->failed()) error = decision_failure(*state.agreement, error, *failure_);
      std::rethrow_exception(error);
    }
  }
  // The flat allreduce (candidate 0, the engine's own) keeps the class unless a torus beats it
  // by kFlatMargin: trials of four calls on a shared machine miss the steady state by up to a
  // tenth, and a near tie taken by the torus ran 0.89x Gloo (2x4 at 16 MiB on one machine:
  // flat 40.6 ms, torus 40.4 ms in trials).
  size_t fastest = 0;
  for (size_t i = 1; i < count; ++i)
    if (best[i] < (fastest == 0 ? best[0] * (1 - kFlatMargin) : best[fastest])) fastest = i;
  state.decided = state.candidates[fastest];
  state.seconds = best;
  state.source = "measured";
  state.trials.clear();
  state.agreement.reset();
  if (rank_ != 0) return;
  std::string times;
  for (size_t i = 0; i < count; ++i)
    times += c10::str(i ? ", " : "", state.candidates[i].describe(), " ",
                      format_milliseconds(best[i]));
  std::cerr << "torch_bigbatch torus (" << group_ << "): " << describe_class(device, size_class)
            << " run " << state.decided->describe() << " (" << times
            << ": the least over the ranks of each one's median of " << timed
            << " calls; the torus must beat flat by " << kFlatMargin * 100 << "%)"
            << std::endl;
}

std::vector<TableRow> AlgorithmTuner::table() const {
  std::lock_guard<std::mutex> lock(mutex_);
  std::vector<TableRow> rows;
  for (const auto& [key, state] : classes_) {
    TableRow row{key.first, key.second, state.source, state.decided, {}};
    for (size_t i = 0; i < state.seconds.size(); ++i)
      row.seconds.emplace_back(state.candidates[i], state.seconds[i]);
    rows.push_back(std::move(row));
  }
  return rows;
}

std::map<std::string, int64_t> AlgorithmTuner::counts() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return counts_;
}

}  // namespace torch_bigbatch::torus
