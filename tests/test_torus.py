"""The "torus" backend against Gloo's own collectives, on real processes over loopback."""

import dataclasses
import datetime
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time

import pytest
import torch
import torch.distributed as dist

import torch_bigbatch  # noqa: F401  (registers backend "torus")
from torch_bigbatch.distributed.torus import _attempt_store, _compare
from torch_bigbatch.distributed import (TorusOptions, resolve_shape,
                                        save_torus_algorithm_table, torus_algorithm,
                                        torus_algorithm_table, torus_allreduce_counts,
                                        torus_shape)

from conftest import CUDA, needs_cuda, process_environment
from multiprocess import free_port, run_ranks

OPS = ["SUM", "AVG", "MAX", "MIN", "PRODUCT"]
DTYPES = [torch.float32, torch.float64, torch.int64, torch.bfloat16]
SIZES = [1, 7, 1_000_003]
SMALL_SEGMENTS = 64 << 10  # 1,000,003 fp32 values make 62 segments


def init(rank, world_size, port, options=None, seconds=30):
    torch.set_num_threads(1)
    dist.init_process_group("torus", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world_size, pg_options=options,
                            timeout=datetime.timedelta(seconds=seconds))


def init_with_group(rank, world_size, port, options=None, seconds=3):
    """The group under test, of every rank, with a short timeout (`seconds`), beside a default
    group with a long one: the default group's timeout is also its rendezvous's, and a rank
    whose start a loaded machine delays by that much would fail before anything is tested."""
    init(rank, world_size, port, seconds=60)
    return dist.new_group(backend="torus", pg_options=options,
                          timeout=datetime.timedelta(seconds=seconds))


# Calls of a CPU size class up to 256 KiB until it is decided: 3 candidates x 5 trial calls, 16
# flat while the ranks agree (kCallsWhileAgreeing), the deciding call.
CALLS_TO_DECIDE = 15 + 16 + 1


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
    """Every path: small buffers in two exchanges, larger ones in up to four, in one segment or
    in many, and the whole group's own allreduce ("flat", with AVG divided by the torus)."""
    init(rank, world_size, port, TorusOptions(shape=shape, algorithm="torus",
                                              segment_bytes=64 << 20))
    paths = {"unsegmented": dist.group.WORLD,
             "segmented": dist.new_group(backend="torus", pg_options=TorusOptions(
                 shape=shape, algorithm="torus", segment_bytes=SMALL_SEGMENTS)),
             "flat": dist.new_group(backend="torus", pg_options=TorusOptions(
                 shape=shape, algorithm="flat"))}
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
        # float16 AVG whose sum over the ranks passes float16's largest value (65504; 4096 *
        # world_size**2 here): divided first on every path, so the mean comes back, not inf
        # (1 and 1000 values: the one-shot form where the path has one; 200,000: four phases;
        # a strided view: reduced as a copy, the result in the view, the rest untouched).
        mean = 4096.0 * world_size
        matrix = torch.full((400, 1000), mean, dtype=torch.float16)
        view, untouched = matrix[:, ::2], matrix[:, 1::2].clone()
        for large in (torch.full((1,), mean, dtype=torch.float16),
                      torch.full((1000,), mean, dtype=torch.float16),
                      torch.full((200_000,), mean, dtype=torch.float16), view):
            dist.all_reduce(large, op=dist.ReduceOp.AVG, group=group)
            assert torch.equal(large, torch.full_like(large, mean)), \
                f"AVG float16 {tuple(large.shape)} {path}: {large.flatten()[:3].tolist()}"
        assert torch.equal(matrix[:, 1::2], untouched)
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
@pytest.mark.slow
def test_allreduce_equals_gloo(shape):
    checked = run_ranks(allreduce_matches_gloo, shape[0] * shape[1], shape, deadline=300)
    assert checked[0] == 3 * 3 * (4 * 5 - 1)


def results_of_every_rank(rank, world_size, port, shape):
    """Float sums and products in the one-shot form (1000 values) and in segments (100,003),
    and MIN and MAX of zeros of either sign: how many elements of each rank's result differ
    in their bits from rank 0's, as Gloo gathers them."""
    init(rank, world_size, port, TorusOptions(shape=shape, algorithm="torus",
                                              segment_bytes=SMALL_SEGMENTS))
    gloo = dist.new_group(backend="gloo")
    differing = {}
    for numel in (1000, 100_003):
        for op in ("SUM", "PRODUCT", "MIN", "MAX"):
            mine = rank_data(rank, numel, torch.float32, op, seed=numel)
            if op in ("MIN", "MAX"):  # +0 or -0 at random: equal, but not in their bits
                mine = torch.zeros(numel).copysign(mine - 0.5)
            dist.all_reduce(mine, op=getattr(dist.ReduceOp, op))
            results = [torch.empty_like(mine) for _ in range(world_size)]
            dist.all_gather(results, mine, group=gloo)
            bits = [r.view(torch.int32) for r in results]
            differing[f"{op} n={numel}"] = [int((b != bits[0]).sum()) for b in bits]
    return differing


@pytest.mark.parametrize("shape", [(4, 1), (1, 4), (3, 2), (2, 2)],
                         ids=lambda s: f"{s[0]}x{s[1]}")
@pytest.mark.slow
def test_every_rank_gets_the_same_bits(shape):
    """A float sum depends on its order, MIN and MAX of +0 and -0 on the operands': every rank
    reduces the members' values in member order, so DDP's replicas stay identical (adding its
    own first, ranks of a row of 4 differed in 4 of 10 sums, and DDP's replicas drifted)."""
    world_size = shape[0] * shape[1]
    differing = run_ranks(results_of_every_rank, world_size, shape, deadline=120)[0]
    assert differing == {what: [0] * world_size for what in differing}, differing


def segments_smaller_than_a_row(rank, world_size, port, shape):
    """Segments of a few elements: some members' parts (and pieces) are empty, and both sides
    of every direct exchange must skip the same ones."""
    init(rank, world_size, port, TorusOptions(shape=shape, algorithm="torus", segment_bytes=8))
    gloo = dist.new_group(backend="gloo")
    checked = []
    for numel, op in ((37, "SUM"), (1001, "MAX"), (5, "AVG")):
        mine = rank_data(rank, numel, torch.float64, op, seed=numel)
        expected = mine.clone()
        dist.all_reduce(mine, op=getattr(dist.ReduceOp, op))
        dist.all_reduce(expected, op=dist.ReduceOp.SUM if op == "AVG" else getattr(
            dist.ReduceOp, op), group=gloo)
        if op == "AVG":
            expected /= world_size
        check_close(mine, expected, torch.float64, f"{op} n={numel}")
        checked.append(numel)
    return checked


@pytest.mark.parametrize("shape", [(4, 1), (2, 2), (1, 4), (2, 3)], ids=lambda s: f"{s[0]}x{s[1]}")
@pytest.mark.slow
def test_segments_smaller_than_a_row(shape):
    world_size = shape[0] * shape[1]
    assert run_ranks(segments_smaller_than_a_row, world_size, shape,
                     deadline=120) == [[37, 1001, 5]] * world_size


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
    # Handed to the whole group: a future's value, a receive from any source (its sender),
    # an async barrier.
    work = dist.all_gather([torch.empty(2) for _ in range(world_size)],
                           torch.full((2,), float(rank)), async_op=True)
    assert [t.tolist() for t in work.get_future().wait()] == [[r, r] for r in range(4)]
    assert work.wait() and work.is_completed()
    if rank == 0:
        received = torch.empty(1)
        assert dist.recv(received) == 3 and received.item() == 7.0
    elif rank == 3:
        dist.send(torch.tensor([7.0]), dst=0)
    barrier = dist.barrier(async_op=True)
    assert barrier.wait() and barrier.is_completed()
    # Empty tensors of every kind reduce to empty tensors.
    for empty in (torch.empty(0), torch.empty(0, dtype=torch.int64),
                  torch.empty(0, dtype=torch.bool), torch.empty(0, 3)[:, ::2]):
        shape = empty.shape
        dist.all_reduce(empty)
        assert empty.shape == shape
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


@pytest.mark.slow
def test_collectives_and_subgroups():
    assert run_ranks(collectives_and_subgroups, 4) == ["torus"] * 4


def barrier_after_async_allreduces(rank, world_size, port, algorithm):
    """Each round: async allreduces of 16 MiB and of an odd, non-contiguous view (reduced as a
    copy, written back by the torus), then a barrier; what the barrier returned after."""
    init(rank, world_size, port, TorusOptions(algorithm=algorithm))
    seen = []
    for round_ in range(4):
        big = torch.full((4 << 20,), rank + 1.0 + round_)
        strided = torch.full((1001, 2), float(rank))[:, 0]
        works = [dist.all_reduce(big, async_op=True),
                 dist.all_reduce(strided, op=dist.ReduceOp.AVG, async_op=True)]
        dist.barrier()
        seen.append((all(work.is_completed() for work in works),
                     bool((big == 2 * round_ + 3.0).all()), bool((strided == 0.5).all())))
        for work in works:
            work.wait()
    return seen


@pytest.mark.parametrize("algorithm", ["torus", "flat"])
def test_a_barrier_ends_after_the_ranks_earlier_allreduces(algorithm):
    """A barrier ends after every collective this rank issued before it, as Gloo's. The torus
    runs its own in its row and column groups, which the whole group's barrier did not wait
    for: `allreduce(async_op=True); barrier()` then read a half-summed tensor (in a review's
    run of 5 rounds, 4 on rank 1)."""
    assert run_ranks(barrier_after_async_allreduces, 2, algorithm,
                     deadline=120) == [[(True, True, True)] * 4] * 2


def allreduce_beside_a_stale_master_addr(rank, world_size, port):
    """A MASTER_ADDR left in the environment that the init_method URL overrides: Gloo ignores
    it; the torus routed its device towards it and failed with a bare socket.gaierror."""
    os.environ["MASTER_ADDR"] = "stale-host.invalid"
    init(rank, world_size, port)
    numbers = torch.arange(6.0) * (rank + 1)
    dist.all_reduce(numbers)
    return numbers.tolist()


def test_the_rendezvous_host_comes_from_the_init_method_not_a_stale_master_addr():
    expected = (torch.arange(6.0) * 3).tolist()
    assert run_ranks(allreduce_beside_a_stale_master_addr, 2, deadline=60) == [expected] * 2


def init_with_a_master_addr_on_rank_1_only(rank, world_size, port, store_path):
    """A file:// rendezvous: rank 1 routes towards MASTER_ADDR, an unknown name; rank 0 has
    none. The rank that raised alone left rank 0 in Gloo's rendezvous for the whole timeout."""
    os.environ.pop("MASTER_ADDR", None)
    if rank == 1:
        os.environ["MASTER_ADDR"] = "stale-host.invalid"
    start = time.monotonic()
    try:
        dist.init_process_group("torus", init_method=f"file://{store_path}", rank=rank,
                                world_size=world_size, timeout=datetime.timedelta(seconds=30))
    except RuntimeError as error:
        return time.monotonic() - start, str(error)
    return time.monotonic() - start, None


