#include "batchnorm/local_bn_op.h"

#include "common/element_type.h"

#include <ATen/OpMathType.h>
#include <torch/library.h>

namespace torch_bigbatch::batchnorm {
namespace {

constexpr const char* kName = "torch_bigbatch::local_batch_norm";
constexpr const char* kOp = "torch_bigbatch::local_batch_norm: ";

ElementType input_type(const at::Tensor& input) {
  return element_type(input, /*accept_double=*/true,
                      "torch_bigbatch::local_batch_norm: the input");
}

// The input as the kernels read it: itself when its memory is [N, C, S] (contiguous) or
// [N, S, C] (channels_last: channels innermost, then the spatial dims in order), else a
// contiguous copy (slices, transposes, steps, broadcasts). Checks what every pass needs.
std::pair<at::Tensor, BnLayout> as_layout(const at::Tensor& input, int64_t group_size) {
  TORCH_CHECK(input.layout() == at::kStrided, kOp, "the input must be a dense tensor, got ",
              input.layout());
  TORCH_CHECK(input.dim() >= 2, kOp, "the input must have at least 2 dims (N, C, ...), got ",
              input.sizes());
  input_type(input);
  BnLayout layout;
  layout.batch = input.size(0);
  layout.channels = input.size(1);
  layout.spatial = 1;
  for (int64_t d = 2; d < input.dim(); ++d) layout.spatial *= input.size(d);
  TORCH_CHECK(group_size >= 2, kOp, "group_size must be at least 2 (a group of one sample has ",
              "no variance), got ", group_size);
  TORCH_CHECK(layout.channels > 0, kOp, "the input has no channels (size ", input.sizes(), ")");
  // nn.BatchNorm's rule: statistics need two values per channel (an empty input has nothing
  // to normalize: the passes return at once, as nn.BatchNorm does).
  TORCH_CHECK(input.numel() == 0 || layout.batch * layout.spatial >= 2, kOp,
              "training needs more than 1 value per channel, got input of size ", input.sizes());
  layout.group_size = group_size;
  layout.groups = group_count(layout.batch, group_size);
  const bool rows = input.is_contiguous();
  layout.channels_last = !rows && input.movedim(1, -1).is_contiguous();
  const at::Tensor x = rows || layout.channels_last ? input : input.contiguous();
  // With one value per (sample, channel) both layouts are the same [N, C] memory: the
  // channels-last kernels, which run along the channels, suit it; the row kernels would see
  // rows of one value.
  layout.channels_last = layout.channels_last || layout.spatial == 1;
  return {x, layout};
}

// A per-channel tensor as the kernels read it: contiguous, in `dtype`, or undefined if absent.
at::Tensor per_channel(const std::optional<at::Tensor>& t, const at::Tensor& input,
                       int64_t channels, at::ScalarType dtype, const char* name) {
  if (!t.has_value() || !t->defined()) return {};
  TORCH_CHECK(t->numel() == channels && t->device() == input.device(), kOp, name, " must have ",
              channels, " elements (one per channel) on ", input.device(), ", got ", t->sizes(),
              " on ", t->device());
  return t->to(dtype).contiguous();
}

// What both passes fill alike: the layout, the input, the weight, and the scratch, in one acc
// tensor that the caller keeps until run(pass) has returned.
at::Tensor start_pass(BnPass& pass, const at::Tensor& x, const BnLayout& layout,
                      const at::Tensor& weight) {
  pass.layout = layout;
  pass.dtype = input_type(x);
  pass.input = x.data_ptr();
  pass.weight = weight.defined() ? weight.data_ptr() : nullptr;
  const int64_t samples = kSampleValues * layout.batch * layout.channels;
  const int64_t groups = layout.groups * layout.channels;
  at::Tensor scratch = at::empty({samples + 5 * groups},
                                 x.options().dtype(at::toOpMathType(x.scalar_type())));
  pass.sample_sums = scratch.data_ptr();
  pass.group_values = scratch.narrow(0, samples, 2 * groups).data_ptr();
  pass.coefficients = scratch.narrow(0, samples + 2 * groups, 3 * groups).data_ptr();
  return scratch;
}

// The ops. Forward: (output, mean, invstd, average_mean, average_var), the statistics in the
// input's accumulation type: mean and invstd [groups, C], the averages over groups [C].
std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor> local_batch_norm(
    const at::Tensor& input, const std::optional<at::Tensor>& weight,
    const std::optional<at::Tensor>& bias, int64_t group_size, double eps) {
  // As batch_norm's: with eps 0 a group's constant channel (zeros after a ReLU) gives NaN.
  TORCH_CHECK(eps > 0, "local_batch_norm: eps must be positive, got ", eps);
  auto [x, layout] = as_layout(input, group_size);
  const at::ScalarType acc = at::toOpMathType(x.scalar_type());
  const int64_t channels = layout.channels;
  const at::Tensor w = per_channel(weight, x, channels, acc, "weight");
  const at::Tensor b = per_channel(bias, x, channels, acc, "bias");

  at::Tensor output = at::empty_like(x);
  at::Tensor mean = at::empty({layout.groups, channels}, x.options().dtype(acc));
  at::Tensor invstd = at::empty_like(mean);
  at::Tensor average_mean = at::empty({channels}, mean.options());
  at::Tensor average_var = at::empty_like(average_mean);
  if (x.numel() == 0) {  // no statistics (zeros): nn.BatchNorm keeps its running ones
    for (at::Tensor* t : {&mean, &invstd, &average_mean, &average_var}) t->zero_();
    return {output, mean, invstd, average_mean, average_var};
  }
  BnPass pass;
  const at::Tensor scratch = start_pass(pass, x, layout, w);
  pass.result = output.data_ptr();
  pass.bias = b.defined() ? b.data_ptr() : nullptr;
  pass.mean = mean.data_ptr();
  pass.invstd = invstd.data_ptr();
  pass.average_mean = average_mean.data_ptr();
  pass.average_var = average_var.data_ptr();
  pass.eps = eps;
  BnLaunchers::get(x.device().type(), kName)(pass, x);
  return {output, mean, invstd, average_mean, average_var};
}

// Backward: (grad_input, grad_weight, grad_bias), the last two [C] in mean's dtype.
std::tuple<at::Tensor, at::Tensor, at::Tensor> local_batch_norm_backward(
    const at::Tensor& grad_output, const at::Tensor& input, const std::optional<at::Tensor>& weight,
    const at::Tensor& mean, const at::Tensor& invstd, int64_t group_size) {
  auto [x, layout] = as_layout(input, group_size);
  const at::ScalarType acc = at::toOpMathType(x.scalar_type());
  TORCH_CHECK(grad_output.sizes() == x.sizes() && grad_output.scalar_type() == x.scalar_type() &&
                  grad_output.device() == x.device(),
              kOp, "grad_output (", grad_output.scalar_type(), " ", grad_output.sizes(), " on ",
              grad_output.device(), ") must match the input (", x.scalar_type(), " ", x.sizes(),
              " on ", x.device(), ")");
  for (const at::Tensor* t : {&mean, &invstd})
    TORCH_CHECK(t->sizes() == at::IntArrayRef({layout.groups, layout.channels}) &&
                    t->scalar_type() == acc && t->device() == x.device() && t->is_contiguous(),
                kOp, "mean and invstd must be contiguous ", acc, " tensors of size [",
                layout.groups, ", ", layout.channels, "] on ", x.device(), " (the forward's), got ",
                t->scalar_type(), " ", t->sizes(), " on ", t->device());
  // The kernels walk dy in x's memory order.
  const at::Tensor dy =
      grad_output.strides() == x.strides() ? grad_output : at::empty_like(x).copy_(grad_output);
  const at::Tensor w = per_channel(weight, x, layout.channels, acc, "weight");

  at::Tensor grad_input = at::empty_like(x);
  at::Tensor grad_weight = at::empty({layout.channels}, x.options().dtype(acc));
  at::Tensor grad_bias = at::empty_like(grad_weight);
  if (x.numel() == 0) return {grad_input, grad_weight.zero_(), grad_bias.zero_()};
  BnPass pass;
  const at::Tensor scratch = start_pass(pass, x, layout, w);
  pass.backward = true;
  pass.grad_output = dy.data_ptr();
  pass.result = grad_input.data_ptr();
  pass.mean = mean.data_ptr();
  pass.invstd = invstd.data_ptr();
  pass.grad_weight = grad_weight.data_ptr();
  pass.grad_bias = grad_bias.data_ptr();
  BnLaunchers::get(x.device().type(), kName)(pass, x);
  return {grad_input, grad_weight, grad_bias};
}

}  // namespace

TORCH_LIBRARY_IMPL(torch_bigbatch, CPU, m) {
  m.impl("local_batch_norm", &local_batch_norm);
  m.impl("local_batch_norm_backward", &local_batch_norm_backward);
}
TORCH_LIBRARY_IMPL(torch_bigbatch, CUDA, m) {
  m.impl("local_batch_norm", &local_batch_norm);
  m.impl("local_batch_norm_backward", &local_batch_norm_backward);
}

}  // namespace torch_bigbatch::batchnorm
