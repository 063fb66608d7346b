"""The "torus" backend against Gloo's own collectives, on real processes over loopback."""

import datetime
import os
import time

import pytest
import torch
import torch.distributed as dist

import torch_bigbatch  # noqa: F401  (registers backend "torus")
from torch_bigbatch.distributed import TorusOptions, resolve_shape, torus_shape

from conftest import CUDA, needs_cuda
from multiprocess import run_ranks

OPS = ["SUM", "AVG", "MAX", "MIN", "PRODUCT"]
DTYPES = [torch.float32, torch.float64, torch.int64, torch.bfloat16]
SIZES = [1, 7, 1_000_003]
SMALL_SEGMENTS = 64 << 10  # 1,000,003 fp32 values make 62 segments


def init(rank, world_size, port, options=None, seconds=30):
    torch.set_num_threads(1)
    dist.init_process_group("torus", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world_size, pg_options=options,
                            timeout=datetime.timedelta(seconds=seconds))


def rank_data(rank, numel, dtype, op, seed):
    generator = torch.Generator().manual_seed(seed * 1000 + rank)
    if dtype == torch.int64:
        low, high = (1, 3) if op == "PRODUCT" else (-50, 50)
        return torch.randint(low, high, (numel,), generator=generator)
    values = torch.rand(numel, generator=generator, dtype=torch.float64)
    values = values + 0.5 if op == "PRODUCT" else values * 4 - 2
    return values.to(dtype)


def check_close(actual, expected, dtype, what):
    if dtype == torch.int64 or what.startswith(("MAX", "MIN")):
        assert torch.equal(actual, expected), what
    else:
        tolerance = 1e-5 if dtype == torch.float32 else 1e-12
        torch.testing.assert_close(actual, expected, rtol=tolerance, atol=tolerance, msg=what)


def check_bfloat16(actual, inputs, op, world_size, what):
    """bf16 sums round at every step, in an order that differs from Gloo's: compare with the
    exact float64 result of the same bf16 inputs, within the bound of world_size roundings."""
    exact = {"SUM": inputs.sum(0), "AVG": inputs.mean(0), "PRODUCT": inputs.prod(0)}[op]
    scale = inputs.abs().sum(0) / (world_size if op == "AVG" else 1)
    if op == "PRODUCT":
        scale = exact.abs()
    bound = world_size * 2.0**-8 * scale
    error = (actual.double() - exact).abs()
    assert bool((error <= bound).all()), f"{what}: error {(error - bound).max().item():.3g} over"


def allreduce_matches_gloo(rank, world_size, port, shape):
    init(rank, world_size, port, TorusOptions(shape=shape, segment_bytes=64 << 20))
    paths = {"unsegmented": dist.group.WORLD,
             "segmented": dist.new_group(backend="torus", pg_options=TorusOptions(
                 shape=shape, segment_bytes=SMALL_SEGMENTS))}
    gloo = dist.new_group(backend="gloo")
    assert torus_shape() == shape
    checked = 0
    for path, group in paths.items():
        for dtype in DTYPES:
            for op in OPS:
                if op == "AVG" and dtype == torch.int64:
                    continue
                for numel in SIZES:
                    mine = rank_data(rank, numel, dtype, op, seed=numel)
                    expected = mine.clone()
                    dist.all_reduce(mine, op=getattr(dist.ReduceOp, op), group=group)
                    what = f"{op} {dtype} n={numel} {path}"
                    if dtype == torch.bfloat16 and op not in ("MAX", "MIN"):
                        inputs = torch.empty(world_size * numel, dtype=dtype)
                        dist.all_gather_into_tensor(inputs, expected, group=gloo)
                        check_bfloat16(mine, inputs.view(world_size, numel).double(), op,
                                       world_size, what)
                        checked += 1
                        continue
                    gloo_op = dist.ReduceOp.SUM if op == "AVG" else getattr(dist.ReduceOp, op)
                    dist.all_reduce(expected, op=gloo_op, group=gloo)
                    if op == "AVG":
                        expected = (expected.double() / world_size).to(dtype)
                    check_close(mine, expected, dtype, what)
                    checked += 1
        # A non-contiguous view: the result lands in the view, the rest is untouched.
        base = rank_data(rank, 3000, torch.float32, "SUM", seed=5).view(100, 30)
        view, untouched = base[:, ::3], base[:, 1::3].clone()
        expected = view.contiguous()
        dist.all_reduce(view, group=group)
        dist.all_reduce(expected, group=gloo)
        check_close(view, expected, torch.float32, f"SUM non-contiguous {path}")
        assert torch.equal(base[:, 1::3], untouched)
        # allreduce_coalesced: one flattened buffer for several tensors.
        tensors = [rank_data(rank, n, torch.float64, "SUM", seed=n) for n in (5, 1001, 3)]
        expected = [t.clone() for t in tensors]
        dist.all_reduce_coalesced(tensors, group=group)
        for mine, theirs in zip(tensors, expected):
            dist.all_reduce(theirs, group=gloo)
            check_close(mine, theirs, torch.float64, f"coalesced {path}")
    return checked


