"""torch.amp.GradScaler drives the fused step: the kernel unscales and skips, on the device."""

import copy

import pytest
import torch

import torch_bigbatch as bb
from conftest import CUDA, DEVICES, needs_cuda


def model_and_batch(device):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(),
                                torch.nn.Linear(32, 4)).to(device)
    return model, torch.randn(8, 16, device=device), torch.randint(0, 4, (8,), device=device)


@pytest.mark.parametrize("device", DEVICES)
def test_scaled_gradients_are_unscaled_in_the_kernel(device):
    model, x, y = model_and_batch(device)
    reference = [p.detach().clone().requires_grad_() for p in model.parameters()]
    optimizer = bb.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, weight_decay=1e-3)
    expected_optimizer = torch.optim.SGD(reference, lr=0.1, momentum=0.9, weight_decay=1e-3)
    scaler = torch.amp.GradScaler(device, init_scale=1024.0)
    for _ in range(3):
        optimizer.zero_grad()
        loss = torch.nn.functional.cross_entropy(model(x), y)
        scaler.scale(loss).backward()
        true_grads = [p.grad / 1024.0 for p in model.parameters()]
        scaler.step(optimizer)
        scaler.update()
        # GradScaler left the gradients scaled: the kernel did the unscaling.
        for p, g in zip(model.parameters(), true_grads):
            torch.testing.assert_close(p.grad, g * 1024.0)
        for r, g in zip(reference, true_grads):
            r.grad = g.clone()
        expected_optimizer.step()
        for p, r in zip(model.parameters(), reference):
            torch.testing.assert_close(p.detach(), r.detach(), rtol=1e-6, atol=1e-7)
    assert scaler.get_scale() == 1024.0


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("unscale_first", [False, True], ids=["step", "unscale_then_step"])
def test_inf_gradient_skips_the_step(device, unscale_first):
    model, x, y = model_and_batch(device)
    optimizer = bb.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    scaler = torch.amp.GradScaler(device, init_scale=256.0)
    # One clean step so that momentum buffers exist.
    scaler.scale(torch.nn.functional.cross_entropy(model(x), y)).backward()
    scaler.step(optimizer)
    scaler.update()
    before = [p.detach().clone() for p in model.parameters()]
    buffers = [optimizer.state[p]["momentum_buffer"].clone() for p in model.parameters()]

    optimizer.zero_grad()
    scaler.scale(torch.nn.functional.cross_entropy(model(x), y)).backward()
    next(model.parameters()).grad[0, 0] = float("inf")
    if unscale_first:  # e.g. to clip gradients: GradScaler then passes found_inf alone
        scaler.unscale_(optimizer)
    scaler.step(optimizer)
    scaler.update()
    for p, b, p0, b0 in zip(model.parameters(), [optimizer.state[p]["momentum_buffer"]
                                                 for p in model.parameters()], before, buffers):
        torch.testing.assert_close(p.detach(), p0, rtol=0, atol=0)
        torch.testing.assert_close(b, b0, rtol=0, atol=0)
    assert scaler.get_scale() == 128.0  # the scaler saw the inf and backed off


def on_cuda(dtype):
    return pytest.param("cuda", dtype, marks=[CUDA, needs_cuda], id=f"cuda-{dtype}")


# GradScaler unscales float16 and bfloat16 gradients on the CPU, float16 alone on CUDA (torch's
# _amp_foreach_non_finite_check_and_unscale_cuda has no bfloat16 kernel: bfloat16 needs no
# scaler there).
SCALED_DTYPES = [*(pytest.param("cpu", dtype, id=f"cpu-{dtype}")
                   for dtype in (torch.float32, torch.float16, torch.bfloat16)),
                 on_cuda(torch.float32), on_cuda(torch.float16)]
# torch rounds float16/bfloat16 math at every op, we once per value: float16 within two ulps of
# the value (at least of 1), bfloat16 within two and a half ulps at 1 (the wrong first-step
# rule is off by lr * dampening * d, about 0.05 * |g|).
TOLERANCES = {torch.float32: dict(rtol=1e-6, atol=1e-7),
              torch.float16: dict(rtol=2**-9, atol=2**-9),
              torch.bfloat16: dict(rtol=0, atol=2e-2)}


