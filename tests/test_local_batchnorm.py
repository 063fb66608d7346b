"""torch_bigbatch.nn.LocalBatchNorm against nn.functional.batch_norm applied group by group
(the trusted oracle, in float64), and against nn.BatchNorm where they must agree."""

import copy
import subprocess
import sys
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import torch_bigbatch as bb
from conftest import DEVICES, assert_relative_close, process_environment

LOCAL_OF = {2: bb.nn.LocalBatchNorm1d, 3: bb.nn.LocalBatchNorm1d, 4: bb.nn.LocalBatchNorm2d,
            5: bb.nn.LocalBatchNorm3d}
NATIVE_OF = {2: nn.BatchNorm1d, 3: nn.BatchNorm1d, 4: nn.BatchNorm2d, 5: nn.BatchNorm3d}


def group_bounds(batch, group_size):
    """Groups of group_size consecutive samples; a tail of one sample joins the group before."""
    size = batch if group_size is None else group_size
    starts = list(range(0, batch, size))
    if len(starts) > 1 and batch - starts[-1] == 1:
        starts.pop()
    return list(zip(starts, starts[1:] + [batch]))


def reference(x, weight, bias, group_size, eps=1e-5, dtype=torch.float64):
    """Output, and the groups' average mean and unbiased variance, computed in `dtype`."""
    x = x.to(dtype)
    weight, bias = (None if t is None else t.to(dtype) for t in (weight, bias))
    dims = [0] + list(range(2, x.dim()))
    groups = [x[a:b] for a, b in group_bounds(x.shape[0], group_size)]
    output = torch.cat([F.batch_norm(g, None, None, weight, bias, True, 0.0, eps) for g in groups])
    mean = torch.stack([g.mean(dims) for g in groups]).mean(0)
    var = torch.stack([g.var(dims, unbiased=True) for g in groups]).mean(0)
    return output, mean, var


def reference_gradients(x, weight, bias, dy, group_size, dtype=torch.float64):
    """Output and (grad_input, grad_weight, grad_bias) of the reference in `dtype`."""
    leaves = [t.detach().cpu().to(dtype).requires_grad_() for t in (x, weight, bias)]
    output, _, _ = reference(*leaves, group_size, dtype=dtype)
    output.backward(dy.cpu().to(dtype))
    return output.detach(), [t.grad for t in leaves]


def memory_format(x, channels_last):
    if not channels_last or x.dim() not in (4, 5):
        return x.contiguous()
    return x.to(memory_format=torch.channels_last if x.dim() == 4 else torch.channels_last_3d)


def check_against_reference(device, shape, group_size, dtype, channels_last, param_dtype=None,
                            momentum=0.1, steps=2, tolerance=None):
    """Trains a LocalBatchNorm for `steps` steps on random batches (mean 3, spread 2) and compares
    outputs, the three gradients and the running statistics with the reference."""
    param_dtype = param_dtype or (dtype if dtype == torch.float64 else torch.float32)
    low_precision = dtype in (torch.float16, torch.bfloat16)
    tolerance = tolerance or (2e-2 if low_precision else 1e-5 if dtype == torch.float32 else 1e-10)
    generator = torch.Generator().manual_seed(0)
    channels = shape[1]
    layer = LOCAL_OF[len(shape)](channels, group_size=group_size, momentum=momentum)
    with torch.no_grad():
        layer.weight.copy_(torch.rand(channels, generator=generator) + 0.5)
        layer.bias.copy_(torch.randn(channels, generator=generator))
    layer = layer.to(device, param_dtype)
    expected_mean = torch.zeros(channels, dtype=torch.float64)
    expected_var = torch.ones(channels, dtype=torch.float64)
    for step in range(steps):
        x = (torch.randn(shape, generator=generator, dtype=torch.float64) * 2 + 3).to(dtype)
        dy = torch.randn(shape, generator=generator, dtype=torch.float64).to(dtype)
        x = memory_format(x.to(device), channels_last).requires_grad_()
        y = layer(x)
        y.backward(memory_format(dy.to(device), channels_last))

        y_ref, grads_ref = reference_gradients(x, layer.weight, layer.bias, dy, group_size)
        _, mean, var = reference(x.detach().cpu(), None, None, group_size)
        # F.batch_norm's own error in the input's dtype bounds what any kernel can reach there
        # (it nears 1e-5 in float32 on groups of two samples).
        y_low, grads_low = reference_gradients(x, layer.weight, layer.bias, dy, group_size, dtype)
        factor = 1 / (step + 1) if momentum is None else momentum
        expected_mean = (1 - factor) * expected_mean + factor * mean.detach()
        expected_var = (1 - factor) * expected_var + factor * var.detach()

        assert y.dtype == dtype and x.grad.dtype == dtype
        assert layer.weight.grad.dtype == param_dtype
        if channels_last:  # the output keeps the input's memory format
            assert y.stride() == x.stride() and x.grad.stride() == x.stride()
        for actual, expected, low, what in [
                (y, y_ref, y_low, "output"), (x.grad, grads_ref[0], grads_low[0], "grad_input"),
                (layer.weight.grad, grads_ref[1], grads_low[1], "grad_weight"),
                (layer.bias.grad, grads_ref[2], grads_low[2], "grad_bias")]:
            scale = expected.abs().max()
            native_error = ((low.double() - expected).abs().max() / scale).item()
            assert_relative_close(actual.cpu(), expected, max(tolerance, 2 * native_error), what)
        stats_tolerance = tolerance if param_dtype != torch.bfloat16 else 1e-2
        assert_relative_close(layer.running_mean.cpu(), expected_mean, stats_tolerance, "running_mean")
        assert_relative_close(layer.running_var.cpu(), expected_var, stats_tolerance, "running_var")
        layer.zero_grad()
    assert layer.num_batches_tracked.item() == steps