def test_a_rank_without_a_route_to_the_rendezvous_host_stops_every_rank(tmp_path):
    outcomes = run_ranks(init_with_a_master_addr_on_rank_1_only, 2, str(tmp_path / "store"),
                         deadline=60)
    for seconds, message in outcomes:
        assert message is not None and seconds < 15, (seconds, message)
        assert "not every rank can reach the rendezvous host" in message, message
        assert "rank 1 no route to 'stale-host.invalid'" in message, message


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


def ddp_replicas(rank, world_size, steps, batch=16):
    """(group name, the group, a copy of one initial SmallConvNet) for the torus and for Gloo,
    and this rank's share of each step's global batch."""
    gloo = dist.new_group(backend="gloo")
    torch.manual_seed(0)
    reference = SmallConvNet().double()
    replicas = []
    for name, group in (("torus", dist.group.WORLD), ("gloo", gloo)):
        model = SmallConvNet().double()
        model.load_state_dict(reference.state_dict())
        replicas.append((name, group, model))
    shard = slice(rank * batch // world_size, (rank + 1) * batch // world_size)
    return replicas, [(x[shard], y[shard]) for x, y in global_batches(steps, batch)]


def ddp_training(rank, world_size, port):
    # Small buckets, so DDP issues several allreduces that overlap the backward pass.
    init(rank, world_size, port, TorusOptions(segment_bytes=256))
    steps = 4
    replicas, batches = ddp_replicas(rank, world_size, steps)
    result = {}
    for name, group, model in replicas:
        ddp = torch.nn.parallel.DistributedDataParallel(model, process_group=group,
                                                        bucket_cap_mb=0.001)
        result[name] = train(ddp, batches, steps).tolist()  # tensors cannot outlive the rank
    return result


@pytest.mark.slow
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


def powersgd_training(rank, world_size, port):
    from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as powersgd
    init(rank, world_size, port, TorusOptions(algorithm="torus"), seconds=20)
    steps = 5
    replicas, batches = ddp_replicas(rank, world_size, steps)
    result = {}
    for name, group, model in replicas:
        ddp = torch.nn.parallel.DistributedDataParallel(model, process_group=group)
        state = powersgd.PowerSGDState(process_group=group, matrix_approximation_rank=1,
                                       start_powerSGD_iter=2, min_compression_rate=0.5)
        ddp.register_comm_hook(state, powersgd.powerSGD_hook)
        result[name] = train(ddp, batches, steps).tolist()
    result["allreduces"] = torus_allreduce_counts()
    return result


def allreduce_in_a_callback(rank, world_size, port, interop_threads):
    if interop_threads:
        torch.set_num_interop_threads(interop_threads)
    init(rank, world_size, port, TorusOptions(algorithm="torus"), seconds=20)
    big = torch.full((4_000_000,), float(rank + 1))  # still running when the callback is added
    small = torch.full((1000,), float(rank + 1))

    def next_allreduce(future):
        dist.all_reduce(small, async_op=True).get_future().wait()
        return small.sum().item()

    chained = dist.all_reduce(big, async_op=True).get_future().then(next_allreduce)
    return chained.wait(), big[0].item(), big[-1].item()


@pytest.mark.parametrize("world_size, interop_threads", [(2, None), (4, None), (2, 1)])
def test_a_callback_may_wait_for_another_allreduce(world_size, interop_threads):
    # As PowerSGD's hook does: a call's callbacks must not run on a thread the next call needs,
    # nor hold the last free thread of a pool it needs (torch's inter-op pool has one thread
    # after set_num_interop_threads(1)).
    total = world_size * (world_size + 1) / 2
    for result in run_ranks(allreduce_in_a_callback, world_size, interop_threads, deadline=60):
        assert result == (1000 * total, total, total)


def callbacks_that_wait(rank, world_size, port, algorithm):
    init(rank, world_size, port, TorusOptions(algorithm=algorithm), seconds=20)
    # Two calls still running when their callbacks are added, so the callbacks run where the
    # calls end (not on this thread), both at once; each waits for another allreduce. Equal
    # values: whichever pairing two ranks' nested calls get, the sums are the same.
    bigs = [torch.full((4_000_000,), float(rank + 1)) for _ in range(2)]
    smalls = [torch.full((1000,), float(rank + 1)) for _ in range(2)]

    def waits_for(small):
        def callback(future):
            dist.all_reduce(small, async_op=True).get_future().wait()
            return small.sum().item()
        return callback

    futures = [dist.all_reduce(big, async_op=True).get_future() for big in bigs]
    chained = [future.then(waits_for(small)) for future, small in zip(futures, smalls)]
    return [future.wait() for future in chained], [big[0].item() for big in bigs]


@pytest.mark.parametrize("algorithm", ["flat", "torus"])
def test_callbacks_may_wait_for_allreduces_whatever_the_algorithm(algorithm):
    # The whole group's own allreduce ("flat", which "auto" may pick) too: its callbacks once ran
    # on Gloo's two worker threads, and two callbacks waiting there left no thread for the
    # allreduces they waited for (nor for the tuner's agreement when a nested call decided).
    total = 2 * 3 / 2
    for result in run_ranks(callbacks_that_wait, 2, algorithm, deadline=60):
        assert result == ([1000 * total] * 2, [total] * 2)


@pytest.mark.parametrize("world_size", [2, 4])
def test_ddp_with_powersgd_hook_matches_gloo(world_size):
    results = run_ranks(powersgd_training, world_size, deadline=90)
    torch.manual_seed(0)
    initial = torch.cat([p.detach().flatten() for p in SmallConvNet().double().parameters()])
    for rank, result in enumerate(results):
        torus = torch.tensor(result["torus"], dtype=torch.float64)
        gloo = torch.tensor(result["gloo"], dtype=torch.float64)
        torch.testing.assert_close(torus, gloo, rtol=1e-9, atol=1e-9,
                                   msg=f"rank {rank}: torus vs gloo")
        assert (torus - initial).abs().max() > 1e-3
        # 2 plain steps, then 3 of PowerSGD's: the uncompressed tensors, P and Q, each.
        assert result["allreduces"] == {"cpu torus": 2 + 3 * 3}


def mismatched_first_call(rank, world_size, port, numels, algorithm):
    """Each rank's first allreduce of numels[rank] elements, then a second of 1000 alike (which
    must not pair with another rank's first): (seconds, "<the error's type>: <its message>", or
    None)."""
    group = init_with_group(rank, world_size, port, TorusOptions(algorithm=algorithm), 5)
    # Every rank's groups are connected before any rank can abort (a rank that Gloo aborts
    # resets the connections of a group another rank is still building).
    dist.barrier(group=group)
    start = time.monotonic()
    try:
        dist.all_reduce(torch.ones(numels[rank]), group=group)
        dist.all_reduce(torch.full((1000,), 10.0), group=group)
    except RuntimeError as error:
        return time.monotonic() - start, f"{type(error).__name__}: {error}"
    return time.monotonic() - start, None


def errors_of_failed_ranks(outcomes, timeout):
    """Every rank was aborted by Gloo's transport (receiving more bytes than it posted) or
    raised within the timeout, none returned a result: the errors raised."""
    errors = []
    for rank, outcome in enumerate(outcomes):
        if outcome[0] == "exited":
            assert outcome[1] == -6, f"rank {rank} exited with {outcome[1]}"
            continue
        seconds, message = outcome
        assert message is not None, f"rank {rank} returned a result despite the fault"
        assert seconds < timeout + 3, f"rank {rank} failed after {seconds:.1f} s (timeout {timeout} s)"
        errors.append(message)
    return errors


@pytest.mark.parametrize("algorithm", ["torus", "auto"])
@pytest.mark.slow
def test_an_empty_tensor_on_one_rank_is_an_error_not_a_shifted_call(algorithm):
    """An empty call exchanges its headers too: ended at once, rank 1's next call paired with
    the others' first, and both came back with sums of 13 and no error. Now every rank raises
    within the timeout or, receiving more than it posted, is aborted by Gloo (as for any size
    mismatch)."""
    outcomes = run_ranks(mismatched_first_call, 4, [1000, 0, 1000, 1000], algorithm,
                         deadline=60, allow_missing=range(4))
    # torch.distributed's type for a collective's failure, as the delegated collectives' and
    # NCCL's (were RuntimeError on the host's allreduce)
    for error in errors_of_failed_ranks(outcomes, timeout=5):
        assert error.startswith("DistBackendError: "), error


def callbacks_that_issue_collectives(rank, world_size, port, algorithm):
    """Two allreduces in flight, each with a callback that allreduces a buffer of its own (as
    PowerSGD's hook does per bucket): the nested sums, for 30 rounds. The callbacks are added
    once both are issued (one added to a future that has ended runs at once, on this thread:
    its collective would then come before the second allreduce on this rank only)."""
    init(rank, world_size, port, TorusOptions(algorithm=algorithm), seconds=20)
    sums = []
    for _ in range(30):
        nested = [torch.full((1000,), float(100 * k + rank)) for k in range(2)]

        def callback(k):
            def run(future):
                dist.all_reduce(nested[k], async_op=True).get_future().wait()
                return nested[k][0].item()
            return run

        works = [dist.all_reduce(torch.ones(1_000_000), async_op=True) for _ in range(2)]
        futures = [work.get_future().then(callback(k)) for k, work in enumerate(works)]
        sums.append([future.wait() for future in futures])
    return sums


@pytest.mark.slow
@pytest.mark.parametrize("algorithm", ["torus", "flat"])
def test_callbacks_run_in_the_order_their_collectives_were_issued(algorithm):
    """The Works end in issue order, so the collectives their callbacks issue reach the group
    in one order on every rank (ended on any free thread, two callbacks ran at once and their
    collectives crossed between ranks: sums of [101, 101] for [1, 201], no error)."""
    for rank, sums in enumerate(run_ranks(callbacks_that_issue_collectives, 2, algorithm,
                                          deadline=120)):
        wrong = [s for s in sums if s != [1.0, 201.0]]
        assert not wrong, f"rank {rank}: {len(wrong)} of 30 rounds summed {wrong[:3]}"


def decision_inside_an_earlier_callback(rank, world_size, port):
    """A callback of the first call makes the call of a class that decides it, while the class's
    15 trial calls (and the 16 while the ranks agree) were issued after the first: their
    futures end after that callback, in the delivery order."""
    init(rank, world_size, port, seconds=10)
    issued = threading.Event()
    seconds = []

    def callback(future):
        issued.wait(10)
        start = time.monotonic()
        data = torch.ones(1000)
        dist.all_reduce(data)
        seconds.append(time.monotonic() - start)
        return data[0].item()

    # Large, so that it is still running when its callback is added (a callback added to an
    # ended future runs on this thread, which would wait for `issued` before issuing the trials).
    first = dist.all_reduce(torch.ones(4_000_000), async_op=True).get_future().then(callback)
    trials = [dist.all_reduce(torch.ones(1000), async_op=True)
              for _ in range(CALLS_TO_DECIDE - 1)]
    issued.set()
    value = first.wait()
    for work in trials:
        work.wait()
    return value, seconds[0], torus_algorithm(4000)


@pytest.mark.slow
def test_a_decision_inside_a_callback_does_not_wait_for_the_delivery_order():
    """The tuner times a trial by its Work's end, not by its future (which a decision inside an
    earlier Work's callback would wait for until the timeout, then fail the backend)."""
    for value, seconds, chosen in run_ranks(decision_inside_an_earlier_callback, 2, deadline=60):
        assert value == 2.0 and chosen in ("flat", "torus")
        assert seconds < 5, seconds


# The later call ends first: the earlier one is the whole group's allreduce of 16 MiB.
FLAT_LARGE_TORUS_SMALL = [
    {"device": "cpu", "max_bytes": 16 << 20, "algorithm": "flat"},
    {"device": "cpu", "max_bytes": 4096, "algorithm": "torus", "segment_bytes": 1 << 20,
     "one_shot": False}]
LATE_TIMEOUT = 5  # seconds


def callback_that_waits_for_a_later_call(rank, world_size, port, how):
    """The first call's callback waits for the second call, which ended first (a callback
    thread took it, to end it in its turn, after the first): by its Work or by its future."""
    group = init_with_group(rank, world_size, port, TorusOptions(table=FLAT_LARGE_TORUS_SMALL),
                            LATE_TIMEOUT)
    second = torch.full((1000,), float(rank + 1))
    first = dist.all_reduce(torch.ones(4 << 20), async_op=True, group=group)
    later = dist.all_reduce(second, async_op=True, group=group)
    wait = later.wait if how == "work" else later.get_future().wait

    def callback(future):
        wait()
        return second[0].item()

    chained = first.get_future().then(callback)
    start = time.monotonic()
    try:
        return chained.wait(), time.monotonic() - start, None
    except RuntimeError as error:
        message, seconds = str(error), time.monotonic() - start
    try:  # the next call on this rank
        dist.all_reduce(torch.ones(10), group=group)
        return message, seconds, "returned"
    except RuntimeError as error:
        return message, seconds, str(error)


@pytest.mark.slow
def test_a_callback_may_wait_for_the_work_of_a_later_call():
    """It once waited for ever: the thread that took the later call waited for the first
    call's callbacks to return, and the callback for that thread."""
    for value, seconds, _ in run_ranks(callback_that_waits_for_a_later_call, 2, "work",
                                       deadline=60):
        assert value == 3.0 and seconds < LATE_TIMEOUT, (value, seconds)


@pytest.mark.slow
def test_a_callback_that_waits_for_a_later_calls_future_fails_at_the_timeout():
    """Only the later call's end (in its turn, after the callback) completes its future: the
    later call ends with an error, the backend's failure, once the callback has run for the
    timeout, not never."""
    for message, seconds, next_call in run_ranks(callback_that_waits_for_a_later_call, 2,
                                                 "future", deadline=60):
        assert "ran longer than the timeout" in message, message
        assert LATE_TIMEOUT - 1 < seconds < LATE_TIMEOUT + 5, seconds
        # Recorded as the backend's failure: a later call is refused, not paired wrongly.
        assert next_call.startswith("torus backend is unusable after an earlier failure"), \
            next_call


def callback_that_waits_for_another_groups_later_call(rank, world_size, port):
    """A callback of group A's call waits for group B's second call while B's first call's
    callback still runs: the order of what each call's callbacks saw and did."""
    group_a = init_with_group(rank, world_size, port, TorusOptions(table=FLAT_LARGE_TORUS_SMALL),
                              60)
    group_b = dist.new_group(backend="torus", pg_options=TorusOptions(table=FLAT_LARGE_TORUS_SMALL),
                             timeout=datetime.timedelta(seconds=60))
    events = []
    first_b = dist.all_reduce(torch.ones(4 << 20), async_op=True, group=group_b)
    first_a = dist.all_reduce(torch.ones(4 << 20), async_op=True, group=group_a)
    second_b = dist.all_reduce(torch.ones(1000), async_op=True, group=group_b)

    def slow(future):
        time.sleep(1.0)
        events.append("first B's callback returned")

    def waits(future):
        second_b.wait()
        events.append("second B waited for")

    chained = [first_b.get_future().then(slow), first_a.get_future().then(waits)]
    for future in chained:
        future.wait()
    return events


@pytest.mark.slow
def test_a_callback_of_one_group_waits_for_another_groups_call_in_its_turn():
    """A thread that delivered group A's call once delivered every Work it waited for out of
    turn, group B's too: B's second call's callbacks then ran beside its first call's, and
    collectives they issue could reach B in another order on each rank."""
    for events in run_ranks(callback_that_waits_for_another_groups_later_call, 2, deadline=60):
        assert events == ["first B's callback returned", "second B waited for"], events


def wait_with_a_timeout_behind_a_slow_callback(rank, world_size, port):
    group = init_with_group(rank, world_size, port, TorusOptions(table=FLAT_LARGE_TORUS_SMALL),
                            LATE_TIMEOUT)
    release = threading.Event()
    first = dist.all_reduce(torch.ones(4 << 20), async_op=True, group=group)
    chained = first.get_future().then(lambda future: release.wait(10))
    later = dist.all_reduce(torch.full((1000,), float(rank + 1)), async_op=True, group=group)
    start = time.monotonic()
    try:
        later.wait(timeout=datetime.timedelta(seconds=0.5))
        outcome = "returned"
    except RuntimeError as error:
        outcome = str(error)
    seconds = time.monotonic() - start
    release.set()
    later.wait()
    return outcome, seconds, chained.wait(), later.result()[0][0].item()


@pytest.mark.slow
def test_a_wait_with_a_timeout_is_bounded_by_it_while_an_earlier_callback_runs():
    """The later call's end for its callers waits for the first call's callback: wait(timeout)
    waited for it whatever the timeout. It ends the later call once that callback returned."""
    for outcome, seconds, released, value in run_ranks(
            wait_with_a_timeout_behind_a_slow_callback, 2, deadline=60):
        assert "timed out" in outcome and seconds < 2, (outcome, seconds)
        assert released is True and value == 3.0


def calls_under_a_timeout_of_a_century(rank, world_size, port):
    century = datetime.timedelta(days=36500)
    init(rank, world_size, port, TorusOptions(algorithm="auto"), seconds=century.total_seconds())
    tensors = [torch.full((1000,), float(rank + 1)) for _ in range(CALLS_TO_DECIDE + 8)]
    works = [dist.all_reduce(t, async_op=True) for t in tensors]
    for work in works:
        work.wait(timeout=century)
    return [t[0].item() for t in tensors]


def test_a_timeout_meant_as_never_is_no_deadline_in_the_past():
    """A century's timeout added to the clock's int64 nanoseconds (three times, for the
    deciding call's bound) overflowed into a deadline in the past: the decision failed at
    once, and with it every later call."""
    for values in run_ranks(calls_under_a_timeout_of_a_century, 2, deadline=60):
        assert values == [3.0] * (CALLS_TO_DECIDE + 8)


EXIT_AFTER_FUTURES = """
import datetime, torch, torch.distributed as dist
import socket
import subprocess
import sys
import torch_bigbatch
from torch_bigbatch.distributed import TorusOptions
dist.init_process_group("torus", timeout=datetime.timedelta(seconds=10),
                        pg_options=TorusOptions(algorithm="torus"))
for _ in range(20):  # results read through the futures, as DDP's comm hooks read them
    futures = [dist.all_reduce(torch.ones(n), async_op=True).get_future()
               .then(lambda future: future.value()[0]) for n in (10, 1000, 5000)]
    assert [future.wait()[0].item() for future in futures] == [2.0] * 3
"""


@pytest.mark.slow
def test_a_job_whose_calls_all_ended_exits_cleanly(tmp_path):
    """At exit the torus's threads end what they hold of Python's before the interpreter
    finalizes (a thread that took the GIL later aborted the process: 4 of 16 ranks)."""
    script = tmp_path / "job.py"
    script.write_text(EXIT_AFTER_FUTURES)
    for attempt in range(8):
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            port = probe.getsockname()[1]
        ranks = [subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE,
                                  stderr=subprocess.STDOUT, text=True,
                                  env=process_environment(
                                      RANK=str(rank), WORLD_SIZE="2", MASTER_ADDR="127.0.0.1",
                                      MASTER_PORT=str(port))) for rank in range(2)]
        for rank, process in enumerate(ranks):
            output, _ = process.communicate(timeout=60)
            assert process.returncode == 0, f"attempt {attempt}, rank {rank}: {output[-2000:]}"