@pytest.mark.parametrize("device, dtype", SCALED_DTYPES)
@pytest.mark.parametrize("skipped", [1, 2], ids=["first_skipped", "first_two_skipped"])
def test_skipped_first_steps_then_first_step_as_torch(device, dtype, skipped):
    """GradScaler skips the first steps (inf gradients); the first step that runs initialises
    the momentum buffers (b = d), as torch.optim.SGD's does when its first steps are skipped.
    With dampening, a zero buffer treated as an old one would give b = (1 - dampening) d. Then
    a checkpoint taken while a step is still pending keeps that state."""
    model, x, y = model_and_batch(device)
    model.to(dtype)
    reference = [p.detach().clone().requires_grad_() for p in model.parameters()]
    kwargs = dict(lr=0.1, momentum=0.9, dampening=0.5, weight_decay=1e-3)
    optimizer = bb.optim.SGD(model.parameters(), **kwargs)
    # The oracle: torch's for-loop step on the true gradients, not run where GradScaler would
    # skip it (GradScaler itself refuses to unscale float16 gradients for torch's SGD; torch's
    # foreach step, its default on CUDA, rounds bf16 apart from the loop by up to two ulps).
    expected_optimizer = torch.optim.SGD(reference, foreach=False, **kwargs)
    scaler = torch.amp.GradScaler(device, init_scale=64.0)
    tolerance = TOLERANCES[dtype]
    for step in range(skipped + 3):
        grads = [torch.randn(p.shape, generator=torch.Generator().manual_seed(10 * step + i))
                 .to(device, dtype) for i, p in enumerate(reference)]
        if step < skipped:
            grads[0][0, 0] = float("inf")
        scale = scaler.scale(torch.ones((), device=device))  # a power of two: exact in any dtype
        for p, g in zip(model.parameters(), grads):
            p.grad = g * scale  # as scaler.scale(loss).backward() would
        scaler.step(optimizer)
        scaler.update()
        if step >= skipped:
            for r, g in zip(reference, grads):
                r.grad = g
            expected_optimizer.step()
        if step == skipped - 1:  # still pending: a checkpoint keeps it, on any device
            saved = optimizer.state_dict()
            optimizer = bb.optim.SGD(model.parameters(), **kwargs)
            optimizer.load_state_dict(saved)
        for p, r in zip(model.parameters(), reference):
            torch.testing.assert_close(p.detach(), r.detach(), **tolerance)
    for p, r in zip(model.parameters(), reference):
        torch.testing.assert_close(optimizer.state[p]["momentum_buffer"],
                                   expected_optimizer.state[r]["momentum_buffer"], **tolerance)


def test_checkpoint_with_a_pending_first_step_loads_into_torch_sgd():
    """A checkpoint taken after GradScaler skipped the only step so far has no momentum buffer
    for torch.optim.SGD to take for a started one: with dampening, its first real step then
    equals torch's own (b = g), not (1 - dampening) g."""
    kwargs = dict(lr=1.0, momentum=0.9, dampening=0.5)
    p = torch.zeros(3, requires_grad=True)
    optimizer = bb.optim.SGD([p], **kwargs)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0)
    p.grad = torch.tensor([1.0, float("inf"), 1.0]) * scaler.scale(torch.ones(()))
    scaler.step(optimizer)
    scaler.update()
    saved = optimizer.state_dict()
    assert "momentum_buffer" not in saved["state"].get(0, {})
    assert "momentum_buffer" in optimizer.state[p]  # the optimizer's own state is kept
    q = torch.zeros(3, requires_grad=True)
    loaded = torch.optim.SGD([q], **kwargs)
    loaded.load_state_dict(saved)
    q.grad = torch.ones(3)
    loaded.step()
    torch.testing.assert_close(q.detach(), torch.full((3,), -1.0))


