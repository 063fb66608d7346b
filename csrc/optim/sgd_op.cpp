#include "sgd_op.h"

#include "common/element_type.h"

#include <torch/library.h>

namespace torch_bigbatch::optim {
namespace {

constexpr const char* kOp = "torch_bigbatch::sgd_step_: ";

// A one-element float32 tensor on `device`, as a pointer the kernel reads, or null.
const float* scalar_pointer(const std::optional<at::Tensor>& t, const at::Device& device,
                            const char* name) {
  if (!t.has_value() || !t->defined()) return nullptr;
  TORCH_CHECK(t->numel() == 1 && t->scalar_type() == at::kFloat && t->device() == device,
              kOp, name, " must be a one-element float32 tensor on ",
              device, ", got ", t->scalar_type(), " of ", t->numel(), " elements on ", t->device());
  return t->data_ptr<float>();
}

// A gradient or buffer must match its parameter in all but its memory layout.
void check_like_param(const at::Tensor& t, const at::Tensor& param, const char* name, size_t i) {
  TORCH_CHECK(t.layout() == at::kStrided, kOp, name, "[", i, "] is ", t.layout(),
              "; sparse gradients are not supported");
  TORCH_CHECK(t.scalar_type() == param.scalar_type() && t.device() == param.device() &&
                  t.sizes() == param.sizes(),
              kOp, name, "[", i, "] (", t.scalar_type(), " ", t.sizes(), " on ", t.device(),
              ") does not match params[", i, "] (", param.scalar_type(), " ", param.sizes(),
              " on ", param.device(), ")");
}

}  // namespace

// The op: every argument checked before any tensor is touched.
void sgd_step_(at::TensorList params, at::TensorList grads, at::TensorList momentum_buffers,
               at::IntArrayRef group_of_tensor, at::ArrayRef<double> lr,
               const c10::List<std::optional<at::Tensor>>& lr_tensor, at::ArrayRef<double> momentum,
               at::ArrayRef<double> momentum_scale, at::ArrayRef<double> dampening,
               at::ArrayRef<double> weight_decay, const c10::List<bool>& nesterov,
               const c10::List<bool>& maximize, at::ArrayRef<double> trust_coefficient,
               at::ArrayRef<double> trust_eps, const c10::List<bool>& trust_clip,
               const std::optional<at::Tensor>& grad_scale,
               const std::optional<at::Tensor>& found_inf, bool first_step,
               const std::optional<at::Tensor>& first_step_pending) {
  if (params.empty()) return;
  const size_t n = params.size();
  const bool has_buffers = !momentum_buffers.empty();
  TORCH_CHECK(grads.size() == n && group_of_tensor.size() == n &&
                  (!has_buffers || momentum_buffers.size() == n),
              kOp, "params, grads, group_of_tensor and momentum_buffers (unless empty) must have ",
              "the same length, got ", n, ", ", grads.size(), ", ", group_of_tensor.size(),
              " and ", momentum_buffers.size());
  TORCH_CHECK(has_buffers || !first_step, kOp, "first_step needs momentum_buffers");
  const size_t n_groups = lr.size();
  for (size_t size : {lr_tensor.size(), momentum.size(), momentum_scale.size(), dampening.size(),
                      weight_decay.size(), nesterov.size(), maximize.size(),
                      trust_coefficient.size(), trust_eps.size(), trust_clip.size()})
    TORCH_CHECK(size == n_groups, kOp, "every per-group list must have ", n_groups,
                " entries (one per group), got one with ", size);

  const at::Device device = params[0].device();
  SgdStep step;
  step.dtype =
      element_type(params[0], /*accept_double=*/false, "torch_bigbatch::sgd_step_: parameters");
  step.buffer_mode = !has_buffers ? BufferMode::None
                     : first_step ? BufferMode::First
                                  : BufferMode::Update;
  step.grad_scale = scalar_pointer(grad_scale, device, "grad_scale");
  step.found_inf = scalar_pointer(found_inf, device, "found_inf");
  step.first_step_pending = scalar_pointer(first_step_pending, device, "first_step_pending");

  for (size_t g = 0; g < n_groups; ++g) {
    SgdGroup group;
    group.lr = static_cast<float>(lr[g]);
    group.lr_ptr = scalar_pointer(lr_tensor.get(g), device, "lr_tensor");
    group.momentum = static_cast<float>(momentum[g]);
    group.momentum_scale = static_cast<float>(momentum_scale[g]);
    group.dampening = static_cast<float>(dampening[g]);
    group.weight_decay = static_cast<float>(weight_decay[g]);
    group.nesterov = nesterov.get(g);
    group.maximize = maximize.get(g);
    group.trust_coefficient = static_cast<float>(trust_coefficient[g]);
    group.trust_eps = static_cast<float>(trust_eps[g]);
    group.trust_clip = trust_clip.get(g);
    step.groups.push_back(group);
  }

  // Copies in the parameter's layout that the raw pointers point into: gradients laid out
  // otherwise (rare: autograd lays them out like the parameters) and buffers laid out otherwise
  // (a checkpoint's channels-last buffers in a contiguous model), which are written back.
  std::vector<at::Tensor> copies;
  std::vector<std::pair<at::Tensor, at::Tensor>> write_back;  // (buffer, its copy)
  auto like_param = [&](const at::Tensor& t, const at::Tensor& p) -> const at::Tensor& {
    if (t.strides() == p.strides()) return t;
    copies.push_back(at::empty_like(p).copy_(t));
    return copies.back();
  };
  copies.reserve(2 * n);  // like_param's references must stay valid
  for (size_t i = 0; i < n; ++i) {
    const at::Tensor& p = params[i];
    TORCH_CHECK(p.device() == device && p.scalar_type() == params[0].scalar_type(), kOp,
                "all params must share one device and dtype; params[0] is ",
                params[0].scalar_type(), " on ", device, ", params[", i, "] is ", p.scalar_type(),
                " on ", p.device());
    TORCH_CHECK(p.is_non_overlapping_and_dense(), kOp, "params[", i, "] must be dense (strides ",
                p.strides(), " for sizes ", p.sizes(), ")");
    check_like_param(grads[i], p, "grads", i);
    const at::Tensor& grad = like_param(grads[i], p);
    void* buffer = nullptr;
    if (has_buffers) {
      check_like_param(momentum_buffers[i], p, "momentum_buffers", i);
      const at::Tensor& b = like_param(momentum_buffers[i], p);
      if (!b.is_same(momentum_buffers[i])) write_back.emplace_back(momentum_buffers[i], b);
      buffer = b.data_ptr();
    }
    TORCH_CHECK(group_of_tensor[i] >= 0 && static_cast<size_t>(group_of_tensor[i]) < n_groups,
                kOp, "group_of_tensor[", i, "] = ", group_of_tensor[i],
                " is not a group index below ", n_groups);
    step.tensors.push_back({p.data_ptr(), grad.data_ptr(), buffer, p.numel(),
                            static_cast<int>(group_of_tensor[i])});
  }
  // As torch's in-place ops do (its ADInplaceOrView kernels): a backward through a tensor saved
  // before this step then raises instead of using the updated values. Before the launch: a
  // tensor that may not be updated in place (an inference tensor) fails with nothing changed.
  for (const at::TensorList tensors : {params, momentum_buffers})
    for (const at::Tensor& tensor : tensors) tensor.unsafeGetTensorImpl()->bump_version();
  SgdLaunchers::get(device.type(), "torch_bigbatch::sgd_step_")(step, params);
  for (auto& [buffer, copy] : write_back) buffer.copy_(copy);
}

TORCH_LIBRARY_IMPL(torch_bigbatch, CPU, m) { m.impl("sgd_step_", &sgd_step_); }
TORCH_LIBRARY_IMPL(torch_bigbatch, CUDA, m) { m.impl("sgd_step_", &sgd_step_); }

}  // namespace torch_bigbatch::optim