JOIN_A_KEPT_STORE = """
import datetime, sys, torch, torch.distributed as dist
import torch_bigbatch
from torch_bigbatch.distributed import TorusOptions
rank, port = int(sys.argv[1]), int(sys.argv[2])
store = dist.TCPStore("127.0.0.1", port, 2, is_master=False,
                      timeout=datetime.timedelta(seconds=10))
dist.init_process_group("torus", store=store, rank=rank, world_size=2,
                        timeout=datetime.timedelta(seconds=10),
                        pg_options=TorusOptions(algorithm="torus"))
values = torch.full((1 << 16,), float(rank + 1))
dist.all_reduce(values)
assert values.eq(3.0).all().item()
dist.destroy_process_group()
"""


def test_restarts_that_keep_the_store_and_restart_count_join_anew(tmp_path):
    """torchrun's rendezvous keeps its store across a job's attempts; a restart for a
    membership change keeps TORCHELASTIC_RESTART_COUNT, and a replaced node's agent counts
    from 0 where the others count on. With keys per restart count, ranks of different counts
    waited on different keys until the timeout, and an attempt of the same count could read the
    one before's addresses (dead ports, now and then). Three attempts on one kept store: each
    joins and sums."""
    script = tmp_path / "join.py"
    script.write_text(JOIN_A_KEPT_STORE)
    port = free_port()
    store = dist.TCPStore("127.0.0.1", port, is_master=True, wait_for_workers=False,
                          timeout=datetime.timedelta(seconds=30))
    for counts in (("0", "0"), ("0", "0"), ("1", "0")):
        ranks = [subprocess.Popen([sys.executable, str(script), str(rank), str(port)],
                                  stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                  env=process_environment(TORCHELASTIC_RESTART_COUNT=count))
                 for rank, count in enumerate(counts)]
        try:
            outputs = [process.communicate(timeout=60)[0] for process in ranks]
        finally:
            for process in ranks:
                process.kill()
        for rank, (process, output) in enumerate(zip(ranks, outputs)):
            assert process.returncode == 0, f"counts {counts}, rank {rank}: {output[-2000:]}"
    del store


def test_a_rank_that_never_joins_fails_rank_0_within_the_timeout():
    store = dist.HashStore()
    store.set("torus/hello/1", "a stale nonce")  # what an earlier attempt left
    started = time.monotonic()
    with pytest.raises(RuntimeError, match=r"ranks \[1\] of 2 did not join within the timeout"):
        _attempt_store(store, 0, 2, datetime.timedelta(seconds=0.5))
    assert time.monotonic() - started < 5


