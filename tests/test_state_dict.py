"""State dicts move between torch.optim.SGD and ours, both ways, with the same meaning."""

import pytest
import torch

import torch_bigbatch as bb


def train(optimizer_class, params, steps, state_dict=None, seed=0, **kwargs):
    optimizer = optimizer_class([{"params": params[:2]},
                                 {"params": params[2:], "weight_decay": 0.0}], **kwargs)
    if state_dict is not None:
        optimizer.load_state_dict(state_dict)
    generator = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        for p in params:
            p.grad = torch.randn(p.shape, generator=generator)
        optimizer.step()
    return optimizer


def fresh_params():
    generator = torch.Generator().manual_seed(42)
    return [torch.randn(s, generator=generator).requires_grad_() for s in [(10, 3), (7,), (5, 5)]]


KWARGS = dict(lr=0.1, momentum=0.9, weight_decay=1e-3, nesterov=True)


@pytest.mark.parametrize("first, second", [(torch.optim.SGD, bb.optim.SGD),
                                           (bb.optim.SGD, torch.optim.SGD)],
                         ids=["torch_to_ours", "ours_to_torch"])
@pytest.mark.parametrize("momentum_form", ["torch", "goyal"])
def test_state_dict_round_trip(first, second, momentum_form):
    form = {"momentum_form": momentum_form}
    first_form = form if first is bb.optim.SGD else {}
    second_form = form if second is bb.optim.SGD else {}
    # Straight run with torch.optim.SGD: 6 steps.
    expected = fresh_params()
    reference = train(torch.optim.SGD, expected, 3, seed=0, **KWARGS)
    generator = torch.Generator().manual_seed(1)
    for _ in range(3):
        for p in expected:
            p.grad = torch.randn(p.shape, generator=generator)
        reference.step()

    # 3 steps with `first`, its state dict loaded into `second`, 3 more steps.
    params = fresh_params()
    saved = train(first, params, 3, seed=0, **first_form, **KWARGS).state_dict()
    resumed = train(second, params, 3, seed=1, state_dict=saved, **second_form, **KWARGS)
    for p, e in zip(params, expected):
        torch.testing.assert_close(p.detach(), e.detach(), rtol=1e-6, atol=1e-7)
    for p, e in zip(params, expected):
        torch.testing.assert_close(resumed.state[p]["momentum_buffer"],
                                   reference.state[e]["momentum_buffer"], rtol=1e-6, atol=1e-7)
    if second is bb.optim.SGD:
        assert all(g["momentum_form"] == momentum_form for g in resumed.param_groups)


def test_saved_state_keeps_our_options():
    params = fresh_params()
    optimizer = train(bb.optim.SGD, params, 2, momentum_form="goyal", lr_correction=False, **KWARGS)
    loaded = bb.optim.SGD([{"params": params[:2]}, {"params": params[2:]}], lr=1.0)
    loaded.load_state_dict(optimizer.state_dict())
    assert [g["momentum_form"] for g in loaded.param_groups] == ["goyal", "goyal"]
    assert [g["lr_correction"] for g in loaded.param_groups] == [False, False]
    assert [g["lr"] for g in loaded.param_groups] == [0.1, 0.1]


def test_buffers_in_another_memory_format_than_the_parameters():
    """Channels-last buffers (say, from a CUDA run) loaded into a contiguous model step as
    torch.optim.SGD's do."""
    generator = torch.Generator().manual_seed(0)
    weight = torch.randn(4, 3, 3, 3, generator=generator)
    weights = [weight.clone().requires_grad_() for _ in range(2)]
    buffer = torch.randn(4, 3, 3, 3, generator=generator).to(memory_format=torch.channels_last)
    optimizers = [cls([w], **KWARGS) for cls, w in zip((bb.optim.SGD, torch.optim.SGD), weights)]
    for optimizer in optimizers:  # each its own buffer: loading keeps the tensor it is given
        optimizer.load_state_dict({
            "state": {0: {"momentum_buffer": buffer.clone()}},
            "param_groups": [{**KWARGS, "dampening": 0, "maximize": False, "params": [0]}]})
    for _ in range(2):
        grad = torch.randn(4, 3, 3, 3, generator=generator)
        for w, optimizer in zip(weights, optimizers):
            w.grad = grad.clone()
            optimizer.step()
    torch.testing.assert_close(weights[0].detach(), weights[1].detach(), rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(optimizers[0].state[weights[0]]["momentum_buffer"],
                               optimizers[1].state[weights[1]]["momentum_buffer"],
                               rtol=1e-6, atol=1e-7)


def test_a_differentiable_torch_state_loads_as_what_our_step_does():
    """torch.optim.SGD(differentiable=True)'s state dict: its groups' flag came along and
    claimed a differentiable step that the fused kernel never takes."""
    params = fresh_params()
    theirs = torch.optim.SGD(params, lr=0.1, momentum=0.9, differentiable=True)
    ours = bb.optim.SGD([p.detach().clone().requires_grad_() for p in params], lr=0.1,
                        momentum=0.9)
    ours.load_state_dict(theirs.state_dict())
    assert ours.param_groups[0]["differentiable"] is False


def test_a_torch_state_dict_keeps_our_group_options():
    """torch.optim.SGD's groups lack our keys: loading its state dict keeps each group's own
    values of them (LARS's lars_exclude from param_groups, SGD's momentum_form), not the
    constructor's defaults, which made LARS adapt biases and BatchNorm's weights."""
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.BatchNorm1d(4))
    lars = bb.optim.LARS(bb.optim.param_groups(model, weight_decay=1e-4), lr=0.1, momentum=0.9)
    saved = torch.optim.SGD([{"params": g["params"], "weight_decay": g["weight_decay"]}
                             for g in lars.param_groups], lr=0.2, momentum=0.9).state_dict()
    lars.load_state_dict(saved)
    assert [g["lars_exclude"] for g in lars.param_groups] == [False, True]
    assert [g["lr"] for g in lars.param_groups] == [0.2, 0.2]  # what was saved is loaded
    w1, w2 = torch.ones(2, requires_grad=True), torch.ones(2, requires_grad=True)
    sgd = bb.optim.SGD([{"params": [w1]}, {"params": [w2], "momentum_form": "goyal",
                                           "lr_correction": False}], lr=0.1, momentum=0.9)
    sgd.load_state_dict(torch.optim.SGD([{"params": [w1]}, {"params": [w2]}], lr=0.1,
                                        momentum=0.9).state_dict())
    assert [g["momentum_form"] for g in sgd.param_groups] == ["torch", "goyal"]
    assert [g["lr_correction"] for g in sgd.param_groups] == [True, False]