# Batch sizes that group_size 4 divides, that leave a tail of 1 (joins the last group) and a tail
# of 2 or 3 (a group of its own); spatial sizes with and without vector tails.
SHAPES_AND_GROUPS = [
    ((12, 5, 4, 4), 4), ((13, 5, 3, 5), 4), ((14, 6, 7, 7), 4), ((11, 3, 9, 2), 4),
    ((40, 70, 6, 6), 32), ((9, 33, 2, 3), None), ((64, 16, 1, 1), 32),
]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("shape,group_size", SHAPES_AND_GROUPS, ids=str)
@pytest.mark.parametrize("channels_last", [False, True], ids=["nchw", "channels_last"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_matches_batch_norm_group_by_group(device, shape, group_size, channels_last, dtype):
    check_against_reference(device, shape, group_size, dtype, channels_last)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("shape", [(10, 6), (10, 6, 17), (9, 4, 3, 5, 6)], ids=str)
@pytest.mark.parametrize("channels_last", [False, True], ids=["contiguous", "channels_last"])
def test_1d_and_3d(device, shape, channels_last):
    check_against_reference(device, shape, 4, torch.float32, channels_last)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype,param_dtype", [(torch.float16, torch.float32),
                                               (torch.bfloat16, torch.bfloat16),
                                               (torch.float64, torch.float64)], ids=str)
def test_dtypes(device, dtype, param_dtype):
    """fp16 input with fp32 parameters (as under autocast); a bf16 model, whose running
    statistics are bf16; fp64 throughout."""
    check_against_reference(device, (14, 6, 5, 5), 4, dtype, True, param_dtype=param_dtype)


@pytest.mark.parametrize("device", DEVICES)
def test_cumulative_moving_average(device):
    """momentum=None: the running statistics are the plain average over steps, as nn.BatchNorm."""
    check_against_reference(device, (12, 5, 4, 4), 4, torch.float32, False, momentum=None, steps=3)


@pytest.mark.parametrize("momentum", [None, 0.1])
@pytest.mark.parametrize("use_reentrant", [False, True])
@pytest.mark.parametrize("after", ["nothing", "relu", "conv"])
def test_checkpointed_steps_move_the_running_statistics_as_plain_ones(momentum, use_reentrant,
                                                                       after):
    """Under torch.utils.checkpoint the recomputation in backward neither moves the running
    statistics nor counts the batch again, wherever the layer sits in the segment. Before: with
    the BatchNorm last and use_reentrant=False the recomputation stopped inside the op (right);
    with a layer after it that saves tensors (conv-bn-relu), or use_reentrant=True, the
    statistics moved twice a step and the batch was counted twice (momentum=None's average
    then weighed later batches by 1/7 instead of 1/4)."""
    torch.manual_seed(0)
    layers = [torch.nn.Conv2d(3, 4, 1), bb.nn.LocalBatchNorm2d(4, group_size=4,
                                                                momentum=momentum)]
    layers += {"nothing": [], "relu": [torch.nn.ReLU()], "conv": [torch.nn.Conv2d(4, 4, 1)]}[after]
    plain = torch.nn.Sequential(*layers)
    checkpointed = copy.deepcopy(plain)
    for step in range(4):
        x = (torch.randn(8, 3, 4, 4) * (step + 1) + step).requires_grad_()
        plain(x).sum().backward()
        torch.utils.checkpoint.checkpoint(checkpointed, x, use_reentrant=use_reentrant) \
            .sum().backward()
    assert checkpointed[1].num_batches_tracked.item() == plain[1].num_batches_tracked.item() == 4
    torch.testing.assert_close(checkpointed[1].running_mean, plain[1].running_mean)
    torch.testing.assert_close(checkpointed[1].running_var, plain[1].running_var)
    for mine, expected in zip(checkpointed.parameters(), plain.parameters()):
        torch.testing.assert_close(mine.grad, expected.grad)


@pytest.mark.parametrize("channels_last", [False, True], ids=["nchw", "channels_last"])
@pytest.mark.parametrize("shape,group_size", [((6, 3, 2, 3), 4), ((7, 2, 3, 1), 3)], ids=str)
def test_gradcheck(shape, group_size, channels_last):
    """Analytical gradients against finite differences in float64 (groups of 4 + 2, 3 + 4)."""
    generator = torch.Generator().manual_seed(0)
    x = memory_format(torch.randn(shape, generator=generator, dtype=torch.float64),
                      channels_last).requires_grad_()
    weight = torch.rand(shape[1], generator=generator, dtype=torch.float64).add_(0.5).requires_grad_()
    bias = torch.randn(shape[1], generator=generator, dtype=torch.float64).requires_grad_()

    def function(x, weight, bias):
        return bb.nn.local_batch_norm(x, None, None, weight, bias, training=True,
                                      group_size=group_size)

    assert torch.autograd.gradcheck(function, (x, weight, bias))


def test_long_rows_keep_float_precision():
    """NCHW rows of 2^22 values: the sums are two-level, as channels-last's (one running sum
    per lane lost precision with the row's length: relative error 1.2e-5 here)."""
    generator = torch.Generator().manual_seed(0)
    x64 = torch.randn(2, 1, 1 << 22, generator=generator, dtype=torch.float64) * 3 + 1
    dy = torch.randn(x64.shape, generator=generator, dtype=torch.float64)
    x = x64.float().requires_grad_()
    bb.nn.local_batch_norm(x, None, None, training=True, group_size=2).backward(dy.float())
    _, _, invstd, _, _ = torch.ops.torch_bigbatch.local_batch_norm(x.detach(), None, None, 2,
                                                                   1e-5)
    reference = x.detach().double().requires_grad_()
    F.batch_norm(reference, None, None, training=True).backward(dy)
    expected_invstd = (reference.detach().var(dim=(0, 2), unbiased=False) + 1e-5).rsqrt()
    assert ((invstd.double() - expected_invstd).abs() / expected_invstd).max() < 1e-6
    assert (x.grad.double() - reference.grad).norm() / reference.grad.norm() < 1e-6


def test_eps_must_be_positive_in_training():
    """As F.batch_norm: with eps 0 a group's constant channel (zeros after a ReLU) gave NaN."""
    x = torch.randn(8, 2, 3, 3)
    x[:, 1] = 0
    for eps in (0.0, -1e-5):
        with pytest.raises(ValueError, match="eps must be positive during training"):
            bb.nn.LocalBatchNorm2d(2, group_size=4, eps=eps)(x)
        with pytest.raises(RuntimeError, match="eps must be positive"):
            torch.ops.torch_bigbatch.local_batch_norm(x, None, None, 4, eps)
    layer = bb.nn.LocalBatchNorm2d(2, group_size=4, eps=0.0).eval()
    assert torch.equal(layer(x), F.batch_norm(x, layer.running_mean, layer.running_var,
                                               eps=0.0))  # eval: F.batch_norm's rule, as before