def rank_killed_with_calls_queued(rank, world_size, port):
    """Every rank queues four 32 MiB allreduces in 1 MiB segments; rank 1 is killed once its
    first has ended. Returns when each of a survivor's calls ended, from the first's issue."""
    group = init_with_group(rank, world_size, port,
                            TorusOptions(algorithm="torus", segment_bytes=1 << 20))
    dist.all_reduce(torch.ones(10), group=group)  # every group is connected
    start = time.monotonic()
    works = [dist.all_reduce(torch.ones(8 << 20), async_op=True, group=group) for _ in range(4)]
    if rank == 1:
        works[0].wait()
        os.kill(os.getpid(), signal.SIGKILL)
    ends = []
    for work in works:
        try:
            work.wait()
        except RuntimeError:
            pass
        ends.append(time.monotonic() - start)
    return ends


@pytest.mark.slow
def test_a_dead_peer_costs_the_calls_queued_behind_it_no_timeout_of_their_own():
    """After the first failure every queued phase ends at once (each batch of other segments
    and calls waited a timeout of its own: 65-180 s for a 5 s timeout)."""
    outcomes = run_ranks(rank_killed_with_calls_queued, 4, deadline=90, allow_missing=(1,))
    for rank in (0, 2, 3):
        assert max(outcomes[rank]) < 2 * 3 + 3, f"rank {rank}'s calls ended at {outcomes[rank]}"


def killed_rank(rank, world_size, port, collective):
    """collective: "torus" or "flat" (an allreduce by that algorithm), or "allgather" (one the
    torus hands to its whole group as it is)."""
    algorithm = "auto" if collective == "allgather" else collective
    group = init_with_group(rank, world_size, port, TorusOptions(algorithm=algorithm), 5)
    dist.all_reduce(torch.ones(10), group=group)  # every group is connected
    if rank == 3:
        os._exit(1)
    time.sleep(0.5)
    start = time.monotonic()
    if collective == "allgather":  # its failure through the future and through wait()
        work = dist.all_gather([torch.empty(100_000) for _ in range(world_size)],
                               torch.ones(100_000), async_op=True, group=group)
        messages = []
        for finish in (work.get_future().wait, work.wait):
            try:
                finish()
            except RuntimeError as error:
                messages.append(str(error))
        return time.monotonic() - start, "\n".join(messages) if len(messages) == 2 else None
    try:
        dist.all_reduce(torch.ones(100_000), group=group)
    except RuntimeError as error:
        return time.monotonic() - start, str(error)
    return time.monotonic() - start, None


@pytest.mark.parametrize("collective", ["torus", "flat", "allgather"])
@pytest.mark.slow
def test_killed_rank_ends_in_errors_within_timeout(collective):
    """Every surviving rank raises within the timeout, with the collective, its phase and the
    ranks named."""
    outcomes = run_ranks(killed_rank, 4, collective, deadline=60, allow_missing=(3,))
    assert outcomes[3] == ("exited", 1)
    where = {"torus": ("torus allreduce failed in the reduce-scatter along row",
                       "torus allreduce failed in the reduce-scatter along column",
                       "torus allreduce failed in the allgather along column",
                       "torus allreduce failed in the allgather along row"),
             "flat": ("torus allreduce failed in the allreduce of the whole group",),
             "allgather": ("torus allgather failed in the allgather of the whole group",)}
    for rank, (seconds, message) in enumerate(outcomes[:3]):
        assert message is not None, f"rank {rank} returned a result despite the fault"
        assert seconds < 5 + 3, f"rank {rank} failed after {seconds:.1f} s (timeout 5 s)"
        named = sum(message.count(w) for w in where[collective])
        assert named == (2 if collective == "allgather" else 1), message
        assert f"(rank {rank} at x={rank % 2}, y={rank // 2} of a 2x2 torus)" in message, message


def silent_rank(rank, world_size, port):
    """Rank 3 stays alive and connected but issues nothing; the others queue two allreduces
    of many segments each and wait for both."""
    group = init_with_group(rank, world_size, port,
                            TorusOptions(algorithm="torus", segment_bytes=SMALL_SEGMENTS))
    dist.all_reduce(torch.ones(10), group=group)  # every group is connected
    if rank == 3:
        time.sleep(8)  # alive and silent past the others' timeout (3 s) and its slack
        return None
    start = time.monotonic()
    works = [dist.all_reduce(torch.ones(1 << 20), async_op=True, group=group) for _ in range(2)]
    ends = []
    for work in works:
        try:
            work.wait()
        except RuntimeError:
            ends.append(time.monotonic() - start)
        else:
            ends.append(None)
    return ends


@pytest.mark.slow
def test_queued_allreduces_fail_within_one_timeout_of_a_silent_peer():
    """A peer that is alive but silent (stuck, not dead: no connection breaks) ends every
    queued call within one timeout: each phase thread holds 128 segments' exchanges here, and
    one timeout each would take minutes (Gloo fails a context's pending exchanges with its
    first timeout, and a phase's exchanges all ride one context)."""
    outcomes = run_ranks(silent_rank, 4, deadline=60)
    for rank, ends in enumerate(outcomes[:3]):
        assert None not in ends, f"rank {rank} got a result despite the silent peer: {ends}"
        assert max(ends) < 3 + 3, f"rank {rank}'s calls failed after {ends} s (timeout 3 s)"


@pytest.mark.slow
def test_size_mismatch_ends_every_rank_within_timeout():
    """Gloo's transport aborts a process that receives more bytes than it posted (plain Gloo
    does the same): such ranks exit with SIGABRT; every other rank raises an error that names
    the torus phase. No rank returns a result, none hangs."""
    outcomes = run_ranks(mismatched_first_call, 4, [1000, 1500, 1000, 1000], "auto",
                         deadline=60, allow_missing=range(4))
    errors = errors_of_failed_ranks(outcomes, timeout=5)
    assert all("torus allreduce" in message for message in errors), errors
    assert errors


def differing_calls(rank, world_size, port, shape, mine, theirs):
    """Rank 0 passes `mine` (a dtype and an element count), the others `theirs`: the sizes in
    bytes the torus exchanges are the same, so only the headers can tell."""
    init(rank, world_size, port, TorusOptions(shape=shape, algorithm="torus"), seconds=10)
    dtype, numel, *op = mine if rank == 0 else theirs
    try:
        dist.all_reduce(torch.ones(numel, dtype=dtype), op=getattr(dist.ReduceOp, *op or ["SUM"]))
    except RuntimeError as error:
        message = str(error)
    else:
        return None
    try:  # the backend refuses to go on: its groups' sequences may differ between ranks now
        dist.all_reduce(torch.ones(4))
    except RuntimeError as error:
        return message, str(error)
    return message, None


@pytest.mark.parametrize("shape", [(2, 2), (4, 1), (1, 4), (2, 3)], ids=lambda s: f"{s[0]}x{s[1]}")
@pytest.mark.parametrize("mine,theirs", [
    ((torch.float32, 3), (torch.float32, 4)),  # 12 and 16 bytes: regions of 16 bytes alike
    ((torch.int32, 8), (torch.float32, 8)),  # the same bytes, another dtype
    ((torch.int32, 100_000), (torch.float32, 100_000)),  # past the two-exchange size
    # bool SUM is reduced as bytes with MAX: the calls were compared as that, and passed
    ((torch.bool, 8), (torch.uint8, 8, "MAX")),
], ids=["3_vs_4", "int32_vs_float32", "large_int32_vs_float32", "bool_sum_vs_uint8_max"])
@pytest.mark.slow
def test_ranks_that_pass_different_buffers_all_fail(shape, mine, theirs):
    """Where the bytes exchanged match, every rank raises, naming the difference (plain Gloo
    returns [4, 4, 4, 3] for 3 against 4 elements); none returns a result, and later allreduces
    are refused. (Where a rank receives more bytes than it posted, Gloo aborts the process: see
    the next tests.)"""
    world_size = shape[0] * shape[1]
    outcomes = run_ranks(differing_calls, world_size, shape, mine, theirs, deadline=60)
    for rank, outcome in enumerate(outcomes):
        assert outcome is not None, f"rank {rank} returned a result"
        message, later = outcome
        assert "the ranks passed different buffers" in message, message
        assert later is not None and "unusable after an earlier failure" in later, later


def bool_and_integer_ops(rank, world_size, port, algorithm):
    init(rank, world_size, port, TorusOptions(algorithm=algorithm))
    gloo = dist.new_group(backend="gloo")
    flags = torch.tensor([rank % 2 == 0, rank == 1, True, False, rank < 2])
    results = {}
    for op in ("SUM", "MAX", "MIN", "PRODUCT", "BAND", "BOR", "BXOR"):
        mine, expected = flags.clone(), flags.clone()
        dist.all_reduce(mine, op=getattr(dist.ReduceOp, op))
        if op in ("BAND", "BOR", "BXOR"):  # Gloo refuses these on bool: as bytes of 0 and 1
            expected = expected.to(torch.uint8)
            dist.all_reduce(expected, op=getattr(dist.ReduceOp, op), group=gloo)
            expected = expected.bool()
        else:
            dist.all_reduce(expected, op=getattr(dist.ReduceOp, op), group=gloo)
        results[op] = (mine.tolist(), expected.tolist())
    strided = torch.stack([flags, ~flags], 1)[:, 0]  # a view with stride 2
    expected = strided.contiguous()
    dist.all_reduce(strided, op=dist.ReduceOp.MAX)
    dist.all_reduce(expected, op=dist.ReduceOp.MAX, group=gloo)
    results["MAX strided"] = (strided.tolist(), expected.tolist())
    # One element (the other ranks' parts of it are empty) and none.
    one, expected = torch.tensor([rank == 1]), torch.tensor([rank == 1])
    dist.all_reduce(one, op=dist.ReduceOp.MAX)
    dist.all_reduce(expected, op=dist.ReduceOp.MAX, group=gloo)
    results["MAX one element"] = (one.tolist(), expected.tolist())
    empty = torch.empty(0, dtype=torch.bool)
    dist.all_reduce(empty, op=dist.ReduceOp.MAX)
    results["MAX empty"] = (empty.tolist(), [])
    # What the Work hands back is the caller's tensor, as Gloo's is: bool, not its bytes.
    work = dist.all_reduce(flags.clone(), op=dist.ReduceOp.MAX, async_op=True)
    work.wait()
    results["result dtypes"] = [str(t.dtype) for t in work.result() + work.get_future().value()]
    try:
        dist.all_reduce(torch.arange(5), op=dist.ReduceOp.AVG)
    except (RuntimeError, ValueError) as error:
        results["AVG int64"] = str(error)
    return results


def saved_then_reduced(rank, world_size, port, algorithm):
    init(rank, world_size, port, TorusOptions(algorithm=algorithm))
    gloo = dist.new_group(backend="gloo")
    results = []
    for numel in (3, 300_000):  # the one-shot form and the segments
        for group in (None, gloo):
            a = torch.ones(numel, requires_grad=True)
            b = a * 1.0
            loss = (b * b).sum()  # saves b
            version = b._version
            dist.all_reduce(b, group=group)
            try:
                loss.backward()
            except RuntimeError as error:
                results.append(str(error))
            else:
                results.append((b._version - version, a.grad[0].item()))
    return results


