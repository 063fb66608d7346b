"""The "torus" backend's CUDA pipeline on real processes: on NCCL, one GPU per rank; on Gloo's
CUDA collectives (TorusOptions.cuda_engine="gloo"), four ranks sharing GPU 0.

NCCL refuses two ranks on one GPU and a group of one rank never reaches the pipeline (it takes
the whole group's allreduce), so on NCCL the pipeline's tests need at least two GPUs; Gloo's
engine brings them to a machine with one. They force algorithm "torus" and check that the
pipeline ran. The tests of one GPU (world size 1) check the whole group's allreduce as the torus
hands it to NCCL. Inputs are small integers, so every
expected value is exact in float32 and bfloat16 and has a closed form in the ranks.
"""

import datetime
import os
import time

import pytest
import torch
import torch.distributed as dist

import torch_bigbatch  # noqa: F401  (registers backend "torus")
from torch_bigbatch.distributed import TorusOptions, torus_allreduce_counts

from conftest import CUDA, needs_cuda
from multiprocess import run_ranks
from test_torus import SmallConvNet, global_batches, train


def needs_gpus(count):
    return pytest.mark.skipif(torch.cuda.device_count() < count,
                              reason=f"needs {count} GPUs: NCCL runs one rank per GPU")


PIPELINES = [pytest.param(shape, "nccl", id=f"{shape[0]}x{shape[1]}-nccl",
                          marks=[CUDA, needs_gpus(shape[0] * shape[1])])
             for shape in ((2, 1), (1, 2), (2, 2))]
PIPELINES.append(pytest.param((2, 2), "gloo", id="2x2-gloo-one-gpu", marks=[CUDA, needs_cuda]))


def init(rank, world_size, port, shape, segment_bytes=64 << 10, seconds=60, engine="nccl"):
    """The torus pipeline forced: "auto" could pick the whole group's allreduce for any size.
    NCCL's ranks take a GPU each, Gloo's share GPU 0."""
    device = torch.device("cuda", rank if engine == "nccl" else 0)
    torch.cuda.set_device(device)
    dist.init_process_group("torus", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world_size,
                            pg_options=TorusOptions(shape=shape, algorithm="torus",
                                                    segment_bytes=segment_bytes,
                                                    cuda_engine=engine),
                            timeout=datetime.timedelta(seconds=seconds))
    return device


def pipeline_calls():
    counts = torus_allreduce_counts()
    assert "cuda flat" not in counts, counts
    return counts["cuda torus"]


def expected(op, base, world_size):
    """The reduction of base + rank over the ranks."""
    ranks = sum(range(world_size))
    return {"SUM": base * world_size + ranks, "AVG": base + ranks / world_size,
            "MAX": base + world_size - 1, "MIN": base}[op]