@pytest.mark.parametrize("shape", [(1, 4), (4, 1), (2, 2), (2, 3), (3, 2), (2, 4)],
                         ids=lambda s: f"{s[0]}x{s[1]}")
def test_allreduce_equals_gloo(shape):
    checked = run_ranks(allreduce_matches_gloo, shape[0] * shape[1], shape, deadline=240)
    assert checked[0] == 2 * 3 * (4 * 5 - 1)


def collectives_and_subgroups(rank, world_size, port):
    init(rank, world_size, port)
    assert torus_shape() == (2, 2)
    dist.barrier()
    value = torch.tensor([rank * 10.0, 1.0])
    dist.broadcast(value, src=2)
    assert value.tolist() == [20.0, 1.0]
    gathered = torch.empty(world_size * 2)
    dist.all_gather_into_tensor(gathered, torch.tensor([rank, -rank], dtype=torch.float32))
    assert gathered.tolist() == [0.0, 0.0, 1.0, -1.0, 2.0, -2.0, 3.0, -3.0]
    scattered = torch.empty(2)
    dist.reduce_scatter_tensor(scattered, torch.arange(8, dtype=torch.float32) * (rank + 1))
    assert scattered.tolist() == [2 * rank * 10.0, (2 * rank + 1) * 10.0]
    # A prime subset: 1x3. Its ranks take part; rank 0 is not a member.
    subset = dist.new_group([1, 2, 3], backend="torus")
    if rank != 0:
        assert torus_shape(subset) == (1, 3)
        numbers = torch.full((10,), float(rank))
        dist.all_reduce(numbers, group=subset)
        assert numbers.tolist() == [6.0] * 10
    pair = dist.new_group([0, 3], backend="torus", pg_options=TorusOptions(shape="2x1"))
    if rank in (0, 3):
        assert torus_shape(pair) == (2, 1)
        numbers = torch.arange(5.0) + rank
        dist.all_reduce(numbers, op=dist.ReduceOp.MAX, group=pair)
        assert numbers.tolist() == (torch.arange(5.0) + 3).tolist()
    dist.barrier()
    return dist.get_backend()


def test_collectives_and_subgroups():
    assert run_ranks(collectives_and_subgroups, 4) == ["torus"] * 4