def inference_tensors(rank, world_size, port, algorithm):
    init(rank, world_size, port, TorusOptions(algorithm=algorithm))
    results = []
    for numel in (0, 10, 300_000):  # none, the one-shot form and the segments
        for reduced_inside in (True, False):
            with torch.inference_mode():
                tensor = torch.full((numel, 3), rank + 1.0)[:, 1]  # a view with stride 3
                if reduced_inside:
                    dist.all_reduce(tensor)
            if not reduced_inside:
                dist.all_reduce(tensor)
            results.append(tensor.unique().tolist() if numel else tensor.shape)
    later = torch.ones(3)
    dist.all_reduce(later)
    return results, later.tolist()


@pytest.mark.parametrize("algorithm", ["torus", "flat"])
def test_inference_tensors_reduce_as_over_gloo(algorithm):
    """Tensors made under torch.inference_mode() (an evaluation's sums), reduced inside it or
    after: Gloo writes them; the torus's ATen writes were refused outside inference mode on its
    threads ("Inplace update to inference tensor outside InferenceMode"), which failed the
    backend for every later call."""
    for results, later in run_ranks(inference_tensors, 2, algorithm):
        assert results == [(0,)] * 2 + [[3.0]] * 4, results
        assert later == [2.0] * 3


@pytest.mark.parametrize("algorithm", ["torus", "flat"])
def test_an_allreduce_leaves_the_version_counter_as_gloo_does(algorithm):
    """The torus's phases wrote the result with ATen ops on an alias that shared the caller's
    version counter: the backward of a tensor saved, then reduced, raised where Gloo's (and the
    flat path's) runs, so under "auto" it depended on the tuner's choice."""
    for results in run_ranks(saved_then_reduced, 2, algorithm):
        torus_small, gloo_small, torus_large, gloo_large = results
        assert torus_small == gloo_small and torus_large == gloo_large, results


@pytest.mark.parametrize("algorithm", ["torus", "flat"])
@pytest.mark.slow
def test_bool_tensors_as_gloo_and_integer_average_refused(algorithm):
    for results in run_ranks(bool_and_integer_ops, 4, algorithm):
        assert results.pop("result dtypes") == ["torch.bool"] * 2
        for op, (mine, expected) in ((op, v) for op, v in results.items() if op != "AVG int64"):
            assert mine == expected, op
        assert "ReduceOp.AVG needs a floating-point tensor, got Long" in results["AVG int64"]


def world_of_one(rank, world_size, port):
    init(rank, world_size, port)
    messages = []
    for group in (None, dist.new_group([0], backend="torus")):
        try:
            dist.all_reduce(torch.arange(5), op=dist.ReduceOp.AVG, group=group)
        except (RuntimeError, ValueError) as error:
            messages.append(str(error))
    numbers = torch.arange(5.0)
    dist.all_reduce(numbers, op=dist.ReduceOp.AVG)
    return messages, numbers.tolist()


@pytest.mark.slow
def test_integer_average_on_one_rank_is_an_error_not_an_abort():
    """Once, a one-rank group divided integers in a Gloo callback and aborted the process."""
    messages, numbers = run_ranks(world_of_one, 1)[0]
    assert len(messages) == 2 and all("AVG needs a floating-point" in m for m in messages)
    assert numbers == [0.0, 1.0, 2.0, 3.0, 4.0]


def calls_gloo_refuses(rank, world_size, port):
    """What each refused call said, then the result of a good call after them."""
    init(rank, world_size, port)
    messages = []
    # Complex tensors reach the backend only through the group's own allreduce (torch's
    # all_reduce reduces them as real): Gloo reduces them, the torus's pipeline does not.
    complex_call = lambda: dist.group.WORLD.allreduce([torch.ones(3, dtype=torch.cfloat)]).wait()
    for call in (lambda: dist.all_reduce(torch.ones(3), op=dist._make_nccl_premul_sum(2.0)),
                 lambda: dist.all_reduce(torch.ones(3, dtype=torch.uint16)), complex_call):
        try:
            call()
            messages.append(None)
        except (RuntimeError, ValueError) as error:
            messages.append(str(error))
    numbers = torch.ones(3)
    dist.all_reduce(numbers)
    return messages, numbers.tolist()


@pytest.mark.slow
@pytest.mark.parametrize("world_size", [1, 2])
def test_a_call_refused_for_its_arguments_leaves_the_group_usable(world_size):
    """PREMUL_SUM (and, on one rank, dtypes Gloo lacks) went to Gloo's own allreduce, whose Work
    failed: that failure made the backend refuse every later call, as after a lost peer."""
    for messages, numbers in run_ranks(calls_gloo_refuses, world_size):
        assert "ReduceOp.PREMUL_SUM is not supported on CPU tensors" in messages[0], messages
        assert "dtype UInt16 is not supported on CPU tensors" in messages[1], messages
        if world_size == 1:  # Gloo's own allreduce, as before the checks moved
            assert messages[2] is None, messages
        else:
            assert "dtype ComplexFloat is not supported on CPU tensors" in messages[2], messages
        assert numbers == [float(world_size)] * 3


def calls_on_two_groups_in_opposite_orders(rank, world_size, port):
    """Async allreduces on two 1x2 groups, issued A then B on rank 0 and B then A on rank 1."""
    init(rank, world_size, port)
    options = TorusOptions(shape="1x2", algorithm="torus", segment_bytes=SMALL_SEGMENTS)
    groups = [dist.new_group(backend="torus", pg_options=options,
                              timeout=datetime.timedelta(seconds=10))
              for _ in range(2)]
    tensors = [torch.full((1 << 20,), rank + 1.0), torch.full((1 << 20,), 10.0 * (rank + 1))]
    order = [0, 1] if rank == 0 else [1, 0]
    works = [dist.all_reduce(tensors[i], group=groups[i], async_op=True) for i in order]
    for work in works:
        work.wait()
    return [(t.min().item(), t.max().item()) for t in tensors]


@pytest.mark.slow
def test_async_calls_on_two_groups_issued_in_opposite_orders_both_end():
    """As on Gloo. The column window (host_pipeline.cpp) once waited on the calling thread of a
    row of one: each rank's first call blocked its caller until its segment two before had
    finished, which needed the other rank's first call on that group, issued after its own
    blocked one: both failed at the timeout."""
    for sums in run_ranks(calls_on_two_groups_in_opposite_orders, 2, deadline=60):
        assert sums == [(3.0, 3.0), (30.0, 30.0)]

DISAGREEMENT_TIMEOUT = 60  # seconds: the ranks must fail long before it


def environment_that_differs_on_rank_2(rank, world_size, port, variable, values):
    """The error, the moment the rank began init and the moment it failed (time.monotonic:
    one clock for every process of the machine)."""
    os.environ[variable] = values[rank == 2]
    began = time.monotonic()
    try:
        init(rank, world_size, port, seconds=DISAGREEMENT_TIMEOUT)
    except ValueError as error:
        return str(error), began, time.monotonic()


@pytest.mark.slow
@pytest.mark.parametrize("variable, values, what, expected", [
    ("TORCH_BIGBATCH_TORUS", ("2x2", "4x1"), "shape", ("rank 0 2x2", "rank 2 4x1")),
    # Else rank 2 would run Gloo's allreduce on the whole group where the others run the torus.
    ("TORCH_BIGBATCH_TORUS_ALGORITHM", ("auto", "flat"), "settings",
     ("rank 0 algorithm=auto ", "rank 2 algorithm=flat ")),
    # Else CUDA tensors would meet NCCL on some ranks and Gloo on others.
    ("TORCH_BIGBATCH_TORUS_CUDA_ENGINE", ("nccl", "gloo"), "settings",
     ("cuda_engine=nccl; rank 2 ", "cuda_engine=gloo")),
])
def test_ranks_that_disagree_all_fail_at_once(variable, values, what, expected):
    results = run_ranks(environment_that_differs_on_rank_2, 4, variable, values,
                        deadline=2 * DISAGREEMENT_TIMEOUT)
    for result in results:
        assert result is not None, "a rank did not fail"
        message = result[0]
        assert f"disagree on its {what}" in message, message
        assert all(part in message for part in expected), message
        assert "rank 1" not in message and "rank 3" not in message, message
    # Timed from the last rank's start, not from the spawn (4 imports of torch on 2 cores).
    last_began, last_failed = max(r[1] for r in results), max(r[2] for r in results)
    assert last_failed - last_began < DISAGREEMENT_TIMEOUT / 6, "they failed only at the timeout"


class SlowToReadTheVerdict:
    """A rank's store that fetches the verdict `delay` s late, as a rank descheduled there."""

    def __init__(self, store, delay):
        self.store, self.delay = store, delay

    def get(self, key):
        if key.endswith("verdict"):
            time.sleep(self.delay)
        return self.store.get(key)

    def __getattr__(self, name):
        return getattr(self.store, name)


def test_rank_0_ends_the_comparison_only_after_every_rank_has_read_the_verdict():
    """Rank 0 hosts the store and, when the ranks disagree, raises and exits: once, in CI, a
    rank slower to read the verdict got "Connection was likely closed" instead of it."""
    port, timeout = free_port(), datetime.timedelta(seconds=10)
    stores = [dist.TCPStore("127.0.0.1", port, 3, True, timeout=timeout, wait_for_workers=False)]
    stores += [dist.TCPStore("127.0.0.1", port, 3, False, timeout=timeout) for _ in range(2)]
    stores[2] = SlowToReadTheVerdict(stores[2], delay=0.5)
    verdicts = {}

    def compare(rank):
        try:
            verdicts[rank] = _compare(stores[rank], rank, 3, "settings", f"spec {rank == 2}")
        except Exception as error:  # noqa: BLE001  (the test reports what each rank got)
            verdicts[rank] = repr(error)
        if rank == 0:
            stores[0] = None  # the host leaves, as a rank 0 that raised would exit

    threads = [threading.Thread(target=compare, args=(rank,)) for rank in range(3)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=20)
    expected = "rank 0 spec False; rank 2 spec True"
    assert verdicts == {0: expected, 1: expected, 2: expected}


def algorithm_choice(rank, world_size, port):
    init(rank, world_size, port)
    groups = {name: dist.new_group(backend="torus", pg_options=TorusOptions(algorithm=name))
              for name in ("torus", "flat")}
    groups["limit"] = dist.new_group(backend="torus", pg_options=TorusOptions(
        torus_max_bytes=1000))
    for group in groups.values():
        dist.all_reduce(torch.ones(100), group=group)
    try:
        cuda = torus_algorithm(400, device="cuda")
    except RuntimeError as error:  # no CUDA here: was "measuring", where none can run
        cuda = str(error)
    return {"auto": torus_algorithm(400), "cuda": cuda,
            "torus": torus_algorithm(1 << 30, groups["torus"]),
            "flat": torus_algorithm(4, groups["flat"]),
            "limit": (torus_algorithm(1000, groups["limit"]),
                      torus_algorithm(1001, groups["limit"])),
            "counts": [torus_allreduce_counts(groups[name]) for name in ("torus", "flat", "limit")]}


@pytest.mark.slow
def test_the_algorithm_each_size_takes_is_visible_and_can_be_forced():
    results = run_ranks(algorithm_choice, 4)[0]
    if not torch.cuda.is_available():
        assert "torus algorithm query: no engine for CUDA tensors" in results["cuda"]
        results["cuda"] = "measuring"
    assert results == {
        "auto": "measuring", "cuda": "measuring", "torus": "torus", "flat": "flat",
        "limit": ("torus", "flat"),
        "counts": [{"cpu torus": 1}, {"cpu flat": 1}, {"cpu torus": 1}]}


