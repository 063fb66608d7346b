"""torch_bigbatch.optim.LARS against a plain-Python implementation of its formula."""

import pytest
import torch

import torch_bigbatch as bb
from conftest import DEVICES, assert_relative_close


def lars_reference(params, grads_per_step, excluded, lr, momentum, weight_decay, tc, eps, clip,
                   nesterov):
    """In float64: d = g + wd*p; unless excluded, d *= tc*|p| / (|g| + wd*|p| + eps) (1 where a
    norm is 0; clipped at 1 if clip); then torch.optim.SGD's momentum update with d."""
    params = [p.double().clone() for p in params]
    buffers = [None] * len(params)
    for grads in grads_per_step:
        for i, (p, g) in enumerate(zip(params, grads)):
            g = g.double()
            d = g + weight_decay[i] * p
            p_norm, g_norm = p.norm().item(), g.norm().item()
            if not excluded[i] and p_norm > 0 and g_norm > 0:
                trust = tc * p_norm / (g_norm + weight_decay[i] * p_norm + eps)
                d = d * (min(trust, 1.0) if clip else trust)
            buffers[i] = d.clone() if buffers[i] is None else momentum * buffers[i] + d
            p.sub_(lr * (d + momentum * buffers[i] if nesterov else buffers[i]))
    return params


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("clip", [False, True])
@pytest.mark.parametrize("nesterov", [False, True])
def test_lars_matches_formula(device, clip, nesterov):
    generator = torch.Generator().manual_seed(0)
    shapes = [(256, 300), (64,), (3, 3, 5), (70000,), (10,)]
    params = [torch.randn(s, generator=generator).to(device) for s in shapes]
    params[4].zero_()  # |p| = 0: trust ratio 1
    excluded = [False, True, False, False, False]
    weight_decay = [5e-4, 0.0, 5e-4, 5e-4, 5e-4]
    steps = [[torch.randn(s, generator=generator).to(device) * 0.01 for s in shapes]
             for _ in range(6)]
    # tc large enough that clipping bites on some tensors and not on others
    tc, lr = 0.05, 0.5
    ours = [p.clone().requires_grad_() for p in params]
    optimizer = bb.optim.LARS(
        [{"params": [ours[i] for i in (0, 2, 3, 4)], "weight_decay": 5e-4},
         {"params": [ours[1]], "weight_decay": 0.0, "lars_exclude": True}],
        lr=lr, momentum=0.9, nesterov=nesterov, trust_coefficient=tc, clip=clip)
    for grads in steps:
        for p, g in zip(ours, grads):
            p.grad = g.clone()
        optimizer.step()
    expected = lars_reference(params, steps, excluded, lr, 0.9, weight_decay, tc, 1e-8, clip,
                              nesterov)
    for i, (a, e) in enumerate(zip(ours, expected)):
        assert_relative_close(a.detach(), e, 1e-5, f"param {i}")


def test_lars_trust_ratio_changes_the_step():
    """The trust ratio really scales the update: LARS differs from SGD, except on excluded groups."""
    generator = torch.Generator().manual_seed(0)
    p0 = torch.randn(100, generator=generator)
    g = torch.randn(100, generator=generator)
    results = {}
    for name, optimizer_class, extra in [("sgd", bb.optim.SGD, {}),
                                         ("lars", bb.optim.LARS, {}),
                                         ("excluded", bb.optim.LARS, {"lars_exclude": True})]:
        p = p0.clone().requires_grad_()
        optimizer = optimizer_class([{"params": [p], **extra}], lr=0.1)
        p.grad = g.clone()
        optimizer.step()
        results[name] = p.detach()
    expected_trust = 0.001 * p0.norm() / (g.norm() + 1e-8)
    torch.testing.assert_close(results["lars"], p0 - 0.1 * expected_trust * g)
    torch.testing.assert_close(results["excluded"], results["sgd"])
    torch.testing.assert_close(results["sgd"], p0 - 0.1 * g)


