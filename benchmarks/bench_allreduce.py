"""Benchmark allreduce on this machine: backend "torus" against plain "gloo", same run.

P processes (one per rank, OMP_NUM_THREADS=1 as torchrun sets it) join a Gloo group and one
torus group per algorithm asked for ("auto": the default, measuring per size class; "torus":
always the 2D torus), all of the same ranks. For every size, each group is warmed up (auto
until it has decided), then the groups take turns over several rounds; a round times `--iters`
back-to-back synchronous fp32 allreduces after a barrier. The tables give the median time of
one allreduce on rank 0, the bus bandwidth (nccl-tests' convention: bytes * 2(p-1)/p / time),
each algorithm's speedup over Gloo, what auto runs, and the CPU seconds of one allreduce (user
+ system, all ranks' processes, from the OS's accounting) against Gloo's.

With --device cuda the tensors are on GPU 0, which every rank shares: the torus groups take
Gloo's CUDA engine (TorusOptions.cuda_engine="gloo"; NCCL refuses two ranks on one GPU) and the
baseline is Gloo's own CUDA allreduce. Both go through host memory, so this shows what "auto"
picks among them on one GPU's ranks, not what NCCL across GPUs would run.

Run it from the repository root:

    python benchmarks/bench_allreduce.py                        # 16 ranks as 4x4, 8 as 2x4
    python benchmarks/bench_allreduce.py --shapes 2x2 --sizes 4K 64M --csv allreduce.csv
    python benchmarks/bench_allreduce.py --device cuda --shapes 2x2 4x1
"""

import argparse
import datetime
import os
import queue
import resource
import statistics
import time

os.environ.setdefault("OMP_NUM_THREADS", "1")

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402

import torch_bigbatch  # noqa: E402
from common import positive_int, taking_turns, write_csv  # noqa: E402
from torch_bigbatch.distributed import (TorusOptions, parse_shape, torus_algorithm,  # noqa: E402
                                        torus_algorithm_table)
from torch_bigbatch.distributed.cost_model.alpha_beta import default_segment_bytes  # noqa: E402

UNITS = {"K": 2**10, "M": 2**20, "G": 2**30}
DEFAULT_SIZES = [4 << 10, 16 << 10, 64 << 10, 256 << 10, 1 << 20, 4 << 20, 16 << 20, 64 << 20]
CSV_FIELDS = ["device", "shape", "ranks", "bytes", "backend", "ms", "bus_gb_per_s",
              "speedup_vs_gloo", "runs", "cpu_ms", "cpu_vs_gloo"]
MAX_WARM_UP_CALLS = 100  # auto decides after 4 candidates x 5 trial calls and 16 more at most


def warm_up(tensor, name, group):
    """Connections, allocations, and for a torus group its trials of this size: calls until the
    size's algorithm is decided (every rank decides at the same call)."""
    dist.all_reduce(tensor, group=group)
    for _ in range(MAX_WARM_UP_CALLS):
        if name == "gloo" or torus_algorithm(tensor.nbytes, group,
                                             tensor.device.type) != "measuring":
            return
        dist.all_reduce(tensor, group=group)
    raise RuntimeError(f"{name}: the algorithm of {tensor.nbytes} bytes is still measured after "
                       f"{MAX_WARM_UP_CALLS} calls")


def parse_size(text):
    """Bytes of "4K", "1M", "64MiB" or "4096": an argparse type (a multiple of 4, a float32's)."""
    text = str(text).strip().upper().removesuffix("IB").removesuffix("B")
    scale = UNITS.get(text[-1:], 1)
    try:
        nbytes = int(float(text.rstrip("KMG")) * scale)
    except ValueError:
        raise argparse.ArgumentTypeError(f'a size is bytes or a number with K, M or G, such as '
                                         f'"64K"; got {text!r}') from None
    if nbytes < 4 or nbytes % 4:
        raise argparse.ArgumentTypeError(f"a size is a positive multiple of 4 bytes (float32 "
                                         f"elements), got {text!r}")
    return nbytes