def allreduce_on_gpus(rank, world_size, port, shape, engine):
    # 64 KiB segments: 100,003 float32 values make 7 segments, 7 values a padded copy.
    device = init(rank, world_size, port, shape, engine=engine)
    checked = 0
    for dtype in (torch.float32, torch.bfloat16, torch.int64):
        for op in ("SUM", "AVG", "MAX", "MIN"):
            if op == "AVG" and dtype == torch.int64:
                continue  # refused up front: integer AVG is not exact
            for numel in (1, 7, 100_003):
                base = torch.arange(numel, device=device) % 7
                tensor = (base + rank).to(dtype)
                dist.all_reduce(tensor, op=getattr(dist.ReduceOp, op))
                want = expected(op, base.double(), world_size)
                assert torch.equal(tensor.double(), want), f"{op} {dtype} n={numel}"
                checked += 1

    # A non-contiguous view: the result lands in the view, the rest is untouched.
    base = torch.arange(3000.0, device=device).view(100, 30) % 5
    matrix = base + rank
    view, untouched = matrix[:, ::3], matrix[:, 1::3].clone()
    dist.all_reduce(view)
    assert torch.equal(view, expected("SUM", base[:, ::3], world_size))
    assert torch.equal(matrix[:, 1::3], untouched)
    # allreduce_coalesced: one flattened buffer for several tensors.
    tensors = [torch.full((n,), float(rank), device=device) for n in (5, 1001, 3)]
    dist.all_reduce_coalesced(tensors)
    for tensor in tensors:
        assert torch.equal(tensor, torch.full_like(tensor, expected("SUM", 0.0, world_size)))

    # An empty tensor reduces to an empty tensor (0 bytes: no host-only one-shot form here).
    empty = torch.empty(0, device=device)
    dist.all_reduce(empty)
    assert empty.shape == (0,) and empty.is_cuda

    # Consecutive calls in flight at once, as DDP's buckets are; each future chained as DDP's
    # communication hooks do.
    tensors = [torch.full((50_000,), float(rank + i), device=device) for i in range(20)]
    works = [dist.all_reduce(tensor, async_op=True) for tensor in tensors]
    doubled = [work.get_future().then(lambda future: future.value()[0] * 2) for work in works]
    for i, (tensor, work, future) in enumerate(zip(tensors, works, doubled)):
        want = torch.full_like(tensor, expected("SUM", float(i), world_size))
        assert torch.equal(future.wait(), want * 2), f"future {i}"
        assert work.wait()
        assert torch.equal(tensor, want), f"call {i}"
        assert work.is_completed() and work.is_success()
    # float16 AVG whose sum over the ranks passes float16's largest value (65504): divided first,
    # as NCCL's own AVG (the flat path's) divides, so the mean comes back, not inf.
    large = torch.full((1000,), 40000.0, dtype=torch.float16, device=device)
    dist.all_reduce(large, op=dist.ReduceOp.AVG)
    assert torch.equal(large, torch.full_like(large, 40000.0))
    # So does the whole group's allreduce (NCCL's AVG; for Gloo's, which sums first, the torus).
    flat = dist.new_group(backend="torus", pg_options=TorusOptions(
        shape=shape, algorithm="flat", cuda_engine=engine))
    large.fill_(40000.0)
    dist.all_reduce(large, op=dist.ReduceOp.AVG, group=flat)
    assert torch.equal(large, torch.full_like(large, 40000.0))
    assert pipeline_calls() == checked + 1 + 1 + 1 + 20 + 1

    # Captured into a CUDA graph, an allreduce is the whole group's NCCL allreduce (the pipeline
    # queries events on the host, which a capture records only at replay); replays reduce anew.
    # Gloo's engine works through host memory, which no capture can take: a named error.
    static = torch.zeros(1000, device=device)
    graph = torch.cuda.CUDAGraph()
    if engine == "gloo":
        with pytest.raises(RuntimeError, match="cannot capture the Gloo CUDA engine"):
            with torch.cuda.graph(graph):
                dist.all_reduce(static)
        assert pipeline_calls() == checked + 1 + 1 + 1 + 20 + 1
        return checked
    with torch.cuda.graph(graph):
        dist.all_reduce(static)
    for value in (1.0, 2.0):
        static.fill_(value + rank)
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(static, torch.full_like(static, expected("SUM", value, world_size)))
    assert pipeline_calls() == checked + 1 + 1 + 1 + 20 + 1, "a captured call ran the pipeline"
    return checked


@pytest.mark.parametrize("shape, engine", PIPELINES)
@pytest.mark.slow
def test_allreduce_matches_closed_form(shape, engine):
    checked = run_ranks(allreduce_on_gpus, shape[0] * shape[1], shape, engine, deadline=300)
    assert checked[0] == 3 * 4 * 3 - 3