def tuned(rank, world_size, port, busy_rank, table_path):
    """Sizes in four classes, each first seen at another point of the run (one after the others
    were decided), in the world and in a subgroup; `busy_rank` spends a core on other work
    throughout, so its times differ from the others'. Rank 0 then saves the world's table to
    `table_path`."""
    init(rank, world_size, port)
    gloo = dist.new_group(backend="gloo")
    pair = dist.new_group([1, 2], backend="torus")
    stop = threading.Event()
    if rank == busy_rank:
        def spin():
            while not stop.is_set():
                sum(range(1000))
        threading.Thread(target=spin, daemon=True).start()
    sizes = [300, 60_000] * 32 + [2_000_003] * 38 + [5] * 32
    wrong = []
    for call, numel in enumerate(sizes):
        mine = rank_data(rank, numel, torch.float64, "SUM", seed=call)
        expected = mine.clone()
        dist.all_reduce(mine)
        dist.all_reduce(expected, group=gloo)
        if not torch.allclose(mine, expected, rtol=1e-12, atol=1e-12):
            wrong.append(call)
        if rank in (1, 2) and call % 3 == 0:
            numbers = torch.full((2000,), float(rank))
            dist.all_reduce(numbers, group=pair)
            if numbers.tolist() != [3.0] * 2000:
                wrong.append(("pair", call))
    stop.set()
    tables = {"world": torus_algorithm_table()}
    if rank in (1, 2):
        tables["pair"] = torus_algorithm_table(pair)
    if rank == 0:
        save_torus_algorithm_table(table_path)
    return wrong, tables, torus_allreduce_counts()


@pytest.mark.slow
def test_auto_measures_and_every_rank_agrees(tmp_path):
    saved = tmp_path / "table.json"
    results = run_ranks(tuned, 4, 3, str(saved), deadline=240)
    for rank, (wrong, _, _) in enumerate(results):
        assert not wrong, f"rank {rank}: wrong results at calls {wrong}"
    world = results[0][1]["world"]
    for rank, (_, tables, counts) in enumerate(results):  # the same choices and the same times
        assert tables["world"] == world, f"rank {rank} chose otherwise"
        assert sum(counts.values()) == 134
    assert results[1][1]["pair"] == results[2][1]["pair"]
    rows = {row["max_bytes"]: row for row in world}
    # 2.4 KB, 480 KB, 16 MB and 40 bytes: classes up to 4 KiB, 512 KiB, 16 MiB and 64 bytes.
    assert sorted(rows) == [64, 4096, 512 << 10, 16 << 20]
    for row in world:
        assert row["source"] == "measured" and row["algorithm"] in ("flat", "torus"), row
        candidates = row["candidates"]
        # Above 8 MiB the torus is tried with 8 MiB, 32 MiB and 2 MiB segments (4 x 5 trial
        # calls, 16 flat ones while the ranks agree, then the deciding call: 37 of the 38 calls
        # of 16 MB); up to 256 KiB with 8 MiB segments (one) and in its one-shot form (3 x 5
        # trial calls, 16 while the ranks agree, then the deciding call).
        segments = {64: [8 << 20, None], 4096: [8 << 20, None], 512 << 10: [8 << 20],
                    16 << 20: [8 << 20, 32 << 20, 2 << 20]}[row["max_bytes"]]
        assert [(c["algorithm"], c["segment_bytes"], c["one_shot"]) for c in candidates] == \
            [("flat", None, False)] + [("torus", size, size is None) for size in segments], row
        # The fastest torus, where it beats flat (the first candidate) by 5%; else flat.
        fastest = min(candidates[1:], key=lambda c: c["seconds"])
        if fastest["seconds"] >= 0.95 * candidates[0]["seconds"]:
            fastest = candidates[0]
        assert [row[key] for key in ("algorithm", "segment_bytes", "one_shot")] == \
            [fastest[key] for key in ("algorithm", "segment_bytes", "one_shot")]
        assert all(0 < c["seconds"] < 10 for c in candidates), row
    # The table as saved (JSON, nothing else left beside it) pins each class as it was
    # decided, in a later run.
    assert json.loads(saved.read_text()) == world and os.listdir(tmp_path) == ["table.json"]
    pinned = TorusOptions(table=str(saved))._pinned
    assert sorted(pinned) == sorted(
        ("cpu", (row["max_bytes"] - 1).bit_length(), row["algorithm"], row["segment_bytes"] or 0,
         row["one_shot"], row["shape"]) for row in world)


LAG = 0.5  # seconds: how much later than the others one rank issues each call (far above a
# call's time even on a loaded machine, so that a lag counted cannot pass for a slow call)


def lagging_rank(rank, world_size, port):
    """Rank 3 issues every call LAG seconds after the others, as a rank that is slower through
    its backward pass issues DDP's buckets late."""
    init(rank, world_size, port)
    wrong = []
    for call in range(CALLS_TO_DECIDE):
        if rank == 3:
            time.sleep(LAG)
        numbers = torch.full((1000,), float(rank + call))
        dist.all_reduce(numbers)
        if numbers.tolist() != [6.0 + 4 * call] * 1000:
            wrong.append(call)
    return wrong, torus_algorithm_table()


@pytest.mark.slow
def test_a_rank_that_issues_late_does_not_count_its_lag():
    """The others wait LAG for rank 3 in every call, whatever the algorithm: the agreed time of
    a call is that of the rank that issued it last, not the wait of the ones that came first."""
    results = run_ranks(lagging_rank, 4)
    for rank, (wrong, table) in enumerate(results):
        assert not wrong, f"rank {rank}: wrong results at calls {wrong}"
        assert table == results[0][1], f"rank {rank} chose otherwise"
    [row] = results[0][1]
    assert row["source"] == "measured", row
    assert all(0 < candidate["seconds"] < LAG / 2 for candidate in row["candidates"]), row


def overlapping_then_plain(rank, world_size, port):
    init(rank, world_size, port, TorusOptions(algorithm="torus"), seconds=10)
    try:
        dist.all_reduce(torch.ones(1).expand(4))
        message = None
    except RuntimeError as error:
        message = str(error)
    numbers = torch.ones(4)
    dist.all_reduce(numbers)
    return message, numbers.tolist()


def test_an_expanded_view_is_refused_before_anything_is_sent():
    """Its result cannot be written back; found only after the exchanges, that failed the call
    and left the backend unusable on every rank."""
    for message, numbers in run_ranks(overlapping_then_plain, 2, deadline=60):
        assert message is not None and "elements share memory (an expanded view)" in message, \
            message
        assert numbers == [2.0] * 4


def async_allreduce_around_a_p2p(rank, world_size, port):
    """Rank 0 issues an async allreduce, then sends; rank 1 receives, then issues it: each
    relies on the async call returning at once, as over Gloo."""
    init(rank, world_size, port, seconds=10)
    right = []
    for call in range(CALLS_TO_DECIDE + 2):
        numbers, token = torch.full((1000,), float(rank + call)), torch.zeros(1)
        if rank == 0:
            work = dist.all_reduce(numbers, async_op=True)
            dist.send(token, 1)
        else:
            dist.recv(token, 0)
            work = dist.all_reduce(numbers, async_op=True)
        work.wait()
        right.append(numbers.tolist() == [1.0 + 2 * call] * 1000)
    return all(right), torus_algorithm(4000)


def groups_in_opposite_orders(rank, world_size, port):
    """Two groups' async allreduces, issued in one order on rank 0 and the other on rank 1."""
    init(rank, world_size, port, seconds=10)
    pair = dist.new_group([0, 1], backend="torus", timeout=datetime.timedelta(seconds=10))
    right = []
    for call in range(CALLS_TO_DECIDE + 2):
        world, other = torch.full((1000,), float(rank)), torch.full((1000,), float(rank + call))
        calls = [(world, None), (other, pair)]
        works = [dist.all_reduce(tensor, group=group, async_op=True)
                 for tensor, group in (calls if rank == 0 else calls[::-1])]
        for work in works:
            work.wait()
        right.append(world.tolist() == [1.0] * 1000 and other.tolist() == [1.0 + 2 * call] * 1000)
    return all(right), torus_algorithm(4000), torus_algorithm(4000, pair)


@pytest.mark.parametrize("program", [async_allreduce_around_a_p2p, groups_in_opposite_orders])
def test_an_async_call_that_decides_does_not_wait_for_the_other_ranks(program):
    """The ranks agree on a class's times in the background: the call that decided, waiting for
    the trials and the agreement itself, waited for a peer that waited for it to return, until
    both failed at the timeout."""
    for right, *chosen in run_ranks(program, 2, deadline=60):
        assert right and all(algorithm in ("flat", "torus") for algorithm in chosen), chosen


def decision_without_a_peer(rank, world_size, port):
    """Rank 1 makes all but the last trial call of a size class: rank 0's last one, issued
    asynchronously, never ends, nor does the agreement, which its deciding call waits for."""
    group = init_with_group(rank, world_size, port)
    for _ in range(14):  # 3 candidates x 5 trial calls, less one
        dist.all_reduce(torch.ones(1000), group=group)
    if rank == 1:
        time.sleep(12)  # keeps its connections until rank 0 is done
        return None
    dist.all_reduce(torch.ones(1000), group=group, async_op=True)  # the last trial
    # While the ranks agree the class runs flat (16 calls): these never end either.
    for _ in range(16):
        dist.all_reduce(torch.ones(1000), group=group, async_op=True)
    messages = []
    for _ in range(2):
        start = time.monotonic()
        try:
            dist.all_reduce(torch.ones(1000), group=group)
        except RuntimeError as error:
            messages.append((time.monotonic() - start, str(error)))
    return messages


@pytest.mark.slow
def test_a_failed_decision_leaves_the_backend_unusable():
    """A decision that failed may have its agreement queued on some ranks and not on others: a
    later call must not post to the group again (it once decided anew, a second agreement out of
    step with the other ranks' collectives)."""
    (first_seconds, first), (later_seconds, later) = run_ranks(
        decision_without_a_peer, 2, deadline=60)[0]
    assert "choosing the algorithm of cpu allreduces over 2 KiB up to 4 KiB failed" in first, first
    assert "issue asynchronous collectives in different orders, fix the algorithm" in first, first
    assert 2 < first_seconds < 3 + 5, first_seconds
    assert later.startswith("torus backend is unusable after an earlier failure: "), later
    assert later_seconds < 1, later_seconds


def decision_log(rank, world_size, port, folder):
    """What each rank's C++ side writes to stderr while a class is measured and decided."""
    path = os.path.join(folder, f"rank{rank}.log")
    with open(path, "w") as log:
        os.dup2(log.fileno(), 2)
    init(rank, world_size, port)
    for _ in range(CALLS_TO_DECIDE):
        dist.all_reduce(torch.ones(1000))
    with open(path) as log:
        return log.read(), torus_algorithm(4000)