def test_double_backward_raises_instead_of_returning_zeros():
    """A gradient of the gradient (a gradient penalty) is refused when it reaches the op, as
    torch's once_differentiable functions do; the first gradient with create_graph still runs."""
    x = torch.randn(4, 2, 3, 3, dtype=torch.float64, requires_grad=True)
    layer = bb.nn.LocalBatchNorm2d(2, group_size=4).double()
    reference = nn.BatchNorm2d(2).double()
    first, = torch.autograd.grad(layer(x).pow(3).sum(), x, create_graph=True)
    expected, = torch.autograd.grad(reference(x).pow(3).sum(), x)
    torch.testing.assert_close(first, expected)  # one group of the whole batch: BatchNorm2d
    with pytest.raises(RuntimeError, match="no double backward"):
        torch.autograd.grad(first.pow(2).sum(), x)


def test_forward_mode_raises_instead_of_a_zero_tangent():
    """torch.func.jvp through a custom op with a backward formula only gave a zero tangent; in
    evaluation (F.batch_norm) forward mode works as torch's."""
    x, tangent = torch.randn(4, 3, 2, 2, dtype=torch.float64), torch.randn(4, 3, 2, 2,
                                                                           dtype=torch.float64)
    layer = bb.nn.LocalBatchNorm2d(3, group_size=None, track_running_stats=False).double()
    for transform in (lambda: torch.func.jvp(layer, (x,), (tangent,)),
                      lambda: torch.func.jacfwd(layer)(x),
                      lambda: torch.func.jvp(torch.func.vmap(layer), (x[None],), (tangent[None],))):
        with pytest.raises(RuntimeError, match="no forward-mode derivative"):
            transform()
    layer = bb.nn.LocalBatchNorm2d(3).double().eval()
    reference = nn.BatchNorm2d(3).double().eval()
    torch.testing.assert_close(torch.func.jvp(layer, (x,), (tangent,))[1],
                               torch.func.jvp(reference, (x,), (tangent,))[1])


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("momentum", [0.1, None])
@pytest.mark.parametrize("channels_last", [False, True], ids=["nchw", "channels_last"])
def test_whole_batch_equals_batchnorm2d(device, momentum, channels_last):
    """group_size=None is plain per-process BatchNorm: nn.BatchNorm2d in training."""
    torch.manual_seed(0)
    native = nn.BatchNorm2d(7, momentum=momentum).to(device)
    with torch.no_grad():
        native.weight.uniform_(0.5, 1.5)
        native.bias.normal_()
    local = bb.nn.LocalBatchNorm2d(7, group_size=None, momentum=momentum).to(device)
    local.load_state_dict(native.state_dict())
    for _ in range(3):
        x = memory_format(torch.randn(10, 7, 5, 3, device=device) * 2 + 1, channels_last)
        dy = torch.randn_like(x)
        x_native, x_local = x.clone().requires_grad_(), x.clone().requires_grad_()
        y_native, y_local = native(x_native), local(x_local)
        y_native.backward(dy)
        y_local.backward(dy)
        assert_relative_close(y_local, y_native, 1e-5, "output")
        assert_relative_close(x_local.grad, x_native.grad, 1e-5, "grad_input")
        assert_relative_close(local.weight.grad, native.weight.grad, 1e-5, "grad_weight")
        assert_relative_close(local.bias.grad, native.bias.grad, 1e-5, "grad_bias")
        for name in ("running_mean", "running_var"):
            assert_relative_close(getattr(local, name), getattr(native, name), 1e-5, name)
        assert torch.equal(local.num_batches_tracked, native.num_batches_tracked)


@pytest.mark.parametrize("device", DEVICES)
def test_eval_equals_batchnorm2d(device):
    """Evaluation normalizes with the running statistics exactly as nn.BatchNorm2d, even for a
    batch of one sample."""
    local = bb.nn.LocalBatchNorm2d(4, group_size=2).to(device)
    for _ in range(3):
        local(torch.randn(8, 4, 3, 3, device=device) * 3 + 2)
    native = nn.BatchNorm2d(4).to(device)
    native.load_state_dict(local.state_dict())
    local.eval()
    native.eval()
    for batch in (1, 5):
        x = torch.randn(batch, 4, 3, 3, device=device)
        assert torch.equal(local(x), native(x))


def test_state_dict_keys_are_batchnorms():
    for local, native in [(bb.nn.LocalBatchNorm1d(3), nn.BatchNorm1d(3)),
                          (bb.nn.LocalBatchNorm2d(3), nn.BatchNorm2d(3)),
                          (bb.nn.LocalBatchNorm3d(3, affine=False), nn.BatchNorm3d(3, affine=False)),
                          (bb.nn.LocalBatchNorm(3, track_running_stats=False),
                           nn.SyncBatchNorm(3, track_running_stats=False))]:
        assert list(local.state_dict()) == list(native.state_dict())
        local.load_state_dict(native.state_dict())  # strict


@pytest.mark.parametrize("device", DEVICES)
def test_without_affine_or_running_stats(device):
    """affine=False has no weight or bias; track_running_stats=False normalizes by the groups'
    statistics in eval too, as nn.BatchNorm does by the batch's."""
    x = torch.randn(8, 3, 4, 4, device=device, requires_grad=True)
    layer = bb.nn.LocalBatchNorm2d(3, group_size=4, affine=False, track_running_stats=False)
    layer.to(device)
    expected, _, _ = reference(x.detach().cpu(), None, None, 4)
    for mode in (layer.train, layer.eval):
        mode()
        y = layer(x)
        assert_relative_close(y.cpu(), expected, 1e-5, "output")
    y.sum().backward()
    assert x.grad.abs().max() < 1e-4  # the sum of a normalized group does not depend on x


