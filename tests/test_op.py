"""The op itself: its registration (opcheck), tracing under torch.compile, and its errors."""

import pytest
import torch

import torch_bigbatch as bb
from conftest import DEVICES


def op_args(device, n_groups=2, with_buffers=True):
    generator = torch.Generator().manual_seed(0)
    shapes = [(33,), (4, 9), (20000,)]
    params = [torch.randn(s, generator=generator).to(device) for s in shapes]
    grads = [torch.randn(s, generator=generator).to(device) for s in shapes]
    buffers = [torch.randn(s, generator=generator).to(device) for s in shapes] if with_buffers else []
    return dict(
        params=params, grads=grads, momentum_buffers=buffers, group_of_tensor=[0, 1, 0],
        lr=[0.1] * n_groups, lr_tensor=[None] * n_groups, momentum=[0.9] * n_groups,
        momentum_scale=[1.0] * n_groups, dampening=[0.0] * n_groups,
        weight_decay=[1e-4] * n_groups, nesterov=[True] * n_groups, maximize=[False] * n_groups,
        trust_coefficient=[0.0, 0.001][:n_groups], trust_eps=[1e-8] * n_groups,
        trust_clip=[False] * n_groups, grad_scale=None, found_inf=None, first_step=False,
        first_step_pending=None)


@pytest.mark.parametrize("device", DEVICES)
def test_opcheck(device):
    args = op_args(device)
    torch.library.opcheck(torch.ops.torch_bigbatch.sgd_step_.default, (), args)


@pytest.mark.parametrize("device", DEVICES)
def test_step_runs_under_torch_compile(device):
    torch.manual_seed(0)
    models = [torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(),
                                  torch.nn.Linear(16, 2)).to(device) for _ in range(2)]
    models[1].load_state_dict(models[0].state_dict())
    optimizers = [bb.optim.SGD(m.parameters(), lr=0.1, momentum=0.9, nesterov=True,
                               weight_decay=1e-3) for m in models]
    graphs = []

    def backend(graph_module, example_inputs):  # records what dynamo traced, then inductor
        graphs.append(str(graph_module.graph))
        return torch._inductor.compile(graph_module, example_inputs)

    torch._dynamo.reset()
    compiled_step = torch.compile(optimizers[1].step, backend=backend)
    x = torch.randn(16, 8, device=device)
    for _ in range(4):
        for model in models:
            model.zero_grad()
            model(x).square().mean().backward()
        optimizers[0].step()
        compiled_step()
    for eager, compiled in zip(models[0].parameters(), models[1].parameters()):
        torch.testing.assert_close(compiled, eager, rtol=1e-6, atol=1e-7)
    # The op is in the traced graph (the direct entry, opaque to dynamo, would break it).
    assert any("torch_bigbatch.sgd_step_" in graph for graph in graphs)


def test_bad_hyperparameters_get_torchs_errors():
    p = [torch.nn.Parameter(torch.ones(2))]
    with pytest.raises(ValueError, match="Invalid learning rate"):
        bb.optim.SGD(p, lr=-0.1)
    with pytest.raises(ValueError, match="Invalid momentum value"):
        bb.optim.SGD(p, lr=0.1, momentum=-0.9)
    with pytest.raises(ValueError, match="Invalid weight_decay value"):
        bb.optim.SGD(p, lr=0.1, weight_decay=-1e-4)
    with pytest.raises(ValueError, match="Nesterov momentum requires a momentum"):
        bb.optim.SGD(p, lr=0.1, nesterov=True)
    with pytest.raises(ValueError, match="zero dampening"):
        bb.optim.SGD(p, lr=0.1, momentum=0.9, dampening=0.1, nesterov=True)
    with pytest.raises(ValueError, match="Tensor lr must be 1-element"):
        bb.optim.SGD(p, lr=torch.tensor([0.1, 0.2]))
    with pytest.raises(ValueError, match="momentum_form"):
        bb.optim.SGD(p, lr=0.1, momentum_form="caffe")
    with pytest.raises(ValueError, match="needs a float lr"):
        bb.optim.SGD(p, lr=torch.tensor(0.1), momentum_form="goyal", lr_correction=False)
    with pytest.raises(ValueError, match="Invalid trust_coefficient"):
        bb.optim.LARS(p, lr=0.1, trust_coefficient=-1.0)
    optimizer = bb.optim.SGD(p, lr=0.1)
    with pytest.raises(ValueError, match="Invalid learning rate"):
        optimizer.add_param_group({"params": [torch.nn.Parameter(torch.ones(1))], "lr": -1.0})
    assert len(optimizer.param_groups) == 1