@pytest.mark.slow
@pytest.mark.parametrize("world_size, segments", [(4, "8 MiB"), (8, "16 MiB")])
def test_rank_zero_logs_each_decision(tmp_path, world_size, segments):
    """The log names each candidate, the torus with the group's default segments: 2 MiB per
    rank, from 8 to 16 MiB (cost_model.alpha_beta.cpu_segment_bytes)."""
    results = run_ranks(decision_log, world_size, str(tmp_path))
    text, chosen = results[0]
    lines = [line for line in text.splitlines() if line.startswith("torch_bigbatch torus")]
    assert len(lines) == 1, text
    group = f"ranks 0-{world_size - 1} as {'x'.join(map(str, resolve_shape(world_size)))}"
    assert lines[0].startswith(f"torch_bigbatch torus ({group}): cpu allreduces over 2 KiB up to "
                               f"4 KiB run {chosen}"), lines
    for candidate in ("flat ", f"torus ({segments} segments) ", "torus (one shot) "):
        assert candidate in lines[0], lines
    assert all("torch_bigbatch torus" not in text for text, _ in results[1:])


def pinned(rank, world_size, port, table):
    init(rank, world_size, port, TorusOptions(table=table))
    for _ in range(3):
        numbers = torch.full((1000,), float(rank))
        dist.all_reduce(numbers)
        assert numbers.tolist() == [6.0] * 1000
    return torus_algorithm_table(), torus_allreduce_counts(), torus_algorithm(4000)


@pytest.mark.slow
@pytest.mark.parametrize("segment_bytes, one_shot", [(1 << 20, False), (None, True)])
def test_a_pinned_table_skips_the_trials(tmp_path, segment_bytes, one_shot):
    """The torus of 4000 bytes in either form: one segment of four phases, or one shot."""
    table = [{"device": "cpu", "min_bytes": 2049, "max_bytes": 4096, "algorithm": "torus",
              "segment_bytes": segment_bytes, "one_shot": one_shot}]
    path = tmp_path / "table.json"
    path.write_text(json.dumps(table))
    for rows, counts, chosen in run_ranks(pinned, 4, str(path)):
        assert counts == {"cpu torus": 3} and chosen == "torus"
        assert rows == [{**table[0], "source": "pinned", "candidates": [], "shape": "2x2"}]


def test_a_bad_table_is_refused(tmp_path):
    with pytest.raises(ValueError, match="cannot be read as JSON"):
        TorusOptions(table=str(tmp_path / "missing.json"))
    with pytest.raises(ValueError, match="algorithm flat or torus"):
        TorusOptions(table=[{"device": "cpu", "max_bytes": 4096, "algorithm": "ring"}])
    for bad in ({"device": "cuda", "one_shot": True}, {"device": "cpu", "one_shot": "false"}):
        with pytest.raises(ValueError, match="one_shot true on cpu"):
            TorusOptions(table=[{"max_bytes": 4096, "algorithm": "torus", **bad}])
    # The one-shot form runs up to 256 KiB (a pinned 32 MiB class once ran it); refused before
    # any group is built, where a rank 0 that hosts the store cannot leave the others behind.
    one_shot = {"device": "cpu", "algorithm": "torus", "one_shot": True}
    TorusOptions(table=[{**one_shot, "max_bytes": 256 << 10}])
    with pytest.raises(ValueError, match="the one-shot torus runs buffers of up to 262144 bytes, "
                                         "got it pinned for cpu allreduces of up to 524288"):
        TorusOptions(table=[{**one_shot, "max_bytes": 512 << 10}])
    with pytest.raises(ValueError, match="needs device, max_bytes and algorithm"):
        TorusOptions(table=[{"device": "cpu"}])
    with pytest.raises(ValueError, match="applies to algorithm 'auto', not to 'torus'$"):
        TorusOptions(algorithm="torus", table=[])
    with pytest.raises(ValueError, match="a pinned table and torus_max_bytes both fix"):
        TorusOptions(table=[], torus_max_bytes=4096)
    row = {"device": "cpu", "max_bytes": 4096, "algorithm": "flat"}
    for bad in ({"max_bytes": 3000},  # was the class up to 4096: 3500 bytes pinned too
                {"max_bytes": 1 << 20, "min_bytes": 0},  # pinned the top class only
                {"max_bytes": 0}, {"max_bytes": 4096.9}, {"max_bytes": "4096"},
                {"max_bytes": True}, {"segment_bytes": -5}, {"algorithm": "torus",
                                                              "segment_bytes": 1.5},
                # past the C++ side's int64 and its largest class: refused only after the
                # groups were built, where a rank could leave the others behind
                {"max_bytes": 1 << 63}, {"algorithm": "torus", "segment_bytes": 1 << 64}):
        with pytest.raises(ValueError, match="max_bytes a power of two"):
            TorusOptions(table=[{**row, **bad}])
    with pytest.raises(ValueError, match="pins cpu allreduces of up to 4096 bytes twice"):
        TorusOptions(table=[row, {**row, "algorithm": "torus", "one_shot": True}])
    with pytest.raises(ValueError, match="twice"):  # a row for any shape, and one for 2x2
        TorusOptions(table=[row, {**row, "shape": "2x2"}])
    TorusOptions(table=[{**row, "shape": "4x1"}, {**row, "shape": "2x2"}])  # two groups' rows
    # A table given to the options stays as given: the options can be copied.
    options = TorusOptions(table=[row])
    assert dataclasses.replace(options, shape="2x2").table == [row]


def test_options_refused_where_they_would_be_ignored_or_fail_late(monkeypatch):
    with pytest.raises(ValueError, match="torus_max_bytes applies to algorithm 'auto', not to "
                                         "'torus'"):
        TorusOptions(algorithm="torus", torus_max_bytes=1 << 20)
    monkeypatch.setenv("TORCH_BIGBATCH_TORUS_ALGORITHM", "flat")
    with pytest.raises(ValueError, match="not to 'flat' \\(from TORCH_BIGBATCH_TORUS_ALGORITHM"):
        TorusOptions(torus_max_bytes=1 << 20)
    monkeypatch.delenv("TORCH_BIGBATCH_TORUS_ALGORITHM")
    with pytest.raises(ValueError, match="torus_max_bytes must be an int"):
        TorusOptions(torus_max_bytes=1e6)  # failed in init_process_group, after the groups
    with pytest.raises(ValueError, match="segment_bytes must be a positive int"):
        TorusOptions(segment_bytes=1.5e6)
    for too_large in ({"segment_bytes": 1 << 63}, {"torus_max_bytes": 1 << 63}):
        with pytest.raises(ValueError, match="must be a.* int64"):
            TorusOptions(**too_large)
    # Floats and bools were truncated ((2.5, 2) ran as 2x2), others raised unpacking errors.
    for shape in ("2x", (2.5, 2), (True, 4), (2, 2, 1), 4, ("2", "2")):
        with pytest.raises(ValueError, match="a torus shape is"):
            TorusOptions(shape=shape)


def test_the_environments_table_is_for_groups_that_measure(monkeypatch, tmp_path):
    """TORCH_BIGBATCH_TORUS_TABLE pins what "auto" would measure: a group with a fixed
    algorithm or torus_max_bytes neither reads it nor is refused for it (all three were
    refused, so a job-wide table forbade a flat subgroup)."""
    monkeypatch.setenv("TORCH_BIGBATCH_TORUS_TABLE", str(tmp_path / "missing.json"))
    for options in ({"algorithm": "flat"}, {"algorithm": "torus"}, {"torus_max_bytes": 0}):
        assert TorusOptions(**options)._pinned is None
    with pytest.raises(ValueError, match="cannot be read as JSON"):
        TorusOptions()


def tables_of_another_shape(rank, world_size, port, path):
    """A 1x2 group given a table measured as 2x2: refused when given to the group, left out
    when it comes from TORCH_BIGBATCH_TORUS_TABLE (which every torus group reads)."""
    init(rank, world_size, port)
    rows = [{"device": "cpu", "max_bytes": 4096, "algorithm": "flat", "shape": "2x2"}]
    try:
        dist.new_group(backend="torus", pg_options=TorusOptions(table=rows))
    except ValueError as error:
        refused = str(error)
    else:
        refused = None
    os.environ["TORCH_BIGBATCH_TORUS_TABLE"] = path
    group = dist.new_group(backend="torus")
    dist.barrier()  # rank 0, which hosts the store, leaves only once every rank's groups are
    return refused, torus_algorithm(4000, group)


def a_table_only_rank_0_refuses(rank, world_size, port):
    init(rank, world_size, port, seconds=DISAGREEMENT_TIMEOUT)
    rows = [{"device": "cpu", "max_bytes": 4096, "algorithm": "flat", "shape": "2x2"}]
    began = time.monotonic()
    try:
        dist.new_group(backend="torus", pg_options=TorusOptions(table=rows if rank == 0 else None))
    except ValueError as error:
        return str(error), time.monotonic() - began


@pytest.mark.slow
def test_a_table_refused_on_one_rank_stops_every_rank_at_once():
    """Rank 0 refused the table before the ranks compared their settings: rank 1 then saw a
    lost connection, or, with the ranks' roles swapped, waited out the store's timeout."""
    (refused, refused_after), (other, other_after) = run_ranks(
        a_table_only_rank_0_refuses, 2, deadline=2 * DISAGREEMENT_TIMEOUT)
    assert "the pinned table was measured in a 2x2 torus; this group is 1x2" in refused
    assert "disagree on its settings" in other and "table=refused" in other, other
    assert max(refused_after, other_after) < DISAGREEMENT_TIMEOUT / 6


def an_environment_only_rank_1_refuses(rank, world_size, port, path):
    if rank == 1:
        os.environ["TORCH_BIGBATCH_TORUS_TABLE"] = path
    began = time.monotonic()
    try:
        init(rank, world_size, port, seconds=DISAGREEMENT_TIMEOUT)
    except ValueError as error:
        return str(error), time.monotonic() - began


@pytest.mark.slow
def test_an_environment_refused_on_one_rank_stops_every_rank_at_once(tmp_path):
    """The default group's options come from the environment: rank 1 refused its table there
    before the ranks compared anything, and rank 0 waited out the store's timeout."""
    (other, other_after), (refused, refused_after) = run_ranks(
        an_environment_only_rank_1_refuses, 2, str(tmp_path / "missing.json"),
        deadline=2 * DISAGREEMENT_TIMEOUT)
    assert "cannot be read as JSON" in refused, refused
    assert "disagree on its settings" in other and "options=refused" in other, other
    assert max(refused_after, other_after) < DISAGREEMENT_TIMEOUT / 6


@pytest.mark.slow
def test_a_table_holds_for_the_shape_it_was_measured_in(tmp_path):
    path = tmp_path / "table.json"
    path.write_text(json.dumps([{"device": "cpu", "max_bytes": 4096, "algorithm": "flat",
                                 "shape": "2x2"}]))
    for refused, chosen in run_ranks(tables_of_another_shape, 2, str(path)):
        assert "the pinned table was measured in a 2x2 torus; this group is 1x2" in refused
        assert chosen == "measuring"  # not pinned: this group measures the class


def query_arguments(rank, world_size, port):
    init(rank, world_size, port)
    others = dist.new_group([1])
    messages = []
    for call in (lambda: torus_algorithm(-5), lambda: torus_algorithm(4000, device="meta"),
                 lambda: torus_algorithm(4000, group=others),
                 lambda: torus_algorithm_table(others)):
        try:
            call()
            messages.append(None)
        except ValueError as error:
            messages.append(str(error))
    dist.barrier()  # rank 0 holds the store that rank 1's group of one still uses
    return messages