def test_pending_first_steps_of_several_dtypes_after_a_copy():
    """A copied optimizer (copy.deepcopy, pickle) whose buffers of two dtypes are both still
    pending: the first step that runs initialises every buffer (b = g), as torch.optim.SGD's
    first step, in the launch of each dtype. Each launch's flag is its own: had the launches
    shared one, the first would clear it before the second read it, and the second would take
    its zero buffers for started ones (b = (1 - dampening) g)."""
    kwargs = dict(lr=1.0, momentum=0.9, dampening=0.5)
    params = [torch.zeros(4, dtype=dtype, requires_grad=True)
              for dtype in (torch.float32, torch.bfloat16, torch.float32)]
    optimizer = bb.optim.SGD(params, **kwargs)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0)
    scale = scaler.scale(torch.ones(()))
    for p in params:
        p.grad = torch.tensor([1.0, float("inf"), 1.0, 1.0], dtype=p.dtype) * scale
    scaler.step(optimizer)  # skipped: the buffers stay pending
    scaler.update()
    optimizer = copy.deepcopy(optimizer)
    params = optimizer.param_groups[0]["params"]
    grads = [torch.tensor([1.0, 2.0, -1.0, 0.5]) * (i + 1) for i in range(len(params))]
    scale = scaler.scale(torch.ones(()))
    for p, g in zip(params, grads):
        p.grad = (g * scale).to(p.dtype)
    scaler.step(optimizer)
    for i, (p, g) in enumerate(zip(params, grads)):  # small integers and halves: exact
        torch.testing.assert_close(optimizer.state[p]["momentum_buffer"].float(), g, rtol=0,
                                   atol=0, msg=f"buffer {i} ({p.dtype})")
        torch.testing.assert_close(p.detach().float(), -g, rtol=0, atol=0,
                                   msg=f"parameter {i} ({p.dtype})")


def test_steps_under_grad_scaler_reuse_the_launches():
    """Under GradScaler the buffers' flags of skipped first steps are updated in place, so the
    step sorts the parameters once its buffers exist, not at every step (where the host time
    of a step goes: bench_optimizer.py), and still steps as torch.optim.SGD."""
    kwargs = dict(lr=0.5, momentum=0.9, dampening=0.25)
    params = [torch.zeros(3, requires_grad=True), torch.zeros(2, 2, requires_grad=True)]
    reference = [p.detach().clone().requires_grad_() for p in params]
    optimizer = bb.optim.SGD(params, **kwargs)
    expected_optimizer = torch.optim.SGD(reference, foreach=False, **kwargs)
    scaler = torch.amp.GradScaler("cpu", init_scale=4.0)
    plans = []
    for step in range(5):
        grads = [torch.full(p.shape, float(step + 1 + i)) for i, p in enumerate(params)]
        if step == 0:
            grads[1][0, 0] = float("inf")  # skipped: the buffers stay pending
        scale = scaler.scale(torch.ones(()))
        for p, r, g in zip(params, reference, grads):
            p.grad = g * scale
            r.grad = g
        scaler.step(optimizer)
        scaler.update()
        if step > 0:
            expected_optimizer.step()
        plans.append(optimizer._launch_plan)
        for p, r in zip(params, reference):
            torch.testing.assert_close(p.detach(), r.detach(), rtol=1e-6, atol=1e-7)
    assert plans[0] is None and plans[1] is not None  # the first made buffers
    assert all(plan is plans[1] for plan in plans[2:])


def test_many_skips_on_several_devices_leave_momentum_as_torch():
    """GradScaler hands the sum of its devices' found_inf (2 where two devices found an inf):
    multiplied into the pending flag, 2**k grew to inf over 128 skipped steps, inf * 0 was NaN,
    and the buffer restarted at every later step. Simulated on one device with found_inf = 2."""
    p = torch.zeros(3, requires_grad=True)
    q = p.detach().clone().requires_grad_()
    optimizer = bb.optim.SGD([p], lr=1.0, momentum=0.9)
    expected_optimizer = torch.optim.SGD([q], lr=1.0, momentum=0.9)
    p.grad, q.grad = torch.ones(3), torch.ones(3)
    for _ in range(130):
        optimizer.grad_scale, optimizer.found_inf = torch.tensor(1.0), torch.tensor(2.0)
        optimizer.step()
    for _ in range(4):
        optimizer.grad_scale, optimizer.found_inf = torch.tensor(1.0), torch.tensor(0.0)
        optimizer.step()
        expected_optimizer.step()
        torch.testing.assert_close(p.detach(), q.detach(), rtol=1e-6, atol=0)
