// Which algorithm each allreduce of a torus group runs: the whole group's own allreduce
// ("flat": Gloo's or NCCL's) or the torus pipeline with a segment size (or, for small host
// buffers, in its one-shot form), per device type and size class (the powers of two of bytes:
// a class holds the sizes in (2^(k-1), 2^k]).
//
// Under "auto" the tuner measures instead of guessing. The first calls of a class are trials:
// each candidate in turn runs a few calls on the caller's own data (in a fixed order, so every
// rank runs the same candidate on the same call; consecutive calls, as the class will run
// them: alternating candidates call by call charged each the cost of switching from the
// other, which picked the torus at 4 MiB across emulated nodes where it runs 0.7x Gloo). A
// trial is timed from its issue to its end: on the host (and on engines whose device Works end
// on the host) by the clock and the Work's future, on a device by events (the start on the
// caller's stream, the end on a stream of the tuner's that waits for the Work), never by a host
// sync on the call's path. Then the class decides (below: when and where): each rank takes
// the median time of each candidate over its calls after the first (a warm-up; 4 timed calls:
// on this shared 2-core machine a Gloo ring's time is bimodal, and the best of a few calls
// picked its lucky mode, 2 ms against 4 ms in steady state), the ranks combine them with one
// small MIN allreduce of a CPU group, and every rank picks the
// same fastest candidate (flat unless a torus beats it by 5%: see decide). The least rank's
// time counts: a rank's time includes waiting for the ranks that issue later (in a training
// step, their lag in the backward pass), and the rank that issues last waits for nobody. From
// then on the class runs it: a table lookup under the tuner's lock, no extra collective.
//
// Where trials are timed on the host, the ranks agree in the background: the tuner's own thread
// waits for a class's trials and posts its MIN allreduce on a group that only it uses, classes
// in the order their last trial was issued (the same on every rank), while the class's next
// kCallsWhileAgreeing calls run flat; the call after them takes the agreed times, waiting only
// if they are not in yet. A deciding call that waited for the trials itself made an async
// allreduce wait for peers that waited for it to return (rank 0: async allreduce, then send;
// rank 1: recv, then allreduce): both timed out; now that takes a rank issuing more than
// kCallsWhileAgreeing calls of the class ahead of such a dependency. On a device (events) the
// deciding call, the first after the trials, still waits for them and the agreement (through
// the whole group). Either way the deciding call waits at most about three times the group's
// timeout (the trials', the agreement's, and on the host a bound on both) and holds the
// tuner's lock: the group's other calls and queries wait for it too, so that calls are issued
// in the order they reached the tuner.
//
// Other modes: "torus" and "flat" fix the algorithm; a byte limit takes the torus up to it and
// the flat allreduce above; pinned classes (a table loaded by the user) skip the trials.
// Algorithms may differ in the last bits of a float sum, so bit-for-bit reproducible runs fix
// the algorithm (or pin a table).
#pragma once

#include "common/device_launchers.h"
#include "torus/backend_failure.h"

#include <ATen/ATen.h>
#include <c10/core/Device.h>
#include <c10/core/Event.h>
#include <c10/core/Stream.h>
#include <torch/csrc/distributed/c10d/Backend.hpp>

#include <array>
#include <chrono>
#include <condition_variable>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <vector>

namespace torch_bigbatch::torus {

enum class Algorithm { Flat, Torus };

struct Trial;      // one timed trial call (algorithm_tuner.cpp)
struct Agreement;  // a class's trials and their agreed times (algorithm_tuner.cpp)
class AgreementThread;

// Calls of a class timed on the host that run flat while its ranks agree in the background.
// The deciding call still waits where the agreement is not in: a rank that issues more calls of
// the class than this before it waits for a peer (which waits for it) can still time out there.
constexpr int64_t kCallsWhileAgreeing = 16;

struct Choice {
  Algorithm algorithm = Algorithm::Flat;
  int64_t segment_bytes = 0;  // for Algorithm::Torus, unless one_shot
  bool one_shot = false;      // the torus's two whole-buffer exchanges (HostPipeline)