def calls_on_one_tensor(rank, world_size, port, shape, engine):
    """Collectives on one tensor issued back to back, none waited for, run in the order they
    were issued, as one NCCL group's do: a torus call read the tensor while the one before still
    wrote it (in place, and through the flat copy where a row has two or more columns and a
    length none divides), and a broadcast after a torus call did not wait for it. The
    broadcasts are left out on Gloo's CUDA engine, whose two worker threads may run one beside
    the next call's comparison (README: a torus call after it needs a wait() there)."""
    device = init(rank, world_size, port, shape, engine=engine)
    for numel in (1 << 16, (1 << 16) + 1):
        tensor = torch.full((numel,), float(rank + 1), device=device)
        nccl = engine == "nccl"
        works = [dist.broadcast(tensor, world_size - 1, async_op=True)] if nccl else []
        works += [dist.all_reduce(tensor, async_op=True), dist.all_reduce(tensor, async_op=True)]
        works += [dist.broadcast(tensor, 0, async_op=True)] if nccl else []
        works.append(dist.all_reduce(tensor, async_op=True))
        for work in works:
            work.wait()
        # The first allreduce sums world_size copies of world_size (after the broadcast from
        # the last rank) or 1 + ... + world_size; the two after it multiply by world_size each.
        first = world_size * world_size if nccl else world_size * (world_size + 1) // 2
        want = float(first * world_size * world_size)
        assert torch.equal(tensor, torch.full_like(tensor, want)), (numel, tensor.unique())
    assert pipeline_calls() == 6
    # Calls the pipeline cannot run (a bitwise op, which NCCL has not; a dtype outside the
    # pipeline's) are the engine's own to reduce or refuse, for that call alone: the next
    # allreduce runs (refused inside the pipeline, they failed the backend for every later call).
    bits = torch.full((8,), 3 + 4 * rank, dtype=torch.int32, device=device)
    try:
        dist.all_reduce(bits, op=dist.ReduceOp.BAND)
        assert torch.equal(bits, torch.full_like(bits, 3))  # 3 & 7 (& 11 & 15)
    except (RuntimeError, ValueError, TypeError) as error:
        assert "BAND" in str(error), error
    unusual = torch.full((8,), rank + 1, dtype=torch.uint16, device=device)
    try:
        dist.all_reduce(unusual)
        assert unusual.tolist() == [world_size * (world_size + 1) // 2] * 8
    except (RuntimeError, ValueError, TypeError) as error:
        assert "UInt16" in str(error) or "uint16" in str(error) or "type" in str(error), error
    # A sparse tensor goes to the engine too (the write order once asked it for its storage,
    # which a sparse tensor has not: every sparse allreduce raised).
    sparse = torch.sparse_coo_tensor([[rank]], [1.0], (world_size,), device=device)
    try:
        dist.all_reduce(sparse)
        assert torch.equal(sparse.to_dense(), torch.ones(world_size, device=device))
    except RuntimeError as error:  # an engine without sparse allreduce says so
        assert "storage" not in str(error), error
    after = torch.full((100,), float(rank), device=device)
    dist.all_reduce(after)
    assert torch.equal(after, torch.full_like(after, float(sum(range(world_size)))))
    assert pipeline_calls() == 7
    dist.destroy_process_group()


@pytest.mark.parametrize("shape, engine", PIPELINES)
@pytest.mark.slow
def test_calls_on_one_tensor_run_in_issue_order(shape, engine):
    run_ranks(calls_on_one_tensor, shape[0] * shape[1], shape, engine, deadline=300)


def ddp_on_gpus(rank, world_size, port, shape, engine):
    # Small buckets and segments: several allreduces of several segments overlap the backward.
    device = init(rank, world_size, port, shape, segment_bytes=256, engine=engine)
    torch.manual_seed(0)
    model = SmallConvNet().double().to(device)
    steps, batch = 4, 16
    shard = slice(rank * batch // world_size, (rank + 1) * batch // world_size)
    batches = [(x[shard].to(device), y[shard].to(device)) for x, y in global_batches(steps, batch)]
    ddp = torch.nn.parallel.DistributedDataParallel(model, device_ids=[device.index],
                                                    bucket_cap_mb=0.001)
    result = train(ddp, batches, steps).cpu().tolist()  # tensors cannot outlive the rank
    assert pipeline_calls() > steps
    return result


@pytest.mark.parametrize("shape, engine", PIPELINES)
@pytest.mark.slow
def test_ddp_matches_one_process(shape, engine):
    results = run_ranks(ddp_on_gpus, shape[0] * shape[1], shape, engine, deadline=300)
    torch.manual_seed(0)
    whole_batch = train(SmallConvNet().double(), global_batches(4, 16), 4)
    for rank, result in enumerate(results):
        torch.testing.assert_close(torch.tensor(result, dtype=torch.float64), whole_batch,
                                   rtol=1e-6, atol=1e-6, msg=f"rank {rank}: torus vs one process")


def late_peer(rank, world_size, port):
    # The pipeline's deadlines decide here: NCCL's watchdog would end the process on a timeout.
    os.environ.update(TORCH_NCCL_ASYNC_ERROR_HANDLING="0", TORCH_NCCL_DUMP_ON_TIMEOUT="0",
                      TORCH_NCCL_ENABLE_MONITORING="0")
    device = init(rank, world_size, port, (2, 1))
    short = dist.new_group(backend="torus", timeout=datetime.timedelta(seconds=3),
                           pg_options=TorusOptions(shape=(2, 1), algorithm="torus"))
    for group in (None, short):  # every group is connected
        dist.all_reduce(torch.ones(10, device=device), group=group)
    torch.cuda.synchronize()
    if rank == 1:
        time.sleep(10)  # joins nothing more; exits after rank 0 has seen both failures
        return None
    outcome = {}
    start = time.monotonic()
    # The group's own timeout, through the future (wait() without a timeout only makes the
    # stream wait, as NCCL's does).
    late = dist.all_reduce(torch.ones(1000, device=device), group=short, async_op=True)
    try:
        late.get_future().wait()
    except RuntimeError as error:
        outcome["deadline"] = (time.monotonic() - start, str(error))
    try:  # a failure known by then: wait() raises it
        late.wait()
    except RuntimeError as error:
        outcome["known"] = str(error)
    work = dist.all_reduce(torch.ones(1000, device=device), async_op=True)
    start = time.monotonic()
    try:
        work.wait(datetime.timedelta(seconds=1))
    except RuntimeError as error:
        outcome["wait"] = (time.monotonic() - start, str(error))
    outcome["work"] = (work.is_completed(), work.is_success())
    try:
        dist.all_reduce(torch.ones(10, device=device))
    except RuntimeError as error:
        outcome["refused"] = str(error)
    return outcome


@CUDA
@needs_gpus(2)
@pytest.mark.slow
def test_late_peer_fails_named_and_refuses_later_allreduces():
    outcome = run_ranks(late_peer, 2, deadline=120)[0]
    phase, where = "reduce-scatter along row 0 (ranks 0, 1)", "rank 0 at x=0, y=0 of a 2x1 torus"
    seconds, message = outcome["deadline"]
    assert 2.5 < seconds < 3 + 5, f"the 3 s timeout fired after {seconds:.1f} s"
    # NCCL's watchdog or the pipeline's deadline, whichever sees it first: the phase is named.
    assert message.startswith("torus allreduce") and phase in message and where in message, message
    assert outcome["known"] == message
    seconds, message = outcome["wait"]
    assert 0.9 < seconds < 3, f"wait(1 s) returned after {seconds:.1f} s"
    timed_out = (f"torus allreduce timed out after 1000 ms: {where} waits for the {phase}, "
                 "segment 1 of 1")
    assert message.startswith(timed_out), message
    assert outcome["work"] == (True, False)
    assert outcome["refused"].startswith(
        f"torus backend is unusable after an earlier failure: {timed_out}"), outcome["refused"]


def one_gpu(rank, world_size, port):
    """World size 1: the whole group's allreduce (NCCL's), as the torus hands it on."""
    dist.init_process_group("torus", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world_size, timeout=datetime.timedelta(seconds=60))
    device = torch.device("cuda", 0)
    result = {}
    # The Work completes with the stream, not when NCCL is enqueued. NCCL's communicator is
    # made at the first collective, which took longer than the sleep on an H200: made first.
    tensor = torch.ones(1 << 20, device=device)
    dist.all_reduce(torch.ones(1, device=device))
    torch.cuda.synchronize()
    torch.cuda._sleep(int(2e9))  # about a second of GPU time before the allreduce can run
    work = dist.all_reduce(tensor, async_op=True)
    result["completed while the stream sleeps"] = work.is_completed()
    result["the stream still sleeps"] = not torch.cuda.current_stream().query()
    work.wait()  # the current stream waits; the host does not
    result["sum"] = tensor.sum().item()  # a host read after the stream
    torch.cuda.synchronize()
    # (Work.is_success and Work.exception are deprecated: NCCL's raises, Python cannot read
    # the other's result; a second wait raises if the Work failed.)
    result["completed after"] = work.is_completed() and work.wait()
    # A strided view, as on the CPU.
    matrix = torch.arange(3000.0, device=device).view(100, 30)
    view, untouched = matrix[:, ::3], matrix[:, 1::3].clone()
    expected = view.clone()
    dist.all_reduce(view)
    result["view"] = torch.equal(view, expected) and torch.equal(matrix[:, 1::3], untouched)
    # Handed on as they are: run synchronously, NCCL returns no Work (torch >= 2.8).
    source = torch.arange(6.0, device=device)
    dist.broadcast(source, src=0)
    gathered = torch.empty(6, device=device)
    dist.all_gather_into_tensor(gathered, source)
    dist.barrier()
    asynchronous = dist.broadcast(source, src=0, async_op=True)
    asynchronous.wait()
    result["handed on"] = torch.equal(gathered, torch.arange(6.0, device=device))
    dist.destroy_process_group()
    return result


@CUDA
@needs_cuda
@pytest.mark.slow
def test_one_gpu_allreduce_completes_with_the_stream():
    """(AVG's one division shows only with several ranks: allreduce_on_gpus's AVG rows.)"""
    result = run_ranks(one_gpu, 1, deadline=120)[0]
    assert result == {"completed while the stream sleeps": False, "the stream still sleeps": True,
                      "sum": float(1 << 20),
                      "completed after": True, "view": True, "handed on": True}