def test_sparse_gradient_is_refused_before_any_update():
    dense = torch.nn.Parameter(torch.ones(3))
    embedding = torch.nn.Embedding(10, 3, sparse=True)
    optimizer = bb.optim.SGD([dense, *embedding.parameters()], lr=0.1, momentum=0.9)
    dense.grad = torch.ones(3)
    embedding(torch.tensor([1, 2])).sum().backward()
    with pytest.raises(RuntimeError, match="does not support sparse gradients"):
        optimizer.step()
    torch.testing.assert_close(dense.detach(), torch.ones(3))  # nothing half-applied
    assert not any("momentum_buffer" in s for s in optimizer.state.values())  # none created


def test_sparse_gradient_after_dense_steps_is_refused_by_name():
    # The third step reuses the second's launches, which looked at the gradients' layout (the
    # first step's, which made the momentum buffers, serve that step alone).
    embedding = torch.nn.Embedding(10, 3)
    optimizer = bb.optim.SGD(embedding.parameters(), lr=0.1, momentum=0.9)
    embedding.weight.grad = torch.ones(10, 3)
    optimizer.step()
    optimizer.step()
    before = embedding.weight.detach().clone()
    buffer = optimizer.state[embedding.weight]["momentum_buffer"].clone()
    embedding.weight.grad = torch.ones(10, 3).to_sparse()
    with pytest.raises(RuntimeError, match="^SGD does not support sparse gradients"):
        optimizer.step()
    torch.testing.assert_close(embedding.weight.detach(), before, rtol=0, atol=0)
    torch.testing.assert_close(optimizer.state[embedding.weight]["momentum_buffer"], buffer,
                               rtol=0, atol=0)


def test_state_that_is_not_a_defaultdict_raises_before_any_update():
    # As torch.optim.SGD: its first step reads self.state[p] before it changes anything.
    p = torch.nn.Parameter(torch.ones(3))
    optimizer = bb.optim.SGD([p], lr=0.1, momentum=0.9)
    optimizer.state = {}
    p.grad = torch.ones(3)
    with pytest.raises(KeyError):
        optimizer.step()
    torch.testing.assert_close(p.detach(), torch.ones(3), rtol=0, atol=0)
    assert optimizer.state == {}


def test_unsupported_dtype_is_refused():
    p = torch.nn.Parameter(torch.ones(3, dtype=torch.float64))
    optimizer = bb.optim.SGD([p], lr=0.1)
    p.grad = torch.ones_like(p)
    with pytest.raises(TypeError, match="float32, float16 and bfloat16 parameters, got torch.float64"):
        optimizer.step()


def test_gradient_with_other_strides_is_handled():
    p = torch.nn.Parameter(torch.randn(4, 6))
    expected = p.detach() - 0.1 * torch.arange(24.0).reshape(6, 4).t()
    optimizer = bb.optim.SGD([p], lr=0.1)
    p.grad = torch.arange(24.0).reshape(6, 4).t()  # a transposed, non-contiguous gradient
    optimizer.step()
    torch.testing.assert_close(p.detach(), expected)


def test_op_checks_its_arguments():
    op = torch.ops.torch_bigbatch.sgd_step_
    with pytest.raises(RuntimeError, match="must have the same length"):
        op(**{**op_args("cpu"), "grads": op_args("cpu")["grads"][:2]})
    with pytest.raises(RuntimeError, match="every per-group list must have 2 entries"):
        op(**{**op_args("cpu"), "momentum": [0.9]})
    with pytest.raises(RuntimeError, match="group_of_tensor\\[2\\] = 5"):
        op(**{**op_args("cpu"), "group_of_tensor": [0, 1, 5]})
    with pytest.raises(RuntimeError, match="grads\\[1\\].*does not match params\\[1\\]"):
        args = op_args("cpu")
        args["grads"][1] = args["grads"][1].t()
        op(**args)
    with pytest.raises(RuntimeError, match="first_step needs momentum_buffers"):
        op(**{**op_args("cpu", with_buffers=False), "first_step": True})
    with pytest.raises(RuntimeError, match="grad_scale must be a one-element float32 tensor"):
        op(**{**op_args("cpu"), "grad_scale": torch.ones(2)})
    with pytest.raises(RuntimeError, match="must be dense"):
        args = op_args("cpu")
        base = torch.randn(33, 2)
        args["params"][0], args["grads"][0], args["momentum_buffers"][0] = (
            base[:, 0], torch.randn(66)[::2], torch.randn(66)[::2])
        op(**args)