def label(nbytes):
    for unit in ("G", "M", "K"):
        if nbytes >= UNITS[unit] and nbytes % UNITS[unit] == 0:
            return f"{nbytes // UNITS[unit]} {unit}iB"
    return f"{nbytes} B"


def cpu_seconds():
    """User + system seconds of this process, every thread (Gloo's included)."""
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def time_round(run, group, iters, device):
    """(wall seconds, CPU seconds of this process) per call of `run` over `iters` calls,
    started together on every rank, until the device has finished them."""
    if device.type == "cuda":
        torch.cuda.synchronize()
    dist.barrier(group=group)
    start, cpu_start = time.perf_counter(), cpu_seconds()
    for _ in range(iters):
        run()
    if device.type == "cuda":
        torch.cuda.synchronize()
    return (time.perf_counter() - start) / iters, (cpu_seconds() - cpu_start) / iters


def describe_choice(nbytes, group, device):
    """What a torus group runs for this size: "flat", "torus", "torus 16M" (its segment size
    where it is not the default one) or "torus 1-shot" (its one-shot form: chosen by "auto",
    or the forced torus's on CPU tensors up to _C.torus_one_shot_max_bytes)."""
    rows = [row for row in torus_algorithm_table(group) if row["device"] == device.type
            and row["min_bytes"] <= nbytes <= row["max_bytes"]]
    algorithm = torus_algorithm(nbytes, group, device.type)
    default_segment = default_segment_bytes(device.type, dist.get_world_size(group))
    one_shot = rows[0]["one_shot"] if rows else (
        device.type == "cpu" and nbytes <= torch_bigbatch._C.torus_one_shot_max_bytes)
    if algorithm == "torus" and one_shot:
        return "torus 1-shot"
    if rows and algorithm == "torus" and rows[0]["segment_bytes"] != default_segment:
        return "torus " + label(rows[0]["segment_bytes"]).replace(" ", "").removesuffix("iB")
    return algorithm


