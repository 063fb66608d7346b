#include "optim/sgd_python.h"

#include "optim/sgd_op.h"

#include <torch/extension.h>

#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/record_function.h>

#include <algorithm>

namespace torch_bigbatch::optim {
namespace {

template <typename T>
c10::List<T> to_list(const std::vector<T>& values) {
  c10::List<T> list;
  list.reserve(values.size());
  for (const T& value : values) list.push_back(value);
  return list;
}

// A tensor the op's glue takes as it is: dense, on the CPU or a GPU; not a zero tensor (no
// memory: torch.sgn's gradient is one), a lazily negated or conjugated view, a functorch
// wrapper or a tensor with a __torch_dispatch__, which the dispatcher's fallbacks resolve first.
bool plain(const at::Tensor& t) {
  static const c10::DispatchKeySet kPlain(
      {c10::DispatchKey::CPU, c10::DispatchKey::CUDA, c10::DispatchKey::ADInplaceOrView,
       c10::DispatchKey::AutogradCPU, c10::DispatchKey::AutogradCUDA,
       c10::DispatchKey::AutocastCPU, c10::DispatchKey::AutocastCUDA});
  return kPlain.isSupersetOf(t.key_set());
}

bool all_plain(const std::vector<at::Tensor>& tensors) {
  return std::all_of(tensors.begin(), tensors.end(), plain);
}

bool plain_or_none(const std::optional<at::Tensor>& t) {
  return !t.has_value() || !t->defined() || plain(*t);
}

// Why by hand: a call through torch.ops turns each tensor into an IValue and back, about 0.15 us
// a tensor on a 2-core Xeon, 70 us for ResNet-50's step (161 parameters, gradients and buffers;
// a no-op op of the same three lists), where pybind11 takes 30 and the step's host side is
// what bounds it on a fast GPU. The optimizer calls the op instead wherever Python must see it
// (torch.compile, dispatch and function modes, types with a __torch_function__;
// torch_bigbatch/optim/sgd.py); tensors that are not plain go through the dispatcher here.
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
  pybind11::gil_scoped_release no_gil;  // as torch.ops releases it
  const bool direct =
      all_plain(params) && all_plain(grads) && all_plain(momentum_buffers) &&
      std::all_of(lr_tensor.begin(), lr_tensor.end(), plain_or_none) &&
      plain_or_none(grad_scale) && plain_or_none(found_inf) && plain_or_none(first_step_pending);
  if (!direct) {
    static const auto op = c10::Dispatcher::singleton()
                               .findSchemaOrThrow("torch_bigbatch::sgd_step_", "")
                               .typed<decltype(sgd_step_)>();
    return op.call(params, grads, momentum_buffers, group_of_tensor, lr, to_list(lr_tensor),
                   momentum, momentum_scale, dampening, weight_decay, to_list(nesterov),
                   to_list(maximize), trust_coefficient, trust_eps, to_list(trust_clip),
                   grad_scale, found_inf, first_step, first_step_pending);
  }
  // As the dispatcher records the op (the tensor lists as its inputs, built only when asked).
  RECORD_FUNCTION("torch_bigbatch::sgd_step_",
                  std::vector<c10::IValue>({params, grads, momentum_buffers}));
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
