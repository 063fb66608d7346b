// Python bindings of the torus backend: torch_bigbatch._C.TorusBackend is a subclass of
// torch.distributed.Backend, which torch_bigbatch.distributed registers as "torus".

#include "torus/torus_python.h"

#include "torus/host_pipeline.h"
#include "torus/thread_activity.h"
#include "torus/torus_backend.h"

#include <pybind11/chrono.h>
#include <pybind11/stl.h>
#include <torch/csrc/utils/pybind.h>

#include <map>
#include <string>
#include <tuple>
#include <vector>

namespace torch_bigbatch::torus {

namespace py = pybind11;

namespace {

// (mode, torus_max_bytes, segment_bytes, alternative_segment_bytes), mode one of "measure",
// "limit", "torus", "flat".
using TuningSpec = std::tuple<std::string, int64_t, int64_t, std::vector<int64_t>>;
// (device, size class, "flat" or "torus", segment_bytes, one_shot).
using PinnedSpec = std::tuple<std::string, int, std::string, int64_t, bool>;

DeviceTuning device_tuning(const TuningSpec& spec) {
  const auto& [mode, torus_max_bytes, segment_bytes, alternative_segment_bytes] = spec;
  static const std::map<std::string, TuningMode> modes = {{"measure", TuningMode::Measure},
                                                           {"limit", TuningMode::Limit},
                                                           {"torus", TuningMode::Torus},
                                                           {"flat", TuningMode::Flat}};
  TORCH_CHECK(modes.count(mode), "torus: unknown tuning mode ", mode);
  TORCH_CHECK(segment_bytes > 0, "torus: segment_bytes must be positive, got ", segment_bytes);
  for (int64_t other : alternative_segment_bytes)
    TORCH_CHECK(other > 0, "torus: segment sizes must be positive, got ", other);
  return {modes.at(mode), torus_max_bytes, segment_bytes, alternative_segment_bytes};
}

Choice choice(const std::string& algorithm, int64_t segment_bytes, bool one_shot) {
  TORCH_CHECK(algorithm == "flat" || algorithm == "torus",
              "torus: an algorithm is 'flat' or 'torus', got ", algorithm);
  if (algorithm == "flat") return {Algorithm::Flat, 0};
  if (one_shot) return {Algorithm::Torus, 0, true};
  TORCH_CHECK(segment_bytes > 0, "torus: segment_bytes must be positive, got ", segment_bytes);
  return {Algorithm::Torus, segment_bytes};
}

void describe_choice(const std::optional<Choice>& choice, py::dict& row) {
  const bool torus = choice && choice->algorithm == Algorithm::Torus;
  row["algorithm"] =
      choice ? py::object(py::str(torus ? "torus" : "flat")) : py::object(py::none());
  row["segment_bytes"] =
      torus && !choice->one_shot ? py::object(py::int_(choice->segment_bytes)) : py::none();
  row["one_shot"] = torus && choice->one_shot;
}

// The tuner holds its lock while a size class's trials end, and their futures' callbacks may
// need the GIL: a reader of the tuner waits for that lock without it.
template <typename Read>
auto without_gil(Read read) {
  py::gil_scoped_release no_gil;
  return read();
}

py::list algorithm_table(const TorusBackend& self) {
  py::list rows;
  for (const TableRow& entry : without_gil([&] { return self.tuner().table(); })) {
    py::dict row;
    row["device"] = c10::DeviceTypeName(entry.device, /*lower_case=*/true);
    row["min_bytes"] = entry.size_class == 0 ? 0 : (int64_t(1) << (entry.size_class - 1)) + 1;
    row["max_bytes"] = int64_t(1) << entry.size_class;
    row["source"] = entry.source;
    describe_choice(entry.choice, row);
    py::list seconds;
    for (const auto& [candidate, time] : entry.seconds) {
      py::dict measured;
      describe_choice(candidate, measured);
      measured["seconds"] = time;
      seconds.append(measured);
    }
    row["candidates"] = seconds;
    rows.append(row);
  }
  return rows;
}

}  // namespace

void bind_torus(py::module& m) {
  py::module::import("torch.distributed");  // registers the Backend base class
  // Read by TorusOptions, which refuses a larger one-shot row before any group is built.
  m.attr("torus_one_shot_max_bytes") = kOneShotBytes;
  m.attr("torus_max_size_class") = kMaxSizeClass;

  m.def(
      "torus_threads_wait_until_idle",
      [](double seconds) {
        return thread_activity::wait_until_idle(std::chrono::milliseconds(
            static_cast<int64_t>(seconds * 1000)));
      },
      py::arg("seconds"), py::call_guard<py::gil_scoped_release>(),
      "Waits until the torus's threads hold nothing of Python's (at most `seconds`): "
      "torch_bigbatch calls it at interpreter exit (csrc/torus/thread_activity.h)");

  py::class_<Engines>(m, "TorusEngines",
                      "The process groups of one device type that the torus composes.")
      .def(py::init([](c10::intrusive_ptr<c10d::Backend> whole,
                       std::optional<c10::intrusive_ptr<c10d::Backend>> row_scatter,
                       std::optional<c10::intrusive_ptr<c10d::Backend>> column,
                       std::optional<c10::intrusive_ptr<c10d::Backend>> row_gather,
                       bool ordered_on_host) {
             return Engines{std::move(whole),
                            row_scatter.value_or(nullptr),
                            column.value_or(nullptr),
                            row_gather.value_or(nullptr),
                            ordered_on_host};
           }),
           py::arg("whole"), py::arg("row_scatter"), py::arg("column"), py::arg("row_gather"),
           py::arg("ordered_on_host") = false);

  py::class_<TorusBackend, c10d::Backend, c10::intrusive_ptr<TorusBackend>>(m, "TorusBackend")
      .def(py::init([](int rank, int size, int columns, int rows, std::optional<Engines> cpu,
                       std::optional<Engines> cuda, const TuningSpec& cpu_tuning,
                       const TuningSpec& cuda_tuning, const std::vector<PinnedSpec>& pinned,
                       std::chrono::milliseconds timeout, std::string group,
                       std::optional<c10::intrusive_ptr<c10d::Backend>> tuner) {
             TorusSettings settings{device_tuning(cpu_tuning), device_tuning(cuda_tuning), {},
                                    timeout, std::move(group), tuner.value_or(nullptr)};
             for (const auto& [device, size_class, algorithm, segment_bytes, one_shot] : pinned) {
               settings.pinned.push_back({c10::Device(device).type(), size_class,
                                          choice(algorithm, segment_bytes, one_shot)});
             }
             return c10::make_intrusive<TorusBackend>(TorusShape{columns, rows, rank}, size,
                                                      std::move(cpu), std::move(cuda),
                                                      std::move(settings));
           }),
           py::arg("rank"), py::arg("size"), py::arg("columns"), py::arg("rows"),
           py::arg("cpu"), py::arg("cuda"), py::arg("cpu_tuning"), py::arg("cuda_tuning"),
           py::arg("pinned"), py::arg("timeout"), py::arg("group"), py::arg("tuner") = py::none(),
           py::call_guard<py::gil_scoped_release>())
      .def_property_readonly("shape",
                             [](const TorusBackend& self) {
                               return std::make_pair(self.shape().columns, self.shape().rows);
                             })
      .def("algorithm_table", &algorithm_table,
           "Per device type and size class: the algorithm chosen (or 'measuring') and the "
           "agreed time of each candidate")
      .def(
          "chosen_algorithm",
          [](const TorusBackend& self, const std::string& device, int64_t bytes) {
            py::dict row;
            const c10::DeviceType type = c10::Device(device).type();
            self.engines_for(type, "algorithm query");  // none: says why, as a collective would
            describe_choice(without_gil([&] { return self.tuner().chosen(type, bytes); }), row);
            return row;
          },
          "What an allreduce of `bytes` on `device` tensors runs: {'algorithm': 'flat' or "
          "'torus' or None (still measuring), 'segment_bytes': ..., 'one_shot': ...}")
      .def(
          "allreduce_counts",
          [](const TorusBackend& self) {
            return without_gil([&] { return self.tuner().counts(); });
          },
          "Allreduces run per device type and algorithm: {'cpu torus': 12, ...}");
}

}  // namespace torch_bigbatch::torus