def worker(rank, world, shape, sizes, args, port, results):
    torch.set_num_threads(1)
    device = torch.device(args.device)
    if device.type == "cuda":
        torch.cuda.set_device(0)  # every rank: Gloo's CUDA collectives let them share it
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world, timeout=datetime.timedelta(seconds=120))
    groups = {"gloo": dist.group.WORLD}
    for algorithm in args.algorithms:
        groups[algorithm] = dist.new_group(backend="torus", pg_options=TorusOptions(
            shape=shape, algorithm=algorithm, segment_bytes=args.segment_bytes,
            cuda_engine="gloo" if device.type == "cuda" else None))
    rows = []
    for nbytes in sizes:
        tensor = torch.ones(nbytes // 4, device=device)
        iters = max(1, min(args.iters, (64 << 20) // max(nbytes, 1)))
        times, cpu = {}, {}
        for name, group in groups.items():
            warm_up(tensor, name, group)
        for name, group in taking_turns(groups.items(), args.rounds):
            seconds, cpu_seconds_here = time_round(
                lambda: dist.all_reduce(tensor, group=group), group, iters, device)
            times.setdefault(name, []).append(seconds)
            cpu.setdefault(name, []).append(cpu_seconds_here)
        medians = {name: statistics.median(values) for name, values in times.items()}
        # Every rank's median CPU seconds per call, summed over the ranks.
        cpu_total = torch.tensor([statistics.median(cpu[name]) for name in groups],
                                 dtype=torch.float64)
        dist.all_reduce(cpu_total)
        cpu_ms = dict(zip(groups, (cpu_total * 1e3).tolist()))
        for name, seconds in medians.items():
            bus = nbytes * 2 * (world - 1) / world / seconds / 1e9
            runs = "gloo" if name == "gloo" else describe_choice(nbytes, groups[name], device)
            rows.append({"device": device.type, "shape": f"{shape[0]}x{shape[1]}", "ranks": world,
                         "bytes": nbytes,
                         "backend": name, "ms": seconds * 1e3, "bus_gb_per_s": bus,
                         "speedup_vs_gloo": medians["gloo"] / seconds, "runs": runs,
                         "cpu_ms": cpu_ms[name], "cpu_vs_gloo": cpu_ms[name] / cpu_ms["gloo"]})
    if rank == 0:
        results.put(rows)
    dist.destroy_process_group()


def run_shape(shape, sizes, args, port):
    world = shape[0] * shape[1]
    context = mp.get_context("spawn")
    results = context.Queue()
    processes = [context.Process(target=worker, args=(rank, world, shape, sizes, args, port,
                                                      results)) for rank in range(world)]
    for process in processes:
        process.start()
    give_up = time.monotonic() + 1800
    while True:  # a rank that died leaves no row: fail at once, do not hang
        try:
            rows = results.get(timeout=1)
            break
        except queue.Empty:
            died = {rank: process.exitcode for rank, process in enumerate(processes)
                    if process.exitcode not in (None, 0)}
            if died or time.monotonic() > give_up:
                for process in processes:
                    process.kill()
                raise RuntimeError(f"{shape[0]}x{shape[1]}: ranks ended without a result "
                                   f"(exit codes {died})" if died else "no result in 30 min")
    for process in processes:
        process.join()
    return rows


def print_table(rows):
    names = list(dict.fromkeys(row["backend"] for row in rows))
    print(f"\n{rows[0]['ranks']} ranks as {rows[0]['shape']} ({rows[0]['device']} fp32 allreduce, "
          "median ms; speedup over Gloo, and what auto ran)")
    header = f"{'size':>9} | " + " | ".join(f"{name + ' ms':>10}" for name in names)
    print(header + " | " + " | ".join(f"{name + ' x':>8}" for name in names[1:]))
    by_size = {}
    for row in rows:
        by_size.setdefault(row["bytes"], {})[row["backend"]] = row
    for nbytes, group in by_size.items():
        times = " | ".join(f"{group[name]['ms']:10.2f}" for name in names)
        speedups = " | ".join(f"{group[name]['speedup_vs_gloo']:7.2f}x" for name in names[1:])
        ran = f"  ({group['auto']['runs']})" if "auto" in group else ""
        print(f"{label(nbytes):>9} | {times} | {speedups}{ran}")
    print("\nCPU ms per allreduce (user + system, all ranks), and against Gloo's")
    print(f"{'size':>9} | " + " | ".join(f"{name + ' cpu':>10}" for name in names) + " | "
          + " | ".join(f"{name + '/gloo':>10}" for name in names[1:]))
    for nbytes, group in by_size.items():
        cpu = " | ".join(f"{group[name]['cpu_ms']:10.2f}" for name in names)
        ratios = " | ".join(f"{group[name]['cpu_vs_gloo']:10.2f}" for name in names[1:])
        print(f"{label(nbytes):>9} | {cpu} | {ratios}")


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shapes", nargs="+", default=["4x4", "2x4"], help='"XxY" each')
    parser.add_argument("--sizes", nargs="+", type=parse_size, default=DEFAULT_SIZES,
                        help="e.g. 4K 1M 64M")
    parser.add_argument("--iters", type=positive_int, default=20, help="allreduces per round (fewer "
                        "for large sizes: at most 64 MiB moved per round)")
    parser.add_argument("--rounds", type=positive_int, default=5)
    parser.add_argument("--algorithms", nargs="+", default=["auto", "torus"],
                        choices=("auto", "torus", "flat"), help="torus groups to time")
    parser.add_argument("--segment-bytes", type=parse_size, help="default: TorusOptions'")
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                        help="cuda: every rank on GPU 0, through Gloo's CUDA collectives")
    parser.add_argument("--port", type=int, default=29655)
    parser.add_argument("--csv", help="also write the rows to this CSV file")
    args = parser.parse_args()
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: no GPU is visible")
    sizes = args.sizes
    all_rows = []
    for index, spec in enumerate(args.shapes):
        rows = run_shape(parse_shape(spec), sizes, args, args.port + index)
        print_table(rows)
        all_rows += rows
    if args.csv:
        write_csv(args.csv, all_rows, CSV_FIELDS)


if __name__ == "__main__":
    main()
