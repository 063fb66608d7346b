"""Benchmark one optimizer step over ResNet-50's parameters: torch_bigbatch.optim.SGD against
torch.optim.SGD with foreach=True and with fused=True, and torch_bigbatch.optim.LARS, all
measured in the same run.

Every variant steps its own copy of ResNet-50's 161 parameter tensors (25,557,032 elements)
with random gradients, lr 0.1, momentum 0.9, weight decay 1e-4 and Nesterov momentum, after one
warm-up step that creates the momentum buffers. torch.utils.benchmark.Timer times the steps,
the variants taking turns over several rounds;
the table gives the median ms per step, the speedup against torch's fused SGD, and the
achieved bandwidth (a step reads p, g, b and writes p, b: 5 * numel * element size bytes)
as GB/s and as a % of a device-to-device copy measured in the same run.

With --one-element, every tensor has one element: the step's cost apart from its bytes (the
host's work in Python and C++ and the launches), which bounds a step on a GPU that moves the
bytes faster than the host prepares the launch; bandwidth is not reported then.

Run it from the repository root:

    python benchmarks/bench_optimizer.py                    # CPU, and CUDA when available
    python benchmarks/bench_optimizer.py --device cuda --dtype bfloat16 --csv results.csv
    python benchmarks/bench_optimizer.py --one-element --device cpu
"""

import os
import statistics

import torch

import torch_bigbatch
from common import DTYPES, argument_parser, device_name, median_ms, pick_devices, write_csv

HYPERPARAMETERS = {"lr": 0.1, "momentum": 0.9, "weight_decay": 1e-4, "nesterov": True}
VARIANTS = {
    "torch foreach": lambda params: torch.optim.SGD(params, foreach=True, **HYPERPARAMETERS),
    "torch fused": lambda params: torch.optim.SGD(params, fused=True, **HYPERPARAMETERS),
    "torch_bigbatch": lambda params: torch_bigbatch.optim.SGD(params, **HYPERPARAMETERS),
    # Every tensor's two norms, then the same update: the target is <= 1.3x the SGD step.
    "torch_bigbatch LARS": lambda params: torch_bigbatch.optim.LARS(params, **HYPERPARAMETERS),
}
BASELINE = "torch fused"
COPY_BYTES = 512 * 2**20
CSV_FIELDS = ["device", "dtype", "variant", "ms_per_step", "speedup_vs_torch_fused",
              "gb_per_s", "pct_of_copy"]


def make_params(shapes, grads, device, dtype):
    """Parameters with the given gradients, all on device in dtype."""
    params = []
    for shape, grad in zip(shapes, grads):
        param = torch.randn(shape, device=device, dtype=dtype, requires_grad=True)
        param.grad = grad.to(device=device, dtype=dtype, copy=True)
        params.append(param)
    return params


def copy_gb_per_s(device, min_run_time):
    """Device-to-device copy bandwidth, counting the bytes read and written."""
    src = torch.empty(COPY_BYTES, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    ms = median_ms("dst.copy_(src)", {"dst": dst, "src": src}, min_run_time)
    return 2 * COPY_BYTES / ms / 1e6


def bench_device(shapes, device, dtype, min_run_time, rounds, bandwidth=True):
    """One row per variant (median ms/step, speedup, bandwidth unless not `bandwidth`), and the
    copy GB/s (None without bandwidth). The variants take turns over `rounds` rounds, so a drift
    in the machine's speed (it is shared) hits them alike; a variant's time is the median of
    its rounds' medians."""
    grads = [torch.randn(shape) for shape in shapes]
    optimizers = {}
    for name, make_optimizer in VARIANTS.items():
        optimizers[name] = make_optimizer(make_params(shapes, grads, device, dtype))
        optimizers[name].step()  # warm-up: creates the momentum buffers
    per_round = {name: [] for name in optimizers}
    for _ in range(rounds):
        for name, optimizer in optimizers.items():
            per_round[name].append(median_ms("optimizer.step()", {"optimizer": optimizer},
                                             min_run_time / rounds))
    timings = {name: statistics.median(times) for name, times in per_round.items()}
    del optimizers

    step_bytes = 5 * sum(shape.numel() for shape in shapes) * dtype.itemsize
    copy = copy_gb_per_s(device, min_run_time) if bandwidth else None
    rows = []
    for name, ms in timings.items():
        gb_per_s = step_bytes / ms / 1e6 if bandwidth else None
        rows.append({"device": device, "dtype": str(dtype).removeprefix("torch."),
                     "variant": name, "ms_per_step": ms,
                     "speedup_vs_torch_fused": timings[BASELINE] / ms,
                     "gb_per_s": gb_per_s, "pct_of_copy": gb_per_s and 100 * gb_per_s / copy})
    return rows, copy


def print_table(rows, copies):
    header = (f"{'device':<6} {'variant':<19} {'ms/step':>9} {'vs fused':>9} "
              f"{'GB/s':>7} {'% copy':>7}")
    print(header)
    print("-" * len(header))
    for row in rows:
        bandwidth = ("       -       -" if row["gb_per_s"] is None
                     else f"{row['gb_per_s']:>7.0f} {row['pct_of_copy']:>6.1f}%")
        print(f"{row['device']:<6} {row['variant']:<19} {row['ms_per_step']:>9.3f} "
              f"{row['speedup_vs_torch_fused']:>8.2f}x {bandwidth}")
    for device in copies:
        ms = {row["variant"]: row["ms_per_step"] for row in rows if row["device"] == device}
        print(f"{device} LARS step / SGD step: "
              f"{ms['torch_bigbatch LARS'] / ms['torch_bigbatch']:.2f}x")
    for device, copy in copies.items():
        if copy is not None:
            print(f"{device} copy_ of {COPY_BYTES // 2**20} MiB (read + write): {copy:.0f} GB/s")


def main():
    args = argument_parser(__doc__, min_run_time=3.0, rounds=5, extra=[
        (("--one-element",), {"action": "store_true",
                              "help": "one element per tensor: the step's cost apart from bytes"}),
    ]).parse_args()
    devices = pick_devices(args.device)
    with torch.device("meta"):  # the shapes only: no memory, no initialization
        shapes = [parameter.shape for parameter in torch_bigbatch.models.resnet50().parameters()]
    if args.one_element:
        shapes = [torch.Size([1])] * len(shapes)
    numel = sum(shape.numel() for shape in shapes)

    torch.set_num_threads(os.cpu_count())
    torch.manual_seed(0)
    names = ", ".join(f"{device}: {device_name(device)}" for device in devices)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, {names}; "
          f"ResNet-50 SGD step ({len(shapes)} tensors, {numel:,} elements, {args.dtype})")

    rows, copies = [], {}
    for device in devices:
        device_rows, copies[device] = bench_device(shapes, device, DTYPES[args.dtype],
                                                   args.min_run_time, args.rounds,
                                                   bandwidth=not args.one_element)
        rows += device_rows
    if args.csv:
        write_csv(args.csv, rows, CSV_FIELDS)
    print_table(rows, copies)


if __name__ == "__main__":
    main()