class Block(nn.Module):
    """A torchvision-style residual block: the last BN of its main branch, then downsample."""

    def __init__(self, channels, out_channels, norm=nn.BatchNorm2d):
        super().__init__()
        self.conv1 = nn.Conv2d(channels, out_channels, 3, padding=1, bias=False)
        self.bn1 = norm(out_channels)
        self.conv2 = nn.Conv2d(out_channels, out_channels, 3, padding=1, bias=False)
        self.bn2 = norm(out_channels)
        self.downsample = None if channels == out_channels else nn.Sequential(
            nn.Conv2d(channels, out_channels, 1, bias=False), nn.BatchNorm2d(out_channels))

    def forward(self, x):
        identity = x if self.downsample is None else self.downsample(x)
        return torch.relu(self.bn2(self.conv2(torch.relu(self.bn1(self.conv1(x))))) + identity)


def small_resnet():
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(),
                         Block(8, 8), Block(8, 16, norm=nn.SyncBatchNorm),
                         nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(16, 6),
                         nn.BatchNorm1d(6))


def test_convert_keeps_eval_outputs_and_parameters():
    model = small_resnet()
    for _ in range(3):  # give the running statistics non-default values
        model(torch.randn(16, 3, 8, 8))
    model.eval()
    x = torch.randn(5, 3, 8, 8)
    expected = model(x)
    parameters = list(model.parameters())
    norms = [m for m in model.modules() if isinstance(m, nn.modules.batchnorm._BatchNorm)]

    converted = bb.nn.convert_local_batchnorm(model, group_size=8)
    assert converted is model
    assert torch.equal(converted(x), expected)
    assert all(a is b for a, b in zip(converted.parameters(), parameters))
    local = [m for m in converted.modules() if isinstance(m, nn.modules.batchnorm._BatchNorm)]
    assert [type(m) for m in local] == [
        bb.nn.LocalBatchNorm2d, bb.nn.LocalBatchNorm2d, bb.nn.LocalBatchNorm2d,
        bb.nn.LocalBatchNorm, bb.nn.LocalBatchNorm, bb.nn.LocalBatchNorm2d, bb.nn.LocalBatchNorm1d]
    for old, new in zip(norms, local):
        assert new.group_size == 8 and not new.training
        assert (new.eps, new.momentum) == (old.eps, old.momentum)
        assert new.running_mean is old.running_mean and new.weight is old.weight
    converted.train()
    converted(torch.randn(16, 3, 8, 8)).sum().backward()  # trains, in groups of 8


def test_convert_a_batchnorm_itself():
    native = nn.BatchNorm3d(4, eps=1e-3, momentum=0.2, affine=False)
    local = bb.nn.convert_local_batchnorm(native, group_size=None)
    assert type(local) is bb.nn.LocalBatchNorm3d and local.group_size is None
    assert (local.eps, local.momentum, local.weight) == (1e-3, 0.2, None)


def test_convert_a_batchnorm_used_twice_keeps_one_module_in_both_places():
    shared = nn.BatchNorm2d(3)
    twice_in_one_parent = nn.Sequential(nn.Conv2d(3, 3, 1), shared, nn.ReLU(), shared)
    bb.nn.convert_local_batchnorm(twice_in_one_parent, group_size=4)
    assert type(twice_in_one_parent[1]) is bb.nn.LocalBatchNorm2d
    assert twice_in_one_parent[3] is twice_in_one_parent[1]  # was a plain BatchNorm2d

    other = nn.BatchNorm2d(3)
    in_two_parents = nn.Sequential(nn.Sequential(other), nn.Sequential(other))
    bb.nn.convert_local_batchnorm(in_two_parents, group_size=4)
    assert type(in_two_parents[0][0]) is bb.nn.LocalBatchNorm2d
    assert in_two_parents[1][0] is in_two_parents[0][0]  # was two modules


def test_convert_sets_the_group_size_of_layers_already_local():
    model = nn.Sequential(bb.nn.LocalBatchNorm2d(3, group_size=32))
    bb.nn.convert_local_batchnorm(model, group_size=4)
    assert model[0].group_size == 4  # was left at 32
    with pytest.raises(ValueError, match="group_size"):
        bb.nn.convert_local_batchnorm(model, group_size=1)


def test_convert_refuses_a_lazy_batchnorm_not_yet_initialized():
    model = nn.Sequential(nn.BatchNorm2d(3), nn.Conv2d(3, 3, 1), nn.LazyBatchNorm2d())
    with pytest.raises(ValueError, match="LazyBatchNorm2d has not seen an input"):
        bb.nn.convert_local_batchnorm(model)  # it became a plain BatchNorm2d at its first forward
    assert type(model[0]) is nn.BatchNorm2d  # nothing converted (the first one was)
    model(torch.randn(4, 3, 2, 2))
    bb.nn.convert_local_batchnorm(model, group_size=2)
    assert type(model[0]) is type(model[2]) is bb.nn.LocalBatchNorm2d


def test_convert_refuses_a_parametrized_batchnorm():
    """A parametrized weight is computed, no Parameter the copy can take over: it was a bare
    TypeError ("cannot assign 'torch.FloatTensor' as parameter 'weight'")."""
    class Positive(nn.Module):
        def forward(self, weight):
            return weight.abs()

    model = nn.Sequential(nn.BatchNorm2d(3), nn.Conv2d(3, 3, 1), nn.BatchNorm2d(3))
    torch.nn.utils.parametrize.register_parametrization(model[2], "weight", Positive())
    with pytest.raises(ValueError, match="BatchNorm2d has parametrized weight; convert it before"):
        bb.nn.convert_local_batchnorm(model)
    # left as it was: the BatchNorm before the refused one too (it was converted)
    assert [type(layer) for layer in model] == [nn.BatchNorm2d, nn.Conv2d, type(model[2])]
    hooked = nn.Sequential(nn.BatchNorm2d(3), torch.nn.utils.spectral_norm(nn.BatchNorm2d(3)))
    with pytest.raises(ValueError, match="BatchNorm2d's weight is a Tensor, not a Parameter"):
        bb.nn.convert_local_batchnorm(hooked)
    assert type(hooked[0]) is nn.BatchNorm2d


