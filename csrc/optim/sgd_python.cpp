#include "optim/sgd_python.h"

#include "optim/sgd_op.h"

#include <torch/extension.h>

#include <ATen/record_function.h>

namespace torch_bigbatch::optim {
namespace {

template <typename T>
c10::List<T> to_list(const std::vector<T>& values) {
  c10::List<T> list;
  list.reserve(values.size());
  for (const T& value : values) list.push_back(value);
  return list;
}

// Why by hand: a call through torch.ops turns each tensor into an IValue and back, about 0.15 us
// a tensor on a 2-core Xeon, 70 us for ResNet-50's step (161 parameters, gradients and buffers;
// a no-op op of the same three lists), where pybind11 takes 30 and the step's host side is
// what bounds it on a fast GPU. The optimizer calls the op instead wherever the dispatcher must
// see it (torch.compile, dispatch and function modes; torch_bigbatch/optim/sgd.py).
void sgd_step_from_python(
    const std::vector<at::Tensor>& params, const std::vector<at::Tensor>& grads,
    const std::vector<at::Tensor>& momentum_buffers, const std::vector<int64_t>& group_of_tensor,
    const std::vector<double>& lr, const std::vector<std::optional<at::Tensor>>& lr_tensor,
    const std::vector<double>& momentum, const std::vector<double>& momentum_scale,
    const std::vector<double>& dampening, const std::vector<double>& weight_decay,
    const std::vector<bool>& nesterov, const std::vector<bool>& maximize,
    const std::vector<double>& trust_coefficient, const std::vector<double>& trust_eps,
    const std::vector<bool>& trust_clip, const std::optional<at::Tensor>& grad_scale,
    const std::optional<at::Tensor>& found_inf, bool first_step,
    const std::optional<at::Tensor>& first_step_pending) {
  RECORD_FUNCTION("torch_bigbatch::sgd_step_", std::vector<c10::IValue>());  // as the op's
  pybind11::gil_scoped_release no_gil;  // as torch.ops releases it
  sgd_step_(params, grads, momentum_buffers, group_of_tensor, lr, to_list(lr_tensor), momentum,
            momentum_scale, dampening, weight_decay, to_list(nesterov), to_list(maximize),
            trust_coefficient, trust_eps, to_list(trust_clip), grad_scale, found_inf, first_step,
            first_step_pending);
}

}  // namespace

void bind_sgd(pybind11::module& m) {
  namespace py = pybind11;
  m.def("sgd_step_", &sgd_step_from_python, "torch.ops.torch_bigbatch.sgd_step_, undispatched",
        py::arg("params"), py::arg("grads"), py::arg("momentum_buffers"),
        py::arg("group_of_tensor"), py::kw_only(), py::arg("lr"), py::arg("lr_tensor"),
        py::arg("momentum"), py::arg("momentum_scale"), py::arg("dampening"),
        py::arg("weight_decay"), py::arg("nesterov"), py::arg("maximize"),
        py::arg("trust_coefficient"), py::arg("trust_eps"), py::arg("trust_clip"),
        py::arg("grad_scale"), py::arg("found_inf"), py::arg("first_step"),
        py::arg("first_step_pending"));
}

}  // namespace torch_bigbatch::optim