def test_lars_works_with_param_groups_of_a_model():
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.BatchNorm1d(16),
                                torch.nn.ReLU(), torch.nn.Linear(16, 2))
    optimizer = bb.optim.LARS(bb.optim.param_groups(model, 5e-5), lr=10.0, momentum=0.9)
    x, y = torch.randn(32, 8), torch.randint(0, 2, (32,))
    losses = []
    for _ in range(30):
        optimizer.zero_grad()
        loss = torch.nn.functional.cross_entropy(model(x), y)
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    assert losses[-1] < 0.5 * losses[0]


def test_lars_takes_sgds_keyword_arguments():
    """Its docstring promises torch.optim.SGD's arguments: foreach and fused without effect
    (one fused launch either way), differentiable=True refused by name (were a TypeError)."""
    def stepped(**options):
        weight = torch.arange(1.0, 5.0, requires_grad=True)
        optimizer = bb.optim.LARS([weight], lr=0.5, momentum=0.9, weight_decay=0.1, **options)
        for _ in range(2):
            weight.grad = torch.tensor([0.5, -1.0, 2.0, 0.25])
            optimizer.step()
        return weight.detach()
    plain = stepped()
    for options in ({"foreach": True}, {"foreach": False}, {"fused": True}, {"fused": False}):
        assert torch.equal(stepped(**options), plain), options
    with pytest.raises(ValueError, match="differentiable=True"):
        stepped(differentiable=True)


def test_lars_refuses_a_trust_coefficient_of_zero():
    """0 would step the group as plain SGD (the kernel's mark of an excluded group), where the
    formula gives no step at all: refused, pointing at lars_exclude."""
    with pytest.raises(ValueError, match="lars_exclude"):
        bb.optim.LARS([torch.zeros(2, requires_grad=True)], lr=0.1, trust_coefficient=0.0)
    for options in ({"trust_coefficient": float("nan")}, {"eps": float("nan")}):  # were taken
        with pytest.raises(ValueError, match="Invalid"):
            bb.optim.LARS([torch.zeros(2, requires_grad=True)], lr=0.1, **options)


def test_grad_scaler_steps_as_the_true_gradients():
    """Under GradScaler the kernel unscales before the trust ratio's norms (a norm of scaled
    gradients would shrink every update by the scale) and skips a step with an inf on the
    device: the same parameters as LARS stepped on the true gradients, without that step."""
    torch.manual_seed(0)
    kwargs = dict(lr=0.5, momentum=0.9, weight_decay=1e-3)
    params = [torch.randn(5, 3, requires_grad=True), torch.randn(7, requires_grad=True)]
    reference = [p.detach().clone().requires_grad_() for p in params]
    optimizer = bb.optim.LARS(params, **kwargs)
    expected_optimizer = bb.optim.LARS(reference, **kwargs)
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
    for step in range(4):
        grads = [torch.randn(p.shape) for p in params]
        if step == 0:
            grads[0][0, 0] = float("inf")
        scale = scaler.scale(torch.ones(()))
        for p, g in zip(params, grads):
            p.grad = g * scale  # a power of two: unscaled exactly
        scaler.step(optimizer)
        scaler.update()
        if step > 0:
            for r, g in zip(reference, grads):
                r.grad = g
            expected_optimizer.step()
        for p, r in zip(params, reference):
            torch.testing.assert_close(p.detach(), r.detach(), rtol=0, atol=0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_large_grad_scale_keeps_the_step(dtype):
    """The gradient's norm is of the unscaled gradient: summed from the scaled one, its squares
    overflowed float at a scale of 2**63 (every scaled value finite), the trust ratio became 0
    and the step was dropped."""
    torch.manual_seed(0)
    p0, g = torch.randn(1000).to(dtype), torch.randn(1000).to(dtype)
    steps = []
    for scale in (1.0, 2.0**63):
        p = p0.clone().requires_grad_()
        optimizer = bb.optim.LARS([p], lr=1.0, trust_coefficient=0.001)
        p.grad = g * scale  # a power of two: unscaled exactly
        optimizer.grad_scale, optimizer.found_inf = torch.tensor(scale), torch.tensor(0.0)
        optimizer.step()
        steps.append(p0.float() - p.detach().float())
    assert steps[0].abs().max() > 0
    torch.testing.assert_close(steps[1], steps[0], rtol=1e-6, atol=0)