  bool operator==(const Choice& other) const {
    return algorithm == other.algorithm && segment_bytes == other.segment_bytes &&
           one_shot == other.one_shot;
  }
  std::string describe() const;  // "flat", "torus (2 MiB segments)", "torus (one shot)"
};

enum class TuningMode { Measure, Limit, Torus, Flat };

// How one device type's allreduces are chosen.
struct DeviceTuning {
  TuningMode mode = TuningMode::Measure;
  int64_t torus_max_bytes = 0;            // TuningMode::Limit
  int64_t segment_bytes = 8 << 20;        // the torus's segments outside trials
  // Also tried, each where it cuts the class's buffers into another number of segments.
  std::vector<int64_t> alternative_segment_bytes;
  // The torus's one-shot form up to this size (0: it has none): a candidate beside the
  // segmented torus, and what the fixed modes' torus runs.
  int64_t one_shot_max_bytes = 0;
  // Trials timed by the host's clock and the Work's future instead of by device events: CPU
  // tensors, and engines whose device Works end on the host (Engines::ordered_on_host).
  bool host_clock = false;
};

// A class's choice given by the user: skips its trials.
struct PinnedClass {
  c10::DeviceType device;
  int size_class;  // k: sizes in (2^(k-1), 2^k] bytes
  Choice choice;
};

// One row of the table a group reports.
struct TableRow {
  c10::DeviceType device;
  int size_class;
  std::string source;  // "measured", "pinned" or "measuring"
  std::optional<Choice> choice;
  std::vector<std::pair<Choice, double>> seconds;  // measured: each candidate's agreed time
};

// The largest size class: sizes up to 2^62 bytes (any buffer; 2^63 is past int64).
constexpr int kMaxSizeClass = 62;
int size_class_of(int64_t bytes);  // the smallest k with bytes <= 2^k

// What a device's glue registers to ask whether a trial's end event has completed, from the
// caller's thread, without harming a graph that another thread captures (torus_cuda_glue.cpp).
using EventQueries = DeviceLaunchers<bool (*)(const c10::Event&)>;

class AlgorithmTuner {
 public:
  // rank, group: for the decision's log line (rank 0 prints it, naming the group: its ranks and
  // shape, as several groups decide alike); agree: the whole CPU group, for the
  // one MIN allreduce of each decision; background: a CPU group of the same ranks that only
  // this tuner's thread uses, for the agreements in the background (none: every decision
  // agrees on its call's thread, through `agree`); timeout: how long a decision waits for its
  // trials;
  // failure: the backend's, which a failed decision records (begin() refuses after any).
  AlgorithmTuner(int rank, std::string group, DeviceTuning cpu, DeviceTuning cuda,
                 std::vector<PinnedClass> pinned,
                 c10::intrusive_ptr<c10d::Backend> agree,
                 c10::intrusive_ptr<c10d::Backend> background, std::chrono::milliseconds timeout,
                 std::shared_ptr<BackendFailure> failure, int calls_per_candidate = 5);
  ~AlgorithmTuner();
  AlgorithmTuner(const AlgorithmTuner&) = delete;
  AlgorithmTuner& operator=(const AlgorithmTuner&) = delete;

  // What the allreduce of `bytes` on `device` runs. A trial call carries what times it:
  // begin() before the call is issued, finish() with its Work.
  struct Call {
    Choice choice;
    std::shared_ptr<Trial> trial;  // null outside trials
  };
  Call begin(c10::Device device, int64_t bytes);
  void finish(const Call& call, const c10::intrusive_ptr<c10d::Work>& work);
  // The call could not be issued: a trial ends with the error (its decision raises it).
  void abandon(const Call& call, const std::exception_ptr& error);

  // The choice of the allreduce of `bytes` on `device`; none while its class is measured.
  std::optional<Choice> chosen(c10::DeviceType device, int64_t bytes) const;
  std::vector<TableRow> table() const;
  // Calls run per device type and algorithm: {"cpu flat": 3, "cpu torus": 10, ...}.
  std::map<std::string, int64_t> counts() const;

 private:
  struct ClassState {
    std::vector<Choice> candidates;
    int64_t trial_calls = 0;
    std::vector<std::shared_ptr<Trial>> trials;
    std::shared_ptr<Agreement> agreement;  // in the background: from its last trial's issue
    int64_t calls_while_agreeing = 0;
    std::optional<Choice> decided;
    std::string source;
    std::vector<double> seconds;  // per candidate, agreed
  };

  const DeviceTuning& tuning(c10::DeviceType device) const;
  std::optional<Choice> fixed_choice(const DeviceTuning& tuning, int64_t bytes) const;
  Call measured_call(c10::Device device, int64_t bytes, const DeviceTuning& tuning);
  std::vector<Choice> candidates(const DeviceTuning& tuning, int size_class) const;
  std::shared_ptr<Agreement> agreement(c10::DeviceType device, int size_class,
                                       ClassState& state) const;
  void decide(c10::DeviceType device, int size_class, ClassState& state);
  c10::Stream timing_stream(c10::Device device);

  const int rank_;
  const std::string group_;
  const DeviceTuning cpu_, cuda_;
  const c10::intrusive_ptr<c10d::Backend> agree_, background_;
  const std::chrono::milliseconds timeout_;
  const int calls_per_candidate_;  // trials: the first a warm-up

  // A decision that failed: its agreement allreduce may still be queued on some ranks and not on
  // others, so no later call may post to the group again.
  const std::shared_ptr<BackendFailure> failure_;
  mutable std::mutex mutex_;  // guards classes_ and counts_ (held by a decision)
  std::map<std::pair<c10::DeviceType, int>, ClassState> classes_;
  std::map<std::string, int64_t> counts_;
  std::mutex streams_mutex_;  // guards timing_streams_
  std::map<c10::DeviceIndex, c10::Stream> timing_streams_;
  std::unique_ptr<AgreementThread> agreements_;  // made at the first agreement in the background
};

}  // namespace torch_bigbatch::torus
