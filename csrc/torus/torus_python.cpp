// Python bindings of the torus backend: torch_bigbatch._C.TorusBackend is a subclass of
// torch.distributed.Backend, which torch_bigbatch.distributed registers as "torus".

#include "torus/torus_python.h"

#include "torus/torus_backend.h"

#include <pybind11/chrono.h>
#include <pybind11/stl.h>
#include <torch/csrc/utils/pybind.h>

namespace torch_bigbatch::torus {

namespace py = pybind11;

void bind_torus(py::module& m) {
  py::module::import("torch.distributed");  // registers the Backend base class

  m.attr("TORUS_ONE_SHOT_BYTES") = kOneShotBytes;

  py::class_<Engines>(m, "TorusEngines",
                      "The process groups of one device type that the torus composes.")
      .def(py::init([](c10::intrusive_ptr<c10d::Backend> whole,
                       std::optional<c10::intrusive_ptr<c10d::Backend>> row_scatter,
                       std::optional<c10::intrusive_ptr<c10d::Backend>> column,
                       std::optional<c10::intrusive_ptr<c10d::Backend>> column_gather,
                       std::optional<c10::intrusive_ptr<c10d::Backend>> row_gather) {
             return Engines{std::move(whole), row_scatter.value_or(nullptr),
                            column.value_or(nullptr), column_gather.value_or(nullptr),
                            row_gather.value_or(nullptr)};
           }),
           py::arg("whole"), py::arg("row_scatter"), py::arg("column"),
           py::arg("column_gather"), py::arg("row_gather"));

  py::class_<TorusBackend, c10d::Backend, c10::intrusive_ptr<TorusBackend>>(m, "TorusBackend")
      .def(py::init([](int rank, int size, int columns, int rows, std::optional<Engines> cpu,
                       std::optional<Engines> cuda, int64_t cpu_segment_bytes,
                       int64_t cuda_segment_bytes,
                       int64_t cpu_torus_max_bytes, int64_t cuda_torus_max_bytes,
                       std::chrono::milliseconds timeout) {
             TorusShape shape{columns, rows, rank};
             TorusSettings settings{cpu_segment_bytes, cuda_segment_bytes, cpu_torus_max_bytes,
                                    cuda_torus_max_bytes,
                                    timeout};
             return c10::make_intrusive<TorusBackend>(shape, size, std::move(cpu),
                                                      std::move(cuda), settings);
           }),
           py::arg("rank"), py::arg("size"), py::arg("columns"), py::arg("rows"),
           py::arg("cpu"), py::arg("cuda"), py::arg("cpu_segment_bytes"),
           py::arg("cuda_segment_bytes"),
           py::arg("cpu_torus_max_bytes"), py::arg("cuda_torus_max_bytes"), py::arg("timeout"),
           py::call_guard<py::gil_scoped_release>())
      .def_property_readonly("shape",
                             [](const TorusBackend& self) {
                               return std::make_pair(self.shape().columns, self.shape().rows);
                             })
      .def_property_readonly(
          "torus_max_bytes",
          [](const TorusBackend& self) {
            return std::make_pair(self.settings().cpu_torus_max_bytes,
                                  self.settings().cuda_torus_max_bytes);
          },
          "(CPU, CUDA): the largest buffer an allreduce sends through the torus");
}

}  // namespace torch_bigbatch::torus