def test_zero_init_last_bn():
    model = small_resnet()
    names = bb.nn.zero_init_last_bn(model)
    assert names == ["3.bn2", "4.bn2"]
    for name, module in model.named_modules():
        if isinstance(module, nn.modules.batchnorm._BatchNorm):
            assert (module.weight == 0).all().item() == (name in names), name
    with pytest.raises(ValueError, match="no residual block"):
        bb.nn.zero_init_last_bn(nn.Sequential(nn.Conv2d(3, 3, 1), nn.BatchNorm2d(3)))


@pytest.mark.parametrize("device", DEVICES)
def test_bad_input(device):
    layer = bb.nn.LocalBatchNorm2d(4, group_size=2).to(device)
    with pytest.raises(ValueError, match="expected 4D input"):
        layer(torch.randn(4, 4, 3, device=device))
    with pytest.raises(ValueError, match="4 channels|got an input with 5 channels"):
        layer(torch.randn(4, 5, 3, 3, device=device))
    with pytest.raises(ValueError, match="more than 1 value per channel"):
        layer(torch.randn(1, 4, 1, 1, device=device))
    with pytest.raises(TypeError, match="float32, float16, bfloat16 or float64"):
        bb.nn.local_batch_norm(torch.ones(4, 4, 3, 3, dtype=torch.int64, device=device),
                               None, None, training=True, group_size=2)
    for group_size in (1, 0, 2.5, True):
        with pytest.raises(ValueError, match="group_size"):
            bb.nn.LocalBatchNorm2d(4, group_size=group_size)
    with pytest.raises(RuntimeError, match="group_size must be at least 2"):
        torch.ops.torch_bigbatch.local_batch_norm(torch.randn(4, 4, device=device), None, None,
                                                  1, 1e-5)
    with pytest.raises(RuntimeError, match="weight must have 4 elements"):
        torch.ops.torch_bigbatch.local_batch_norm(torch.randn(4, 4, device=device),
                                                  torch.ones(3, device=device), None, 2, 1e-5)
    with pytest.raises(RuntimeError, match="more than 1 value per channel"):
        torch.ops.torch_bigbatch.local_batch_norm(torch.randn(1, 4, device=device), None, None,
                                                  2, 1e-5)
    with pytest.raises(ValueError, match="bias should contain 4 elements"):
        bb.nn.local_batch_norm(torch.randn(4, 4, device=device), None, None, None,
                               torch.zeros(3, device=device), training=True, group_size=2)
    with pytest.raises(ValueError, match="running_mean and running_var must be given together"):
        bb.nn.local_batch_norm(torch.randn(4, 4, device=device), torch.zeros(4, device=device),
                               None, training=True, group_size=2)
    running = torch.zeros(4, device=device)
    with pytest.raises(ValueError, match="running_var should contain 3 elements"):
        bb.nn.local_batch_norm(torch.randn(4, 3, device=device), running[:3], running,
                               training=True, group_size=2)
    assert running.eq(0).all()  # refused before anything ran


def test_options_as_batchnorm_takes_them():
    """A group size as any integer type (numpy's: anything with __index__), and the keyword
    options of this torch's nn.BatchNorm: bias=False (torch 2.13 on) gives the same module and
    state dict, and where torch has no such option both refuse it alike."""
    class Index:
        def __index__(self):
            return 8

    assert bb.nn.LocalBatchNorm2d(3, group_size=Index()).group_size == 8
    try:
        native = nn.BatchNorm2d(3, bias=False)
    except TypeError:
        with pytest.raises(TypeError):
            bb.nn.LocalBatchNorm2d(3, bias=False)
        return
    local = bb.nn.LocalBatchNorm2d(3, bias=False)
    assert local.bias is None and local.state_dict().keys() == native.state_dict().keys()
    local.load_state_dict(native.state_dict())


def test_compiles():
    """The fake kernels let torch.compile trace forward and backward into one graph."""
    layer = bb.nn.LocalBatchNorm2d(6, group_size=4)
    compiled = torch.compile(layer, backend="aot_eager", fullgraph=True)
    x = torch.randn(10, 6, 3, 3).to(memory_format=torch.channels_last).requires_grad_()
    x_eager = x.detach().clone().requires_grad_()
    y = compiled(x)
    y.square().sum().backward()
    reference_layer = bb.nn.LocalBatchNorm2d(6, group_size=4)
    y_eager = reference_layer(x_eager)
    y_eager.square().sum().backward()
    assert torch.equal(y, y_eager) and torch.equal(x.grad, x_eager.grad)
    assert torch.equal(layer.running_var, reference_layer.running_var)


def compiled_against_reference(device, backend, shape, group_size, channels_last, affine,
                               dtype=torch.float32, mean=5.0):
    """A compiled training step of a batch of equal groups (torch ops, not the op) against the
    float64 reference: (output, grads, running stats) errors, and whether the memory format
    was kept."""
    torch._dynamo.reset()  # (a compile per case: the module's recompile limit is 8)
    torch.manual_seed(0)
    layer = bb.nn.LocalBatchNorm2d(shape[1], group_size=group_size, affine=affine,
                                   momentum=1.0).to(device)
    if affine:
        with torch.no_grad():
            layer.weight.uniform_(0.5, 2)
            layer.bias.uniform_(-1, 1)
    x = memory_format(torch.randn(shape, device=device) * 3 + mean, channels_last)
    x = x.to(dtype).requires_grad_()
    dy = torch.randn(shape, device=device).to(dtype)
    compiled = torch.compile(layer, backend=backend, fullgraph=True)
    y = compiled(x)
    y.backward(dy)
    ones = torch.ones(shape[1], device=device)
    weight, bias = (layer.weight, layer.bias) if affine else (ones, ones * 0)
    expected, grads = reference_gradients(x, weight, bias, dy, group_size or shape[0])
    _, mean, var = reference(x.detach().cpu(), None, None, group_size or shape[0])
    exact = dtype in (torch.float32, torch.float64)
    assert_relative_close(y.detach().cpu(), expected, 1e-5 if exact else 1e-2, "output")
    assert_relative_close(x.grad.cpu(), grads[0], 1e-4 if exact else 2e-2, "grad_input")
    if affine:
        assert_relative_close(layer.weight.grad.cpu(), grads[1], 1e-4, "grad_weight")
        assert_relative_close(layer.bias.grad.cpu(), grads[2], 1e-4, "grad_bias")
    assert_relative_close(layer.running_mean.cpu(), mean, 1e-5, "running_mean")
    assert_relative_close(layer.running_var.cpu(), var, 1e-5, "running_var")
    wanted = torch.channels_last if channels_last else torch.contiguous_format
    assert y.is_contiguous(memory_format=wanted) and y.dtype == dtype


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("channels_last", [False, True], ids=["nchw", "channels_last"])
@pytest.mark.parametrize("group_size, affine", [(4, True), (None, False)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.float16, torch.bfloat16],
                         ids=["float32", "float64", "float16", "bfloat16"])
