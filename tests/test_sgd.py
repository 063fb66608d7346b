"""torch_bigbatch.optim.SGD against torch.optim.SGD, the trusted oracle."""

import copy
import gc
import itertools
import weakref

import pytest
import torch

import torch_bigbatch as bb
from conftest import CUDA, DEVICES, assert_relative_close, needs_cuda

# Shapes that cover the vector tails, several chunks of the kernels (16384 elements each) and
# empty tensors between and after others (they own no chunk).
SHAPES = [(37, 41), (5,), (0,), (3, 40000), (64, 3, 3, 3), (1,), (0,)]
STEPS = 20


def make_params(device, dtype=torch.float32, seed=0):
    generator = torch.Generator().manual_seed(seed)
    return [torch.randn(s, generator=generator).to(device, dtype) for s in SHAPES]


def run(optimizer_class, params, groups, steps=STEPS, lr_lambda=None, grad_seed=1, **kwargs):
    """Steps an optimizer over copies of `params` split into `groups` (lists of indices, each with
    its own options) with the same random gradients every time; returns the parameters."""
    params = [p.clone().requires_grad_() for p in params]
    optimizer = optimizer_class(
        [{"params": [params[i] for i in indices], **options} for indices, options in groups],
        **kwargs)
    scheduler = None if lr_lambda is None else torch.optim.lr_scheduler.LambdaLR(optimizer, lr_lambda)
    generator = torch.Generator().manual_seed(grad_seed)
    for step in range(steps):
        for i, p in enumerate(params):
            grad = torch.randn(p.shape, generator=generator).to(p.device, p.dtype)
            # Parameter 1 has no gradient every third step: it must be skipped, as torch does.
            p.grad = None if (i == 1 and step % 3 == 0) else grad
        optimizer.step()
        if scheduler is not None:
            scheduler.step()
    return [p.detach() for p in params], optimizer