class SmallConvNet(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.features = torch.nn.Sequential(
            torch.nn.Conv2d(1, 4, 3, padding=1), torch.nn.ReLU(), torch.nn.MaxPool2d(2),
            torch.nn.Conv2d(4, 8, 3, padding=1), torch.nn.ReLU(), torch.nn.AdaptiveAvgPool2d(2))
        self.classifier = torch.nn.Linear(32, 10)

    def forward(self, x):
        return self.classifier(self.features(x).flatten(1))


def train(model, batches, steps):
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    for step in range(steps):
        inputs, labels = batches[step]
        optimizer.zero_grad()
        torch.nn.functional.cross_entropy(model(inputs), labels).backward()
        optimizer.step()
    return torch.cat([p.detach().flatten() for p in model.parameters()])


def global_batches(steps, batch):
    generator = torch.Generator().manual_seed(7)
    return [(torch.randn(batch, 1, 12, 12, generator=generator, dtype=torch.float64),
             torch.randint(0, 10, (batch,), generator=generator)) for _ in range(steps)]


def ddp_training(rank, world_size, port):
    # Small buckets, so DDP issues several allreduces that overlap the backward pass.
    init(rank, world_size, port, TorusOptions(segment_bytes=256))
    gloo = dist.new_group(backend="gloo")
    torch.manual_seed(0)
    reference = SmallConvNet().double()
    steps, batch = 4, 16
    shard = slice(rank * batch // world_size, (rank + 1) * batch // world_size)
    batches = [(x[shard], y[shard]) for x, y in global_batches(steps, batch)]
    result = {}
    for name, group in (("torus", None), ("gloo", gloo)):
        model = SmallConvNet().double()
        model.load_state_dict(reference.state_dict())
        ddp = torch.nn.parallel.DistributedDataParallel(model, process_group=group,
                                                        bucket_cap_mb=0.001)
        result[name] = train(ddp, batches, steps).tolist()  # tensors cannot outlive the rank
    return result


def test_ddp_matches_gloo_and_one_process():
    results = run_ranks(ddp_training, 4)
    torch.manual_seed(0)
    whole_batch = train(SmallConvNet().double(), global_batches(4, 16), 4)
    torch.manual_seed(0)
    initial = torch.cat([p.detach().flatten() for p in SmallConvNet().double().parameters()])
    for rank, result in enumerate(results):
        torus, gloo = (torch.tensor(result[name], dtype=torch.float64) for name in ("torus", "gloo"))
        torch.testing.assert_close(torus, gloo, rtol=1e-6, atol=1e-6,
                                   msg=f"rank {rank}: torus vs gloo")
        torch.testing.assert_close(torus, whole_batch, rtol=1e-6, atol=1e-6,
                                   msg=f"rank {rank}: torus vs one process")
    assert (whole_batch - initial).abs().max() > 1e-3  # the steps moved the parameters


def size_mismatch(rank, world_size, port):
    init(rank, world_size, port, seconds=5)
    start = time.monotonic()
    tensor = torch.ones(1000 + (rank == 1) * 500)
    try:
        dist.all_reduce(tensor)
    except RuntimeError as error:
        return time.monotonic() - start, str(error)
    return time.monotonic() - start, None


def killed_rank(rank, world_size, port):
    init(rank, world_size, port, seconds=5)
    dist.all_reduce(torch.ones(10))  # every group is connected
    if rank == 3:
        os._exit(1)
    time.sleep(0.5)
    start = time.monotonic()
    try:
        dist.all_reduce(torch.ones(100_000))
    except RuntimeError as error:
        return time.monotonic() - start, str(error)
    return time.monotonic() - start, None


def test_killed_rank_ends_in_errors_within_timeout():
    outcomes = run_ranks(killed_rank, 4, deadline=60, allow_missing=(3,))
    assert outcomes[3] == ("exited", 1)
    for rank, (seconds, message) in enumerate(outcomes[:3]):
        assert message is not None, f"rank {rank} returned a result despite the fault"
        assert seconds < 5 + 3, f"rank {rank} failed after {seconds:.1f} s (timeout 5 s)"
        assert "torus allreduce" in message and ("row" in message or "column" in message), message


def test_size_mismatch_ends_every_rank_within_timeout():
    """Gloo's transport aborts a process that receives more bytes than it posted (plain Gloo
    does the same): such ranks exit with SIGABRT; every other rank raises an error that names
    the torus phase. No rank returns a result, none hangs."""
    outcomes = run_ranks(size_mismatch, 4, deadline=60, allow_missing=range(4))
    raised = 0
    for rank, outcome in enumerate(outcomes):
        if outcome[0] == "exited":
            assert outcome[1] == -6, f"rank {rank} exited with {outcome[1]}"
            continue
        seconds, message = outcome
        assert message is not None, f"rank {rank} returned a result despite the fault"
        assert seconds < 5 + 3, f"rank {rank} failed after {seconds:.1f} s (timeout 5 s)"
        assert "torus allreduce" in message, message
        raised += 1
    assert raised > 0


def shape_mismatch(rank, world_size, port):
    try:
        init(rank, world_size, port, TorusOptions(shape="3x3"))
    except ValueError as error:
        return str(error)


def test_shape_that_does_not_match_is_a_value_error():
    for message in run_ranks(shape_mismatch, 2):
        assert "3x3" in message and "group size 2" in message, message


def test_resolve_shape(monkeypatch):
    monkeypatch.delenv("TORCH_BIGBATCH_TORUS", raising=False)
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    assert resolve_shape(16) == (4, 4)
    assert resolve_shape(8) == (2, 4)
    assert resolve_shape(12) == (3, 4)
    assert resolve_shape(7) == (1, 7)
    assert resolve_shape(1) == (1, 1)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "8")
    assert resolve_shape(32) == (8, 4)
    assert resolve_shape(12) == (3, 4)  # 8 does not divide 12: nearest square
    monkeypatch.setenv("TORCH_BIGBATCH_TORUS", "4x8")
    assert resolve_shape(32, world_size=32) == (4, 8)
    assert resolve_shape(8, world_size=32) == (8, 1)  # a subgroup: LOCAL_WORLD_SIZE rule
    assert resolve_shape(32, shape=(2, 16), world_size=32) == (2, 16)  # pg_options win
    with pytest.raises(ValueError, match="4x8.*group size 16"):
        resolve_shape(16, world_size=16)
    with pytest.raises(ValueError, match='"XxY"'):
        resolve_shape(4, shape="4by1")


def test_options_are_checked():
    with pytest.raises(ValueError, match="segment_bytes"):
        TorusOptions(segment_bytes=0)
    with pytest.raises(ValueError, match="flat_threshold_bytes"):
        TorusOptions(flat_threshold_bytes=-1)


def cuda_world_of_one(rank, world_size, port):
    init(rank, world_size, port)
    on_gpu = torch.arange(10.0, device="cuda")
    dist.all_reduce(on_gpu, op=dist.ReduceOp.AVG)
    on_cpu = torch.arange(10.0)
    dist.all_reduce(on_cpu)
    torch.cuda.synchronize()
    return on_gpu.cpu().tolist(), on_cpu.tolist()


@CUDA
@needs_cuda
def test_cuda_and_cpu_tensors_at_world_size_one():
    """One GPU: NCCL runs one rank, so this is the CUDA test a one-GPU machine can run."""
    on_gpu, on_cpu = run_ranks(cuda_world_of_one, 1)[0]
    assert on_gpu == on_cpu == [float(i) for i in range(10)]