def test_compiled_equal_groups_run_as_torch_ops_that_agree(device, channels_last, group_size,
                                                           affine, dtype):
    """Under torch.compile a batch of equal groups is normalized by torch ops (which the
    compiler fuses); they agree with the reference, the op's numbers, as the op does."""
    compiled_against_reference(device, "aot_eager", (12, 5, 3, 4), group_size, channels_last,
                               affine, dtype)


@pytest.mark.parametrize("shape", [(0, 3, 2, 2), (2, 3), (2, 3, 1, 1)], ids=str)
def test_compiled_empty_and_one_value_per_sample_match_eager(shape):
    """An empty batch (the op: an empty output, running statistics kept) and one value per
    sample and channel, compiled, as eager."""
    torch._dynamo.reset()
    torch.manual_seed(0)
    x = torch.randn(shape)
    eager = bb.nn.LocalBatchNorm2d(3, group_size=2) if len(shape) == 4 else \
        bb.nn.LocalBatchNorm1d(3, group_size=2)
    compiled_layer = copy.deepcopy(eager)
    y_eager = eager(x)
    y = torch.compile(compiled_layer, backend="aot_eager", fullgraph=True)(x)
    assert y.shape == y_eager.shape
    assert_relative_close(y, y_eager, 1e-5, "output") if y.numel() else None
    assert_relative_close(compiled_layer.running_var, eager.running_var, 1e-6, "running_var")
    assert_relative_close(compiled_layer.running_mean, eager.running_mean, 1e-6, "running_mean")


@pytest.mark.parametrize("dtype", [torch.int64, torch.complex64], ids=["int64", "complex64"])
def test_compiled_refuses_what_the_op_refuses(dtype):
    """Integer and complex inputs are refused by name under torch.compile too (the ops path
    computed them without a word)."""
    torch._dynamo.reset()
    layer = torch.compile(bb.nn.LocalBatchNorm2d(3, group_size=2), backend="aot_eager",
                          fullgraph=True)
    with pytest.raises(TypeError, match="float32, float16, bfloat16 or float64"):
        layer(torch.ones(4, 3, 2, 2, dtype=dtype))


@pytest.mark.slow
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype, mean", [(torch.float32, 1e6), (torch.bfloat16, 5.0)],
                         ids=["float32 around 1e6", "bfloat16"])
def test_inductor_compiles_equal_groups_channels_last(device, dtype, mean):
    """Inductor's kernels for the torch ops, channels-last as in the training job. In float32
    around 1e6 (3e5 times the spread): inductor's var_mean of the raw values put running_var
    8e-2 off; the groups are centered first now."""
    compiled_against_reference(device, "inductor", (8, 3, 32, 32), 4, True, True, dtype, mean)


def test_compiled_unequal_groups_take_the_op():
    """A tail group (10 = 4 + 4 + 2) goes through the op under torch.compile too."""
    torch._dynamo.reset()
    layer = bb.nn.LocalBatchNorm2d(3, group_size=4)
    graph_ops = []

    def backend(graph, example_inputs):
        graph_ops.extend(str(node.target) for node in graph.graph.nodes)
        return graph.forward

    torch.compile(layer, backend=backend, fullgraph=True)(torch.randn(10, 3, 2, 2))
    torch._dynamo.reset()
    assert any("local_batch_norm" in op for op in graph_ops), graph_ops
    graph_ops.clear()
    torch.compile(layer, backend=backend, fullgraph=True)(torch.randn(12, 3, 2, 2))
    assert not any("local_batch_norm" in op for op in graph_ops), graph_ops


# Views whose memory is neither [N, C, ...] nor channels-last (or is, with odd strides): slices,
# transposes, steps, channel slices of [N, C, 1, 1], stride-0 broadcasts, in 1d, 2d and 3d.
ODD_VIEWS = {
    "1d channel slice": lambda g: torch.randn(64, 128, generator=g)[:, :64],
    "1d transposed": lambda g: torch.randn(64, 64, generator=g).t(),
    "1d every other sample": lambda g: torch.randn(128, 64, generator=g)[::2],
    "1d broadcast batch": lambda g: torch.randn(1, 64, generator=g).expand(6, 64),
    "1d (N, C, L) length slice": lambda g: torch.randn(16, 6, 20, generator=g)[:, :, 3:17:2],
    "1d (N, C, L) channels-last": lambda g: torch.randn(16, 20, 6, generator=g).transpose(1, 2),
    "1d (N, C, L) channels-last slice": lambda g: torch.randn(16, 20, 9, generator=g)
    .transpose(1, 2)[:, :6],
    "2d channel slice of 1x1": lambda g: torch.randn(64, 128, 1, 1, generator=g)[:, :64],
    "2d broadcast 1x1": lambda g: torch.randn(1, 64, 1, 1, generator=g).expand(6, 64, 1, 1),
    "2d broadcast 3x3": lambda g: torch.randn(1, 5, 3, 3, generator=g).expand(10, 5, 3, 3),
    "2d broadcast spatial": lambda g: torch.randn(10, 5, 1, 1, generator=g).expand(10, 5, 3, 4),
    "2d transposed spatial": lambda g: torch.randn(12, 5, 6, 4, generator=g).transpose(2, 3),
    "2d channels-last channel slice": lambda g: torch.randn(12, 8, 5, 5, generator=g)
    .to(memory_format=torch.channels_last)[:, 2:7],
    "2d cropped": lambda g: torch.randn(12, 5, 9, 9, generator=g)[:, :, 1:-1, ::2],
    "2d batch reversed": lambda g: torch.randn(12, 5, 4, 4, generator=g).flip(0),
    "3d channels-last slice": lambda g: torch.randn(9, 6, 3, 4, 5, generator=g)
    .to(memory_format=torch.channels_last_3d)[:, 1:5],
    "3d permuted": lambda g: torch.randn(9, 3, 4, 5, 6, generator=g).permute(0, 4, 2, 3, 1),
}


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("view", list(ODD_VIEWS), ids=str)
def test_odd_strides_equal_the_contiguous_copy(device, view):
    """Any view gives what its contiguous copy gives: output, the three gradients and the
    running statistics (the groups are of 4 samples, with tails)."""
    x = ODD_VIEWS[view](torch.Generator().manual_seed(0)).to(device)
    channels = x.shape[1]
    layers = [LOCAL_OF[x.dim()](channels, group_size=4).to(device) for _ in range(2)]
    with torch.no_grad():
        for layer in layers:
            layer.weight.copy_(torch.linspace(0.5, 1.5, channels))
            layer.bias.copy_(torch.linspace(-1, 1, channels))
    dy = torch.randn(x.shape, generator=torch.Generator().manual_seed(1)).to(device)
    results = []
    for layer, data in zip(layers, (x, x.contiguous())):
        data = data.detach().requires_grad_()
        y = layer(data)
        y.backward(dy)
        results.append([y, data.grad, layer.weight.grad, layer.bias.grad, layer.running_mean,
                        layer.running_var])
    names = ["output", "grad_input", "grad_weight", "grad_bias", "running_mean", "running_var"]
    for name, actual, expected in zip(names, *results):
        assert_relative_close(actual.cpu(), expected.cpu(), 1e-5, f"{view}: {name}")
    # and the contiguous copy against the group-by-group reference
    expected, _, _ = reference(x.cpu(), layers[1].weight.detach().cpu(),
                               layers[1].bias.detach().cpu(), 4)
    assert_relative_close(results[1][0].detach().cpu(), expected, 1e-5, f"{view}: reference")