class _RecordingMode(torch.utils._python_dispatch.TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.ops = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops.append(str(func))
        return func(*args, **(kwargs or {}))


class _RecordingFunctionMode(torch.overrides.TorchFunctionMode):
    def __init__(self):
        super().__init__()
        self.functions = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        self.functions.append(str(func))
        return func(*args, **(kwargs or {}))


class _RecordingTensor(torch.Tensor):
    """A parameter type with a __torch_function__ of its own: it must see the step's op."""
    seen = []

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        cls.seen.append(str(func))
        return super().__torch_function__(func, types, args, kwargs or {})


def test_eager_steps_call_the_kernel_directly_and_whatever_must_see_the_op_sees_it(monkeypatch):
    """An eager step calls the kernel without torch's dispatcher (torch_bigbatch._C.sgd_step_,
    half the op's host cost); under a dispatch mode, and for a parameter type with its own
    __torch_function__, the step goes through the op, which they then see. Every way steps as
    torch.optim.SGD does."""
    direct_calls = []
    module = bb.optim.sgd._C

    class CountingC:
        def sgd_step_(self, *args, **kwargs):
            direct_calls.append(1)
            return module.sgd_step_(*args, **kwargs)

    monkeypatch.setattr(bb.optim.sgd, "_C", CountingC())

    def step(weight, mode=None):
        optimizer = bb.optim.SGD([weight], lr=0.1, momentum=0.9)
        expected = weight.detach().clone().requires_grad_()
        reference = torch.optim.SGD([expected], lr=0.1, momentum=0.9)
        for _ in range(2):
            weight.grad, expected.grad = torch.ones(3), torch.ones(3)
            if mode is None:
                optimizer.step()
            else:
                with mode:
                    optimizer.step()
            reference.step()
        torch.testing.assert_close(weight.detach().as_subclass(torch.Tensor), expected.detach())

    step(torch.nn.Parameter(torch.zeros(3)))
    assert len(direct_calls) == 2
    mode = _RecordingMode()
    step(torch.nn.Parameter(torch.zeros(3)), mode)
    assert len(direct_calls) == 2
    assert mode.ops.count("torch_bigbatch.sgd_step_.default") == 2
    function_mode = _RecordingFunctionMode()
    step(torch.nn.Parameter(torch.zeros(3)), function_mode)
    assert len(direct_calls) == 2
    assert function_mode.functions.count("torch_bigbatch.sgd_step_") == 2
    step(torch.zeros(3).as_subclass(_RecordingTensor).requires_grad_())
    assert len(direct_calls) == 2
    assert _RecordingTensor.seen.count("torch_bigbatch.sgd_step_") == 2
    # A gradient of such a type, where the step before had a plain one (the launches are kept).
    weight = torch.nn.Parameter(torch.zeros(3))
    optimizer = bb.optim.SGD([weight], lr=0.1, momentum=0.9)
    for grad in (torch.ones(3), torch.ones(3), torch.ones(3).as_subclass(_RecordingTensor)):
        weight.grad = grad
        optimizer.step()
    assert len(direct_calls) == 4
    assert _RecordingTensor.seen.count("torch_bigbatch.sgd_step_") == 3


def test_the_profiler_names_the_step():
    """The direct call records the op's name, as the op does."""
    weight = torch.zeros(3, requires_grad=True)
    weight.grad = torch.ones(3)
    optimizer = bb.optim.SGD([weight], lr=0.1, momentum=0.9)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as profile:
        optimizer.step()
    assert [event.name for event in profile.events()].count("torch_bigbatch::sgd_step_") == 1


def test_gradients_the_dispatcher_resolves_first_step_as_torchs():
    """A gradient without memory of its own (torch.sgn's: a zero tensor) or lazily negated
    reaches the kernel as the dispatcher resolves it (the direct call read a null pointer and
    crashed the process, or took -1 for 1)."""
    def sgn_gradient(weight):
        (torch.sgn(weight) * torch.arange(4.0)).sum().backward()
        assert weight.grad._is_zerotensor()

    def negated_gradient(weight):
        weight.grad = torch._neg_view(torch.ones(4))

    for set_gradient in (sgn_gradient, negated_gradient):
        weight = torch.nn.Parameter(torch.arange(4.0) - 1.5)
        expected = torch.nn.Parameter(weight.detach().clone())
        ours = bb.optim.SGD([weight], lr=0.1, momentum=0.9, weight_decay=0.1)
        theirs = torch.optim.SGD([expected], lr=0.1, momentum=0.9, weight_decay=0.1)
        for _ in range(3):
            for parameter, optimizer in ((weight, ours), (expected, theirs)):
                optimizer.zero_grad()
                set_gradient(parameter)
                optimizer.step()
        torch.testing.assert_close(weight.detach(), expected.detach(), rtol=1e-6, atol=1e-7)