def warmup(step):
    return (step + 1) / 5 if step < 5 else 0.5 ** (step // 8)  # changes at every step early on


TWO_GROUPS = [([0, 2, 4, 6], {}), ([1, 3, 5], {"lr": 0.03, "weight_decay": 0.02})]

GRID = [
    dict(momentum=m, dampening=d, nesterov=n, weight_decay=wd, maximize=mx)
    for m, d, n, wd, mx in itertools.product([0.0, 0.9], [0.0, 0.25], [False, True],
                                             [0.0, 1e-2], [False, True])
    if not (n and (m == 0 or d != 0))
]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("options", GRID, ids=lambda o: "-".join(f"{k}={v}" for k, v in o.items()))
@pytest.mark.parametrize("schedule", [None, warmup], ids=["constant_lr", "warmup_lr"])
def test_matches_torch_sgd(device, options, schedule):
    params = make_params(device)
    expected, _ = run(torch.optim.SGD, params, TWO_GROUPS, lr=0.1, lr_lambda=schedule, **options)
    actual, _ = run(bb.optim.SGD, params, TWO_GROUPS, lr=0.1, lr_lambda=schedule, **options)
    for i, (a, e) in enumerate(zip(actual, expected)):
        if e.numel():
            assert_relative_close(a, e, 1e-6, f"param {i}")


def velocity_sgd(params, lrs, grads, momentum, weight_decay, correction):
    """Goyal et al. eq. (10) as Caffe2 writes it, in float64: v <- mu*c*v + lr*(g + wd*p),
    p <- p - v, with c = lr_t / lr_{t-1} when corrected and 1 when not."""
    params = [p.double().clone() for p in params]
    velocities = [torch.zeros_like(p) for p in params]
    for t, (lr, step_grads) in enumerate(zip(lrs, grads)):
        c = lrs[t] / lrs[t - 1] if correction and t > 0 else 1.0
        for p, v, g in zip(params, velocities, step_grads):
            v.mul_(momentum * c).add_(lr * (g.double() + weight_decay * p))
            p.sub_(v)
    return params


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("correction", [True, False])
def test_goyal_form_follows_equation_10(device, correction):
    params = make_params(device)
    lrs = [0.1 * warmup(t) for t in range(STEPS)]
    generator = torch.Generator().manual_seed(3)
    grads = [[torch.randn(p.shape, generator=generator).to(device) for p in params]
             for _ in range(STEPS)]
    ours = [p.clone().requires_grad_() for p in params]
    optimizer = bb.optim.SGD(ours, lr=lrs[0], momentum=0.9, weight_decay=1e-2,
                             momentum_form="goyal", lr_correction=correction)
    for lr, step_grads in zip(lrs, grads):
        for group in optimizer.param_groups:
            group["lr"] = lr
        for p, g in zip(ours, step_grads):
            p.grad = g.clone()
        optimizer.step()
    expected = velocity_sgd(params, lrs, grads, 0.9, 1e-2, correction)
    for i, (a, e) in enumerate(zip(ours, expected)):
        if e.numel():
            assert_relative_close(a.detach(), e, 2e-6, f"param {i}")


def test_uncorrected_goyal_form_remembers_each_groups_own_previous_lr():
    """Without the correction, a group with no gradients at a step (LR 0.2 there) keeps the LR
    of its own previous step: its next step decays the velocity as eq. (10) does after 0.1."""
    generator = torch.Generator().manual_seed(4)
    start = [torch.randn(3, generator=generator) for _ in range(2)]
    grads = [[torch.randn(3, generator=generator) for _ in range(2)] for _ in range(3)]
    lrs = [0.1, 0.2, 0.4]
    ours = [p.clone().requires_grad_() for p in start]
    optimizer = bb.optim.SGD([{"params": [ours[0]]}, {"params": [ours[1]]}], lr=lrs[0],
                             momentum=0.9, momentum_form="goyal", lr_correction=False)
    for t, lr in enumerate(lrs):
        for group in optimizer.param_groups:
            group["lr"] = lr
        ours[0].grad = grads[t][0].clone()
        ours[1].grad = None if t == 1 else grads[t][1].clone()
        optimizer.step()
    every_step = velocity_sgd(start[:1], lrs, [g[:1] for g in grads], 0.9, 0.0, False)
    skipping = velocity_sgd(start[1:], [0.1, 0.4], [grads[0][1:], grads[2][1:]], 0.9, 0.0, False)
    assert_relative_close(ours[0].detach(), every_step[0], 1e-6, "group stepped every time")
    assert_relative_close(ours[1].detach(), skipping[0], 1e-6, "group without a step")



def test_uncorrected_goyal_form_keeps_the_previous_lr_of_a_step_that_raised():
    """A step that raises (a parameter the kernel refuses) leaves the group's previous LR as it
    was: the retried step rescales the velocity from the LR of the last step that ran."""
    start, grads, lrs = torch.ones(3), [torch.full((3,), 0.5), torch.full((3,), 2.0)], [0.1, 0.4]
    weight = start.clone().requires_grad_()
    optimizer = bb.optim.SGD([weight], lr=lrs[0], momentum=0.9, momentum_form="goyal",
                             lr_correction=False)
    weight.grad = grads[0].clone()
    optimizer.step()
    optimizer.param_groups[0]["lr"] = 0.05
    bad = torch.zeros(4, 8)[:, ::2].requires_grad_()
    bad.grad = torch.ones(4, 4)
    optimizer.param_groups[0]["params"].append(bad)
    optimizer.state[bad]["momentum_buffer"] = torch.zeros(4, 4)  # in weight's launch
    with pytest.raises(RuntimeError, match="must be dense"):
        optimizer.step()
    optimizer.param_groups[0]["params"].pop()
    optimizer.param_groups[0]["lr"] = lrs[1]
    weight.grad = grads[1].clone()
    optimizer.step()
    expected = velocity_sgd([start], lrs, [[g] for g in grads], 0.9, 0.0, False)
    assert_relative_close(weight.detach(), expected[0], 1e-6, "after the retried step")

@pytest.mark.parametrize("device", DEVICES)
def test_goyal_correction_matters_only_when_lr_changes(device):
    params = make_params(device)
    kwargs = dict(lr=0.1, momentum=0.9, weight_decay=1e-2, nesterov=True)
    groups = [(list(range(len(params))), {})]
    for schedule in (None, warmup):
        torch_form, _ = run(bb.optim.SGD, params, groups, lr_lambda=schedule, **kwargs)
        corrected, _ = run(bb.optim.SGD, params, groups, lr_lambda=schedule,
                           momentum_form="goyal", **kwargs)
        uncorrected, _ = run(bb.optim.SGD, params, groups, lr_lambda=schedule,
                             momentum_form="goyal", lr_correction=False, **kwargs)
        for t, c, u in zip(torch_form, corrected, uncorrected):
            if not t.numel():
                continue
            assert_relative_close(c, t, 1e-6, "goyal with correction vs torch form")
            drift = ((u - t).abs().max() / t.abs().max()).item()
            if schedule is None:
                assert drift <= 1e-6, f"constant lr: uncorrected goyal drifted by {drift:.3g}"
            else:
                assert drift > 1e-3, f"changing lr: uncorrected goyal should drift, got {drift:.3g}"


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_reduced_precision_parameters_use_float_math(device, dtype):
    """Each step rounds once: float32 math on the stored values, then back to dtype."""
    params = make_params(device, dtype)
    kwargs = dict(lr=0.1, momentum=0.9, weight_decay=1e-2, nesterov=True)
    groups = [(list(range(len(params))), {})]
    actual, optimizer = run(bb.optim.SGD, params, groups, steps=2, **kwargs)
    # The oracle: torch's SGD in float32 from the same values, rounded to dtype after each step.
    expected = [p.float() for p in params]
    generator = torch.Generator().manual_seed(1)
    buffers = [None] * len(params)
    for step in range(2):
        for i, p in enumerate(expected):
            g = torch.randn(p.shape, generator=generator).to(device, dtype).float()
            if i == 1 and step % 3 == 0:
                continue
            d = g + 1e-2 * p
            buffers[i] = d.clone() if buffers[i] is None else 0.9 * buffers[i].to(dtype).float() + d
            expected[i] = (p - 0.1 * (d + 0.9 * buffers[i])).to(dtype).float()
    for i, (a, e) in enumerate(zip(actual, expected)):
        assert a.dtype == dtype
        # Within one unit in the last place (the kernel may contract to a fused multiply-add,
        # landing on the other side of a rounding tie), and almost everywhere bit-exact: math
        # done in dtype itself would round several times per step and miss both.
        torch.testing.assert_close(a.float(), e, rtol=torch.finfo(dtype).eps, atol=1e-6)
        if e.numel():
            exact = (a.float() == e).double().mean().item()
            assert exact > 0.999, f"param {i}: only {exact:.4%} bit-exact"
        assert optimizer.state[optimizer.param_groups[0]["params"][i]]["momentum_buffer"].dtype == dtype


@pytest.mark.parametrize("device", DEVICES)
def test_tensor_lr_matches_float_lr(device):
    params = make_params(device)
    groups = [(list(range(len(params))), {})]
    expected, _ = run(bb.optim.SGD, params, groups, lr=0.1, momentum=0.9, lr_lambda=warmup)
    actual, optimizer = run(bb.optim.SGD, params, groups, lr=torch.tensor(0.1, device=device),
                            momentum=0.9, lr_lambda=warmup)
    assert isinstance(optimizer.param_groups[0]["lr"], torch.Tensor)
    for a, e in zip(actual, expected):
        if e.numel():
            assert_relative_close(a, e, 1e-6, "tensor lr")


@pytest.mark.parametrize("device", DEVICES)
def test_many_tensors_and_groups_in_one_step(device):
    """More tensors (400) and groups (70) than one CUDA launch's table holds (320, 64)."""
    generator = torch.Generator().manual_seed(0)
    params = [torch.randn(7 + i % 50, generator=generator).to(device) for i in range(400)]
    groups = [(list(range(g, 400, 70)), {"lr": 0.002 * (g + 1), "weight_decay": 1e-4 * g})
              for g in range(70)]
    expected, _ = run(torch.optim.SGD, params, groups, steps=3, momentum=0.9, nesterov=True)
    actual, _ = run(bb.optim.SGD, params, groups, steps=3, momentum=0.9, nesterov=True)
    for i, (a, e) in enumerate(zip(actual, expected)):
        assert_relative_close(a, e, 1e-6, f"param {i}")


@pytest.mark.parametrize(
    "scheduler",
    [
        lambda o: torch.optim.lr_scheduler.StepLR(o, step_size=3, gamma=0.5),
        lambda o: torch.optim.lr_scheduler.CosineAnnealingLR(o, T_max=10),
        lambda o: torch.optim.lr_scheduler.OneCycleLR(o, max_lr=0.5, total_steps=STEPS),
        lambda o: torch.optim.lr_scheduler.SequentialLR(o, [
            torch.optim.lr_scheduler.LinearLR(o, start_factor=0.1, total_iters=5),
            torch.optim.lr_scheduler.MultiStepLR(o, milestones=[5, 10])], milestones=[5]),
        lambda o: torch.optim.lr_scheduler.ReduceLROnPlateau(o, patience=1),
    ],
    ids=["StepLR", "CosineAnnealingLR", "OneCycleLR", "SequentialLR", "ReduceLROnPlateau"],
)
def test_torch_lr_schedulers_drive_it(scheduler):
    results = []
    for optimizer_class in (torch.optim.SGD, bb.optim.SGD):
        p = torch.nn.Parameter(torch.ones(10))
        optimizer = optimizer_class([p], lr=0.1, momentum=0.9)
        sched = scheduler(optimizer)
        lrs = []
        for step in range(STEPS):
            p.grad = torch.full_like(p, 0.1 * (step % 4))
            optimizer.step()
            lrs.append(optimizer.param_groups[0]["lr"])
            if isinstance(sched, torch.optim.lr_scheduler.ReduceLROnPlateau):
                sched.step(1.0)
            else:
                sched.step()
        results.append((p.detach().clone(), lrs))
    assert results[0][1] == results[1][1]
    assert_relative_close(results[1][0], results[0][0], 1e-6, "parameters")


def test_closure_and_zero_grad():
    p = torch.nn.Parameter(torch.tensor([1.0, -2.0]))
    optimizer = bb.optim.SGD([p], lr=0.5)

    def closure():
        optimizer.zero_grad()
        loss = (p ** 2).sum()
        loss.backward()
        return loss

    loss = optimizer.step(closure)
    assert loss.item() == 5.0
    torch.testing.assert_close(p.detach(), torch.tensor([0.0, 0.0]))  # p - 0.5 * 2p
    optimizer.zero_grad()
    assert p.grad is None


def test_param_groups_split_decay_from_biases_and_norms():
    model = torch.nn.Sequential(
        torch.nn.Conv2d(3, 8, 3, bias=False), torch.nn.BatchNorm2d(8), torch.nn.ReLU(),
        torch.nn.Flatten(), torch.nn.Linear(8, 4), torch.nn.LayerNorm(4))
    model[0].weight.requires_grad_(True)
    decay, no_decay = bb.optim.param_groups(model, weight_decay=1e-4)
    ids = lambda params: {id(p) for p in params}  # noqa: E731
    assert ids(decay["params"]) == ids([model[0].weight, model[4].weight])
    assert ids(no_decay["params"]) == ids([model[1].weight, model[1].bias, model[4].bias,
                                           model[5].weight, model[5].bias])
    assert decay["weight_decay"] == 1e-4 and not decay.get("lars_exclude", False)
    assert no_decay["weight_decay"] == 0.0 and no_decay["lars_exclude"] is True
    # torch.optim.SGD accepts the same groups, so they work with either optimizer.
    torch.optim.SGD(bb.optim.param_groups(model, 1e-4), lr=0.1)


def test_param_groups_leave_out_frozen_parameters_and_empty_groups():
    model = torch.nn.Linear(3, 2, bias=False)
    assert [len(g["params"]) for g in bb.optim.param_groups(model, 1e-4)] == [1]
    model.weight.requires_grad_(False)
    assert bb.optim.param_groups(model, 1e-4) == []


@CUDA
@needs_cuda
def test_a_whole_training_step_replays_in_a_cuda_graph():
    """torch's whole-network capture: forward (local BatchNorm), backward and the fused step
    with a tensor LR in one graph; replayed over new batches and LRs it trains as eager steps
    do (parameters and running statistics)."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Conv2d(3, 8, 3, padding=1), bb.nn.LocalBatchNorm2d(8, group_size=4),
        torch.nn.ReLU(), torch.nn.AdaptiveAvgPool2d(1), torch.nn.Flatten(),
        torch.nn.Linear(8, 4)).cuda()
    eager_model = copy.deepcopy(model)
    lr = torch.tensor(0.05, device="cuda")
    optimizer = bb.optim.SGD(model.parameters(), lr=lr, momentum=0.9, weight_decay=1e-3)
    eager_optimizer = bb.optim.SGD(eager_model.parameters(), lr=0.05, momentum=0.9,
                                   weight_decay=1e-3)
    generator = torch.Generator().manual_seed(1)
    batches = [(torch.randn(16, 3, 8, 8, generator=generator).cuda(),
                torch.randint(0, 4, (16,), generator=generator).cuda()) for _ in range(8)]
    static_x, static_y = batches[0][0].clone(), batches[0][1].clone()

    def train_step(net, opt, x, y):
        loss = torch.nn.functional.cross_entropy(net(x), y)
        loss.backward()
        opt.step()
        return loss

    stream = torch.cuda.Stream()  # warm-up on a side stream (makes the momentum buffers)
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for x, y in batches[:3]:
            optimizer.zero_grad(set_to_none=True)
            static_x.copy_(x)
            static_y.copy_(y)
            train_step(model, optimizer, static_x, static_y)
    torch.cuda.current_stream().wait_stream(stream)
    for x, y in batches[:3]:
        eager_optimizer.zero_grad(set_to_none=True)
        train_step(eager_model, eager_optimizer, x, y)
    graph = torch.cuda.CUDAGraph()
    optimizer.zero_grad(set_to_none=True)  # the gradients live in the graph's pool
    with torch.cuda.graph(graph):
        train_step(model, optimizer, static_x, static_y)
    for step, (x, y) in enumerate(batches[3:]):
        new_lr = 0.05 / (step + 1)  # a schedule between replays
        lr.fill_(new_lr)
        static_x.copy_(x)
        static_y.copy_(y)
        graph.replay()
        eager_optimizer.param_groups[0]["lr"] = new_lr
        eager_optimizer.zero_grad(set_to_none=True)
        train_step(eager_model, eager_optimizer, x, y)
    torch.cuda.synchronize()
    for (name, a), b in zip(model.state_dict().items(), eager_model.state_dict().values()):
        if a.is_floating_point():
            assert_relative_close(a, b, 1e-4, name)
        else:
            assert torch.equal(a, b), name


def test_param_groups_refuse_the_parameters_instead_of_the_model():
    model = torch.nn.Linear(3, 2)
    with pytest.raises(TypeError, match="takes the model .an nn.Module., got generator"):
        bb.optim.param_groups(model.parameters(), 1e-4)


@CUDA
@needs_cuda
@pytest.mark.parametrize("optimizer_class", [bb.optim.SGD, bb.optim.LARS])
def test_step_replays_in_a_cuda_graph(optimizer_class):
    """With lr a tensor on the device, a captured step follows the schedule on replay."""
    params = make_params("cuda")
    kwargs = dict(momentum=0.9, nesterov=True, weight_decay=1e-2)
    eager = [p.clone().requires_grad_() for p in params]
    graphed = [p.clone().requires_grad_() for p in params]
    eager_optimizer = optimizer_class(eager, lr=0.1, **kwargs)
    lr = torch.tensor(0.1, device="cuda")
    graphed_optimizer = optimizer_class(graphed, lr=lr, **kwargs)
    generator = torch.Generator().manual_seed(5)
    grads = [[torch.randn(p.shape, generator=generator).cuda() for p in params] for _ in range(6)]

    def set_grads(tensors, step):
        for p, g in zip(tensors, grads[step]):
            if p.grad is None:
                p.grad = g.clone()
            else:
                p.grad.copy_(g)

    # Warm up on a side stream (creates the buffers), then capture one step.
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        set_grads(graphed, 0)
        graphed_optimizer.step()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        graphed_optimizer.step()
    set_grads(eager, 0)
    eager_optimizer.step()

    for step in range(1, 6):
        new_lr = 0.1 * (step + 1)  # the schedule changes lr between replays
        lr.fill_(new_lr)
        eager_optimizer.param_groups[0]["lr"] = new_lr
        set_grads(graphed, step)
        graph.replay()
        set_grads(eager, step)
        eager_optimizer.step()
    torch.cuda.synchronize()
    for i, (g, e) in enumerate(zip(graphed, eager)):
        if e.numel():
            assert_relative_close(g.detach(), e.detach(), 1e-6, f"param {i}")


def test_parameters_on_different_devices_in_one_group():
    """A CPU parameter beside a meta one (say, a model partly materialized) is still stepped:
    launches are per device, and meta's is the fake kernel."""
    cpu = torch.randn(5, requires_grad=True)
    meta = torch.empty(5, device="meta", requires_grad=True)
    expected = cpu.detach().clone().requires_grad_()
    cpu.grad, meta.grad = torch.ones(5), torch.empty(5, device="meta")
    expected.grad = torch.ones(5)
    bb.optim.SGD([cpu, meta], lr=0.1, momentum=0.9).step()
    torch.optim.SGD([expected], lr=0.1, momentum=0.9).step()
    torch.testing.assert_close(cpu, expected, rtol=0, atol=0)


def test_torch_sgd_constructor_flags():
    """foreach and fused are accepted as torch.optim.SGD accepts them (the step is fused either
    way) and kept in the defaults and groups as torch keeps them, also in a copy;
    differentiable=True is refused with a message that says why, also in a group."""
    params = make_params("cpu")
    for flags in (dict(foreach=True), dict(foreach=False), dict(fused=True), dict(fused=False),
                  dict(differentiable=False)):
        ours = bb.optim.SGD(params, lr=0.1, momentum=0.9, **flags)
        theirs = torch.optim.SGD([p.detach().clone() for p in params], lr=0.1, momentum=0.9,
                                 **flags)
        for key in ("foreach", "fused", "differentiable"):
            assert ours.defaults[key] == theirs.defaults[key], key
            assert ours.param_groups[0][key] == theirs.param_groups[0][key], key
        assert set(copy.deepcopy(ours).param_groups[0]) == set(ours.param_groups[0])
        assert copy.deepcopy(ours).defaults == ours.defaults
    for optimizer_class in (bb.optim.SGD, bb.optim.LARS):
        assert set(copy.deepcopy(optimizer_class(params)).param_groups[0]) \
            == set(optimizer_class(params).param_groups[0])
        with pytest.raises(ValueError, match="differentiable=True"):
            optimizer_class([{"params": params, "differentiable": True}], lr=0.1)
    with pytest.raises(ValueError, match="differentiable=True"):
        bb.optim.SGD(params, lr=0.1, differentiable=True)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("nesterov", [False, True])
def test_infinite_parameters_without_weight_decay_stay_as_torch_keeps_them(device, nesterov):
    """torch adds wd * p only where weight_decay != 0: with 0, an infinite parameter (one an
    infinite gradient made so) stays infinite; 0 * inf made it and its buffer NaN here."""
    results = []
    for optimizer_class in (torch.optim.SGD, bb.optim.SGD):
        p = torch.tensor([float("inf"), -float("inf"), 0.5, 1.0], device=device,
                         requires_grad=True)
        optimizer = optimizer_class([p], lr=0.1, momentum=0.9, nesterov=nesterov,
                                    weight_decay=0.0)
        for grad in ([1.0, -1.0, float("inf"), 2.0], [0.5, 0.5, 0.5, 0.5]):
            p.grad = torch.tensor(grad, device=device)
            optimizer.step()
        results.append((p.detach(), optimizer.state[p]["momentum_buffer"]))
    (expected_p, expected_b), (p, b) = results
    assert not p.isnan().any() and not b.isnan().any(), (p, b)
    torch.testing.assert_close(p, expected_p, equal_nan=True)
    torch.testing.assert_close(b, expected_b, equal_nan=True)


def test_a_parameter_listed_twice_in_a_group_is_refused():
    """torch.optim.SGD warns and steps it twice; one fused launch would update it from two
    threads at once (results changed from run to run), so it is refused with a clear error."""
    p = torch.zeros(5, requires_grad=True)
    with pytest.raises(ValueError, match="more than once"):
        bb.optim.SGD([p, p], lr=0.1)
    optimizer = bb.optim.SGD([p], lr=0.1)
    with pytest.raises(ValueError, match="more than once"):
        q = torch.ones(2, requires_grad=True)
        optimizer.add_param_group({"params": (t for t in [torch.ones(2), q, q])})
    with pytest.raises(ValueError, match="more than once"):  # named parameters
        bb.optim.SGD([("a", p), ("b", p)], lr=0.1)
    assert len(optimizer.param_groups) == 1


def test_a_step_that_raises_leaves_the_state_as_it_was():
    """A parameter the kernel refuses (not dense: every other column of a matrix) raises
    naming it by its group; no zero momentum buffer is left behind, so once it is replaced by
    a dense one the step is torch.optim.SGD's first step (with dampening a leftover buffer
    would halve it)."""
    kwargs = dict(lr=1.0, momentum=0.9, dampening=0.5)
    ok = torch.zeros(3, requires_grad=True)
    bad = torch.zeros(4, 8)[:, ::2].requires_grad_()
    optimizer = bb.optim.SGD([{"params": [ok]}, {"params": [ok.new_zeros(0), bad]}], **kwargs)
    ok.grad, bad.grad = torch.ones(3), torch.ones(4, 4)
    with pytest.raises(RuntimeError, match=r"param_groups\[1\]\['params'\]\[1\]"):
        optimizer.step()
    assert "momentum_buffer" not in optimizer.state[bad]
    expected = torch.zeros(4, 4, requires_grad=True)
    expected.grad = torch.ones(4, 4)
    torch.optim.SGD([expected], **kwargs).step()
    dense = bad.detach().contiguous().requires_grad_()
    dense.grad = torch.ones(4, 4)
    optimizer.param_groups[1]["params"][1] = dense
    optimizer.state[dense] = optimizer.state.pop(bad)
    optimizer.step()
    torch.testing.assert_close(dense.detach(), expected.detach(), rtol=0, atol=0)


def test_param_groups_find_biases_by_name():
    """Biases named otherwise than "bias" (attention's in_proj_bias and bias_k, the RNNs'
    bias_ih_l0) get no weight decay either."""
    model = torch.nn.ModuleList([torch.nn.MultiheadAttention(4, 2, add_bias_kv=True),
                                 torch.nn.LSTM(4, 4)])
    decay, no_decay = bb.optim.param_groups(model, weight_decay=1e-4)
    names = {id(p): name for name, p in model.named_parameters()}
    assert sorted(names[id(p)] for p in no_decay["params"]) == [
        "0.bias_k", "0.bias_v", "0.in_proj_bias", "0.out_proj.bias", "1.bias_hh_l0",
        "1.bias_ih_l0"]
    assert all("weight" in names[id(p)] for p in decay["params"])



@pytest.mark.parametrize("optimizer_class", [torch.optim.SGD, bb.optim.SGD, bb.optim.LARS])
def test_a_backward_through_a_parameter_the_step_changed_raises(optimizer_class):
    """A step changes the parameters and buffers in place as torch's in-place ops do, version
    counter included: a backward through a graph that saved a parameter before the step raises,
    as with torch.optim.SGD, instead of using the updated values."""
    weight = torch.ones(3, requires_grad=True)
    loss = (weight * weight * torch.arange(3.0)).sum()
    loss.backward(retain_graph=True)
    optimizer = optimizer_class([weight], lr=0.1, momentum=0.9)
    optimizer.step()
    optimizer.step()  # the buffers now exist: a later step changes them in place too
    assert weight._version > 0
    buffer = optimizer.state[weight]["momentum_buffer"]
    version = buffer._version
    optimizer.step()
    assert buffer._version > version
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        loss.backward()


def test_a_step_on_inference_tensors_outside_inference_mode_raises_with_nothing_changed():
    """Refused as torch.optim.SGD refuses it, but before any update (torch's in-place ops
    update, then raise)."""
    def inference_parameter():
        with torch.inference_mode():
            weight = torch.ones(3)
            weight.grad = torch.ones(3)
        return weight

    with pytest.raises(RuntimeError, match="[Ii]nference tensor"):
        torch.optim.SGD([inference_parameter()], lr=0.1).step()
    weight = inference_parameter()
    with pytest.raises(RuntimeError, match="[Ii]nference tensor"):
        bb.optim.SGD([weight], lr=0.1).step()
    assert torch.equal(weight, torch.ones(3))


def _change_between_steps(optimizer, params, step):
    """What a training loop may change between steps, each of which changes how a step sorts
    its parameters into kernel launches (the fused step reuses the last step's sorting while
    nothing it read has changed): applied the same to both optimizers."""
    groups = optimizer.param_groups
    if step == 3:  # a gradient goes missing
        params[2].grad = None
    elif step == 4:  # the momentum buffer replaced, in place of its state entry
        optimizer.state[params[0]]["momentum_buffer"] = torch.full_like(params[0], 0.5)
    elif step == 5:  # the whole state entry replaced by a new dict
        optimizer.state[params[1]] = {"momentum_buffer": torch.full_like(params[1], -1.0)}
    elif step == 6:  # a parameter moves to the next group (the list of all stays the same)
        groups[1]["params"].insert(0, groups[0]["params"].pop())
    elif step == 7:  # momentum off for a group: its buffers stay as they are
        groups[0]["momentum"] = 0.0
    elif step == 8:
        groups[0]["momentum"] = 0.9
    elif step == 9:  # a parameter replaced at its place in its group
        replacement = params[3].detach().clone().requires_grad_()
        replacement.grad = params[3].grad
        place = next(i for i, p in enumerate(groups[1]["params"]) if p is params[3])
        groups[1]["params"][place] = replacement
        params[3] = replacement
    elif step == 10:  # the state dropped
        optimizer.state.clear()
    elif step == 11:  # a saved state loaded back
        optimizer.load_state_dict(copy.deepcopy(optimizer.state_dict()))


def test_steps_follow_every_change_between_them_as_torch_sgd_does():
    """The fused step reuses the last step's launches while the parameters, their groups, the
    gradients present, momentum on or off and the state entries are the same objects: after each
    change of those, the step is still torch.optim.SGD's."""
    start = [p for p in make_params("cpu") if p.numel()]  # 5, none empty
    results = []
    for optimizer_class in (torch.optim.SGD, bb.optim.SGD):
        params = [p.clone().requires_grad_() for p in start]
        optimizer = optimizer_class([{"params": params[:3]}, {"params": params[3:], "lr": 0.03}],
                                    lr=0.1, momentum=0.9, weight_decay=1e-2)
        generator = torch.Generator().manual_seed(3)
        trajectory = []
        for step in range(14):
            for p in params:
                p.grad = torch.randn(p.shape, generator=generator)
            _change_between_steps(optimizer, params, step)
            optimizer.step()
            trajectory.append([p.detach().clone() for p in params])
        results.append(trajectory)
    for step, (expected, ours) in enumerate(zip(*results)):
        for i, (e, o) in enumerate(zip(expected, ours)):
            assert_relative_close(o, e, 1e-6, f"parameter {i} after step {step}")


def test_steps_that_change_nothing_reuse_the_launches():
    """Where the step skips sorting the parameters (what the reuse is for)."""
    params = [p.requires_grad_() for p in make_params("cpu")]
    optimizer = bb.optim.SGD(params, lr=0.1, momentum=0.9)
    for step in range(3):
        for p in params:
            p.grad = torch.ones_like(p)
        optimizer.step()
        if step == 0:  # the first step makes the momentum buffers: the state changes
            assert optimizer._launch_plan is None
        elif step == 1:
            plan = optimizer._launch_plan
    assert optimizer._launch_plan is plan


def test_buffers_the_state_drops_are_freed():
    """The launches kept for the next step hold no momentum buffer: clearing the state frees
    them (as with torch.optim.SGD), with no step in between."""
    params = [p.requires_grad_() for p in make_params("cpu")]
    optimizer = bb.optim.SGD(params, lr=0.1, momentum=0.9)
    for _ in range(3):
        for p in params:
            p.grad = torch.ones_like(p)
        optimizer.step()
    buffers = [weakref.ref(state["momentum_buffer"]) for state in optimizer.state.values()]
    optimizer.state.clear()
    gc.collect()
    assert buffers and all(buffer() is None for buffer in buffers)


@pytest.mark.parametrize("start_dtypes", [(torch.float32, torch.float32),
                                          (torch.float32, torch.float16)],
                         ids=["one_launch", "two_launches"])
@pytest.mark.parametrize("momentum", [0.0, 0.9])
def test_parameters_converted_in_place_between_steps_step_as_torch(start_dtypes, momentum):
    """module.to(dtype) converts its parameters in place (p.data = ...): the same objects in
    another dtype. A reused plan sorted them as before, and the op refused a launch of mixed
    dtypes where torch.optim.SGD steps on; with momentum the buffer is converted too (torch
    keeps it in float32: the same within bfloat16's rounding), where a fresh plan stepped one
    launch and then refused the other's old buffer."""
    results = []
    for optimizer_class in (torch.optim.SGD, bb.optim.SGD):
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 4))
        model[1].to(start_dtypes[1])
        # lr a power of two: torch's bfloat16 add rounds its alpha to bfloat16, ours does not
        optimizer = optimizer_class(model.parameters(), lr=0.125, momentum=momentum)
        for step in range(3):
            if step == 2:  # one parameter of a launch, as module.to converts each
                model[0].weight.data = model[0].weight.data.to(torch.bfloat16)
            for p in model.parameters():
                p.grad = torch.ones_like(p)
            optimizer.step()
        results.append([p.detach() for p in model.parameters()])
    for expected, ours in zip(*results):
        assert ours.dtype == expected.dtype
        torch.testing.assert_close(ours, expected)