def test_large_broadcast_batch_runs_in_bounds():
    """A stride-0 batch of 200,000 samples once crashed the process (the kernels read the view
    as if it were dense): run it in a child process and compare with the contiguous copy."""
    code = """if True:
        import torch, torch_bigbatch as bb
        x = torch.randn(1, 64, 1, 1).expand(200000, 64, 1, 1)
        a, b = bb.nn.LocalBatchNorm2d(64), bb.nn.LocalBatchNorm2d(64)
        ya, yb = a(x), b(x.contiguous())
        assert torch.equal(ya, yb) and torch.equal(a.running_mean, b.running_mean)
        assert torch.equal(a.running_var, b.running_var)
        assert a.running_mean.abs().max() < 10
        print("ok")
    """
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                            timeout=300, env=process_environment())
    assert result.returncode == 0 and result.stdout.strip() == "ok", result.stderr[-2000:]


@pytest.mark.parametrize("device", DEVICES)
def test_non_finite_input_propagates_as_in_batchnorm(device):
    """NaN and inf in a group make its outputs and the running statistics non-finite where
    nn.BatchNorm2d's are (a NaN variance is not clamped to 0)."""
    x = torch.randn(8, 3, 2, 2, device=device)
    x[0, 0, 0, 0] = float("nan")
    x[1, 1, 1, 0] = float("inf")
    native = nn.BatchNorm2d(3).to(device)
    local = bb.nn.LocalBatchNorm2d(3, group_size=None).to(device)
    y_native, y_local = native(x), local(x)
    assert torch.equal(y_native.isnan(), y_local.isnan())
    assert torch.equal(y_native.isinf(), y_local.isinf())
    assert_relative_close(y_local[:, 2], y_native[:, 2], 1e-5, "the finite channel")
    for name in ("running_mean", "running_var"):
        expected, actual = getattr(native, name), getattr(local, name)
        assert torch.equal(expected.isnan(), actual.isnan()), name
        assert torch.equal(expected.isinf(), actual.isinf()), name
    grouped = bb.nn.LocalBatchNorm2d(3, group_size=4).to(device)
    y = grouped(x)
    assert y[:4, :2].isnan().all() and y[4:].isfinite().all()  # only the groups that hold them
    assert grouped.running_var[:2].isnan().all() and grouped.running_var[2].isfinite()


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("channels_last", [False, True], ids=["nchw", "channels_last"])
def test_finite_values_whose_squares_overflow_as_in_batchnorm(device, channels_last):
    """A value of 1e30 among float32 ones: nn.BatchNorm2d's variance is inf and its outputs 0;
    M2 = sum d^2 - sum d * sum d / n was inf - inf, so every output of the (group, channel)
    and the running statistics were NaN."""
    x = torch.randn(2, 4, 5, 5, device=device)
    x[1, 2, 0, 0] = 1e30
    native = nn.BatchNorm2d(4).to(device)
    local = bb.nn.LocalBatchNorm2d(4, group_size=None).to(device)
    y_native = native(x)
    y_local = local(memory_format(x, channels_last))
    assert not y_local.isnan().any()
    assert torch.equal(y_local[:, 2], y_native[:, 2])  # zeros: inf variance
    assert local.running_var[2].isinf() and native.running_var[2].isinf()
    assert_relative_close(y_local[:, :2], y_native[:, :2], 1e-5, "the other channels")


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("channels_last", [False, True], ids=["nchw", "channels_last"])
def test_millions_of_values_per_sample_around_a_far_mean_keep_the_variance_exact(
        device, channels_last):
    """2^20 values per (sample, channel) of std 1 around 1e6: the first pass's float total of a
    sample drifted by hundreds of spreads, and the variance came out 6.7e-3 off channels-last
    (631% at 2^22); now within 1e-5 of float64's on the same float32 inputs."""
    generator = torch.Generator().manual_seed(5)
    x = (torch.randn(2, 2, 1024, 1024, generator=generator, dtype=torch.float64) + 1e6).float()
    layer = bb.nn.LocalBatchNorm2d(2, group_size=2, momentum=1.0).to(device)
    layer(memory_format(x.to(device), channels_last))
    _, mean, var = reference(x, None, None, 2)
    assert_relative_close(layer.running_var.cpu(), var, 1e-5, "running_var")
    assert_relative_close(layer.running_mean.cpu(), mean, 1e-7, "running_mean")