@pytest.mark.slow
def test_the_queries_name_bad_arguments():
    messages = run_ranks(query_arguments, 2)[0]
    assert "nbytes must be an int in [0, 2**62), got -5" in messages[0]  # was "measuring"
    assert "the torus runs cpu and cuda tensors, got device 'meta'" in messages[1]
    assert all("this rank is not a member of the group" in m for m in messages[2:]), messages


def size_mismatch_in_detail_mode(rank, world_size, port):
    os.environ["TORCH_DISTRIBUTED_DEBUG"] = "DETAIL"
    dist.set_debug_level_from_env()  # torch read the variable at import, before this
    init(rank, world_size, port, seconds=10)
    assert torus_shape() == (2, 2)  # seen through torch's checking wrapper
    try:
        dist.all_reduce(torch.ones(100_000 + (rank == 1) * 50_000))
    except RuntimeError as error:
        return str(error)


@pytest.mark.slow
def test_size_mismatch_under_distributed_debug_detail_fails_every_rank_before_any_data():
    """TORCH_DISTRIBUTED_DEBUG=DETAIL wraps the torus as torch wraps its own backends: the ranks
    compare their calls first, so none aborts and each says what differs."""
    for message in run_ranks(size_mismatch_in_detail_mode, 4, deadline=60):
        assert message is not None and "mismatch" in message.lower(), message
        assert "150000" in message or "100000" in message, message


def shape_mismatch(rank, world_size, port):
    try:
        init(rank, world_size, port, TorusOptions(shape="3x3"))
    except ValueError as error:
        return str(error)


@pytest.mark.slow
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
    with pytest.raises(ValueError, match="torus_max_bytes"):
        TorusOptions(torus_max_bytes=-1)
    with pytest.raises(ValueError, match="algorithm must be one of auto, torus, flat"):
        TorusOptions(algorithm="ring")
    with pytest.raises(ValueError, match="cuda_engine must be one of nccl, gloo, got 'mpi'"):
        TorusOptions(cuda_engine="mpi")
    assert TorusOptions().cuda_engine == "nccl"


def test_a_refused_environment_variable_is_named(monkeypatch):
    """A value from the environment is refused naming its variable (only torus_max_bytes'
    conflict named one): the user did not write it in the code. A default is no variable's."""
    monkeypatch.delenv("TORCH_BIGBATCH_TORUS_ALGORITHM", raising=False)
    with pytest.raises(ValueError, match="not to 'torus'$"):
        TorusOptions(algorithm="torus", table=[])
    with pytest.raises(ValueError, match="both fix"):  # the conflict is torus_max_bytes'
        TorusOptions(table=[], torus_max_bytes=10)
    monkeypatch.setenv("TORCH_BIGBATCH_TORUS_ALGORITHM", "Auto")
    with pytest.raises(ValueError, match=r"got 'Auto' \(from TORCH_BIGBATCH_TORUS_ALGORITHM\)"):
        TorusOptions()
    monkeypatch.setenv("TORCH_BIGBATCH_TORUS_ALGORITHM", "torus")
    with pytest.raises(ValueError, match=r"not to 'torus' \(from TORCH_BIGBATCH_TORUS_ALGOR"):
        TorusOptions(table=[])
    monkeypatch.delenv("TORCH_BIGBATCH_TORUS_ALGORITHM")
    monkeypatch.setenv("TORCH_BIGBATCH_TORUS_CUDA_ENGINE", "mpi")
    with pytest.raises(ValueError, match=r"'mpi' \(from TORCH_BIGBATCH_TORUS_CUDA_ENGINE\)"):
        TorusOptions()
    monkeypatch.delenv("TORCH_BIGBATCH_TORUS_CUDA_ENGINE")
    monkeypatch.setenv("TORCH_BIGBATCH_TORUS", "3x2")
    with pytest.raises(ValueError, match=r"\(6 ranks\) \(from TORCH_BIGBATCH_TORUS\) does not"):
        resolve_shape(4)
    monkeypatch.setenv("TORCH_BIGBATCH_TORUS", "2x")
    with pytest.raises(ValueError, match=r"a torus shape is.*\(from TORCH_BIGBATCH_TORUS\)$"):
        resolve_shape(4)
    with pytest.raises(ValueError, match=r"does not match the group size 4$"):  # not from it
        resolve_shape(4, shape="3x2")


def options_set_after_construction(rank, world_size, port):
    init(rank, world_size, port)
    refusals = []
    for name, value in (("algorithm", "ring"), ("segment_bytes", 0), ("torus_max_bytes", -5)):
        options = TorusOptions()
        setattr(options, name, value)
        try:
            dist.new_group(backend="torus", pg_options=options)
        except ValueError as error:
            refusals.append(str(error))
    options = TorusOptions()
    options.table = [{"device": "cpu", "min_bytes": 2049, "max_bytes": 4096,
                      "algorithm": "flat"}]
    group = dist.new_group(backend="torus", pg_options=options)
    numbers = torch.ones(1000)
    dist.all_reduce(numbers, group=group)
    return refusals, torus_algorithm_table(group)[0]["source"]


def test_options_set_after_construction_are_checked():
    """Fields set after TorusOptions() (as torch's own Options are set) were used unchecked:
    algorithm "ring" ran "auto", and a table set so was never parsed (its classes measured)."""
    for refusals, source in run_ranks(options_set_after_construction, 2):
        assert len(refusals) == 3, refusals
        assert "algorithm must be one of" in refusals[0]
        assert "segment_bytes must be a positive int64" in refusals[1]
        assert "torus_max_bytes must be an int64 >= 0" in refusals[2]
        assert source == "pinned"


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
@pytest.mark.slow
def test_cuda_and_cpu_tensors_at_world_size_one():
    """One GPU: NCCL runs one rank, so this is the CUDA test a one-GPU machine can run."""
    on_gpu, on_cpu = run_ranks(cuda_world_of_one, 1)[0]
    assert on_gpu == on_cpu == [float(i) for i in range(10)]


def wait_then_read_the_future(rank, world_size, port, algorithm):
    init(rank, world_size, port, TorusOptions(algorithm=algorithm), seconds=20)
    data = torch.full((4_000_000,), float(rank + 1))  # still running when wait() is called
    work = dist.all_reduce(data, async_op=True)
    then = work.get_future().then(lambda future: future.value()[0][0].item())
    work.wait()
    # The Work ends after its future and the future's callbacks: all done once wait() returned.
    return work.is_completed(), work.get_future().done(), then.done(), then.value()


@pytest.mark.parametrize("algorithm", ["flat", "torus"])
def test_the_future_and_its_callbacks_are_done_when_wait_returns(algorithm):
    """wait() ends the Work on the waiting thread itself (one thread handoff fewer than on a
    callback thread), after the future and its callbacks, as Gloo's Works end."""
    for result in run_ranks(wait_then_read_the_future, 2, algorithm, deadline=60):
        assert result == (True, True, True, 3.0)


FLAT_SMALL_TORUS_LARGE = [
    {"device": "cpu", "min_bytes": 2049, "max_bytes": 4096, "algorithm": "flat"},
    {"device": "cpu", "min_bytes": 262145, "max_bytes": 524288, "algorithm": "torus",
     "segment_bytes": 1 << 20, "one_shot": False}]


def failed_torus_then_flat(rank, world_size, port):
    """A torus call whose ranks pass different dtypes (the same bytes) fails on both; then a
    call of a class pinned to the whole group's own allreduce."""
    init(rank, world_size, port, TorusOptions(shape=(2, 1), table=FLAT_SMALL_TORUS_LARGE),
         seconds=10)
    outcomes = []
    for tensor in (torch.ones(100_000, dtype=torch.int32 if rank == 0 else torch.float32),
                   torch.ones(1000)):
        try:
            dist.all_reduce(tensor)
            outcomes.append("completed")
        except RuntimeError as error:
            outcomes.append(str(error))
    return outcomes


@pytest.mark.slow
def test_after_a_failure_every_path_refuses():
    """One failure state for the backend: after a failed torus call, the whole group's own
    allreduce is refused too (it once ran, though the groups' sequences may differ by then)."""
    for failed, flat in run_ranks(failed_torus_then_flat, 2, deadline=60):
        assert "the ranks passed different buffers" in failed, failed
        assert flat.startswith("torus backend is unusable after an earlier failure: "), flat
        assert "the ranks passed different buffers" in flat, flat



def flat_call_without_a_peer_then_torus(rank, world_size, port):
    """Rank 1 skips a call of a class pinned to the whole group's allreduce: rank 0's times out;
    then rank 0 calls a class that the torus runs, on other groups."""
    group = init_with_group(rank, world_size, port,
                            TorusOptions(shape=(2, 1), table=FLAT_SMALL_TORUS_LARGE))
    if rank == 1:
        time.sleep(8)
        return None
    outcomes = []
    for tensor in (torch.ones(1000), torch.ones(100_000)):
        start = time.monotonic()
        try:
            dist.all_reduce(tensor, group=group)
            outcomes.append((time.monotonic() - start, "completed"))
        except RuntimeError as error:
            outcomes.append((time.monotonic() - start, str(error)))
    return outcomes


@pytest.mark.slow
def test_a_failure_of_the_whole_groups_allreduce_is_the_backends_first_failure():
    """A failed flat call is recorded as the torus's are: the next call is refused at once (it
    once went on to the torus's groups and waited a second timeout)."""
    (flat_seconds, flat), (later_seconds, later) = run_ranks(
        flat_call_without_a_peer_then_torus, 2, deadline=60)[0]
    assert "torus allreduce failed in the allreduce of the whole group" in flat, flat
    assert 2 < flat_seconds < 3 + 3, flat_seconds
    assert later.startswith("torus backend is unusable after an earlier failure: "), later
    assert later_seconds < 1, later_seconds

def wait_past_a_timeout_then_again(rank, world_size, port):
    """Rank 1 issues 2 s late: rank 0's wait(timeout=0.3 s) ends first, then the call ends with
    nobody waiting (a callback thread settles it), and a second wait() reads the result."""
    init(rank, world_size, port, TorusOptions(algorithm="torus"), seconds=20)
    if rank == 1:
        time.sleep(2)
    data = torch.full((1000,), float(rank + 1))
    work = dist.all_reduce(data, async_op=True)
    timed_out = None
    if rank == 0:
        try:
            work.wait(timeout=datetime.timedelta(seconds=0.3))
        except RuntimeError as error:
            timed_out = str(error)
        time.sleep(3)  # the call ends meanwhile, with no thread in wait()
    work.wait()
    return timed_out, work.is_completed(), work.get_future().done(), data[0].item()


@pytest.mark.slow
def test_a_wait_that_times_out_leaves_the_call_to_end():
    (timed_out, *rank0), (_, *rank1) = run_ranks(wait_past_a_timeout_then_again, 2, deadline=60)
    assert timed_out is not None and "timed out" in timed_out, timed_out
    assert rank0 == rank1 == [True, True, 3.0]