@pytest.mark.parametrize("device", DEVICES)
def test_batches_of_one_and_zero_samples_as_batchnorm2d(device):
    """One sample with several values per channel is normalized over its values (in training,
    and in eval without running statistics); an empty batch gives an empty output and keeps
    the running statistics, as nn.BatchNorm2d does."""
    x = torch.randn(1, 4, 3, 3, device=device) * 2 + 1
    for track in (True, False):
        for train in (True, False):
            native = nn.BatchNorm2d(4, track_running_stats=track).to(device).train(train)
            local = bb.nn.LocalBatchNorm2d(4, track_running_stats=track).to(device).train(train)
            assert_relative_close(local(x), native(x), 1e-5, f"track={track} train={train}")
            if track:
                assert_relative_close(local.running_var, native.running_var, 1e-5, "running_var")
    native, local = nn.BatchNorm2d(4).to(device), bb.nn.LocalBatchNorm2d(4).to(device)
    empty = torch.randn(0, 4, 3, 3, device=device, requires_grad=True)
    y_native, y_local = native(empty), local(empty)
    assert y_local.shape == y_native.shape == empty.shape
    y_local.sum().backward()
    assert empty.grad.shape == empty.shape
    assert torch.equal(local.weight.grad, torch.zeros_like(local.weight))
    for name in ("running_mean", "running_var", "num_batches_tracked"):
        assert torch.equal(getattr(local, name), getattr(native, name)), name


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("layout", ["nchw", "channels_last", "strided", "sliced_1x1",
                                    "broadcast", "empty"])
def test_opcheck(device, layout):
    """Schemas, fake kernels (shapes and strides of every output, for each memory layout) and the
    autograd registration (inputs that require grad), by torch's opcheck."""
    generator = torch.Generator().manual_seed(0)
    shapes = {"sliced_1x1": (10, 8, 1, 1), "broadcast": (1, 4, 3, 5), "empty": (0, 4, 3, 5)}
    x = torch.randn(shapes.get(layout, (10, 4, 3, 5)), generator=generator).to(device)
    if layout == "channels_last":
        x = x.to(memory_format=torch.channels_last)
    elif layout == "strided":
        x = x.transpose(2, 3)
    elif layout == "sliced_1x1":
        x = x[:, :4]
    elif layout == "broadcast":
        x = x.expand(10, 4, 3, 5)
    w, b = torch.rand(4, device=device) + 0.5, torch.randn(4, device=device)
    x, w, b = (t.requires_grad_() for t in (x, w, b))
    op = torch.ops.torch_bigbatch
    torch.library.opcheck(op.local_batch_norm, (x, w, b, 4, 1e-5))
    _, mean, invstd, _, _ = op.local_batch_norm(x, w, b, 4, 1e-5)
    torch.library.opcheck(op.local_batch_norm_backward,
                          (torch.randn_like(x), x.detach(), w.detach(), mean, invstd, 4))


def test_op_is_differentiable():
    """The op itself has an autograd formula: no warning, and gradients that agree with the
    group-by-group reference."""
    x = torch.randn(10, 3, 4, 4, dtype=torch.float64, requires_grad=True)
    w = torch.rand(3, dtype=torch.float64).add_(0.5).requires_grad_()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        y = torch.ops.torch_bigbatch.local_batch_norm(x, w, None, 4, 1e-5)[0]
        y.square().sum().backward()
    _, (grad_x, grad_w, _) = reference_gradients(x.detach(), w.detach(), torch.zeros(3),
                                                 2 * y.detach(), 4)
    assert_relative_close(x.grad, grad_x, 1e-10, "grad_input")
    assert_relative_close(w.grad, grad_w, 1e-10, "grad_weight")


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("channels_last", [False, True], ids=["nchw", "channels_last"])
def test_outliers_keep_the_variance_exact(device, channels_last):
    """Values far from their group's mean, one outlier among them as every group's first value
    and another amid the data: float32 statistics and output against float64's on the same
    float32 inputs. (A sum of squares shifted by the group's first value lost 1e-3 to 1e-2 of
    the variance here.)"""
    generator = torch.Generator().manual_seed(3)
    x = torch.randn(64, 4, 40, 40, generator=generator) * 0.5 + 1000.0  # 102,400 values a group
    x[::32, :, 0, 0] = 1e5  # every group's first value
    x[5, :, 7, 9] = -3e4
    layer = bb.nn.LocalBatchNorm2d(4, group_size=32, momentum=1.0).to(device)
    y = layer(memory_format(x.to(device), channels_last))
    y_ref, mean, var = reference(x, None, None, 32)
    assert_relative_close(layer.running_var.cpu(), var, 1e-5, "running_var")
    assert_relative_close(layer.running_mean.cpu(), mean, 1e-6, "running_mean")
    assert_relative_close(y.cpu(), y_ref, 1e-4, "output")


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("channels_last", [False, True], ids=["nchw", "channels_last"])
@pytest.mark.parametrize("offset", [1e4, 1e6])
def test_a_mean_far_above_the_spread_keeps_the_variance_exact(device, channels_last, offset):
    """Values of std 1 around 1e4 or 1e6, two groups of 32 samples: the float32 variance within
    1e-6 of float64's on the same inputs. (Each sample's mean rounded to float before the
    merge lost 2e-5 of it at 1e4 and 2e-3 at 1e6; nn.BatchNorm2d loses 1e-3 at 1e6.) The
    output is not compared: a float32 mean is half an ulp of 1e6 (0.03 std) off at best, which
    sets its error, as in nn.BatchNorm2d."""
    generator = torch.Generator().manual_seed(4)
    x = (torch.randn(64, 3, 7, 7, generator=generator, dtype=torch.float64) + offset).float()
    layer = bb.nn.LocalBatchNorm2d(3, group_size=32, momentum=1.0).to(device)
    layer(memory_format(x.to(device), channels_last))
    _, mean, var = reference(x, None, None, 32)
    assert_relative_close(layer.running_var.cpu(), var, 1e-6, "running_var")
    assert_relative_close(layer.running_mean.cpu(), mean, 1e-7, "running_mean")
