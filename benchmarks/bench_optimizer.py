"""Benchmark one optimizer step over ResNet-50's parameters: torch_bigbatch.optim.SGD against
torch.optim.SGD with foreach=True and with fused=True, and torch_bigbatch.optim.LARS, all
measured in the same run.

Every variant steps its own copy of ResNet-50's 161 parameter tensors (25,557,032 elements)
with random gradients, lr 0.1, momentum 0.9, weight decay 1e-4 and Nesterov momentum, after one
warm-up step that creates the momentum buffers. torch.utils.benchmark.Timer times the steps,
the variants taking turns over several rounds;
the table gives the median ms per step, the speedup against torch's fused SGD (its foreach
SGD where the fused one steps wrong in this dtype: checked before timing), and the
achieved bandwidth (a step reads p, g, b and writes p, b: 5 * numel * element size bytes)
as GB/s and, on a GPU, as a % of a device-to-device copy measured in the same run (on a CPU
the copy's write-allocate traffic, which it does not count, makes it no bound).

With --one-element, every tensor has one element: the step's cost apart from its bytes (the
host's work in Python and C++ and the launches), which bounds a step on a GPU that moves the
bytes faster than the host prepares the launch; bandwidth is not reported then.

With --grad-scaler, every variant steps through its own torch.amp.GradScaler, as an AMP
training loop does (scaler.scale, scaler.step, scaler.update; finite gradients): torch's fused
SGD and ours take the scale and the inf flag in the step, torch's foreach SGD is unscaled by
the scaler first.

Run it from the repository root:

    python benchmarks/bench_optimizer.py                    # CPU, and CUDA when available
    python benchmarks/bench_optimizer.py --device cuda --dtype bfloat16 --csv results.csv
    python benchmarks/bench_optimizer.py --one-element --device cpu
    python benchmarks/bench_optimizer.py --one-element --device cpu --grad-scaler
"""

import functools
import os
import statistics

import torch

import torch_bigbatch
from common import (DTYPES, argument_parser, device_name, median_ms, pick_devices,
                    taking_turns, write_csv)

HYPERPARAMETERS = {"lr": 0.1, "momentum": 0.9, "weight_decay": 1e-4, "nesterov": True}
VARIANTS = {
    "torch foreach": lambda params: torch.optim.SGD(params, foreach=True, **HYPERPARAMETERS),
    "torch fused": lambda params: torch.optim.SGD(params, fused=True, **HYPERPARAMETERS),
    "torch_bigbatch": lambda params: torch_bigbatch.optim.SGD(params, **HYPERPARAMETERS),
    # Every tensor's two norms, then the same update: the target is <= 1.3x the SGD step.
    "torch_bigbatch LARS": lambda params: torch_bigbatch.optim.LARS(params, **HYPERPARAMETERS),
}
# The ratios' baseline: the first of these that steps right (torch's fused CPU SGD in bfloat16
# and float16 did not, on torch 2.13: errors of 1.4 on values of 1).
BASELINES = ("torch fused", "torch foreach")
COPY_BYTES = 512 * 2**20
CSV_FIELDS = ["device", "dtype", "variant", "ms_per_step", "baseline", "speedup_vs_baseline",
              "gb_per_s", "pct_of_copy"]


def make_params(shapes, grads, device, dtype):
    """Parameters with the given gradients, all on device in dtype."""
    params = []
    for shape, grad in zip(shapes, grads):
        param = torch.randn(shape, device=device, dtype=dtype, requires_grad=True)
        param.grad = grad.to(device=device, dtype=dtype, copy=True)
        params.append(param)
    return params


def steps_right(make_optimizer, shapes, grads, device, dtype):
    """Whether two steps of the optimizer in `dtype` land within a few roundings of the dtype
    (of values about 1, as the parameters and gradients are) of torch.optim.SGD's for-loop
    steps (the reference implementation) in float32 from the same values."""
    tolerance = 4 * torch.finfo(dtype).eps
    params = make_params(shapes, grads, device, dtype)
    exact = [param.detach().float().clone().requires_grad_() for param in params]
    for param, reference in zip(params, exact):
        reference.grad = param.grad.float()
    optimizer = make_optimizer(params)
    reference_optimizer = torch.optim.SGD(exact, foreach=False, **HYPERPARAMETERS)
    for _ in range(2):
        optimizer.step()
        reference_optimizer.step()
    try:
        for param, reference in zip(params, exact):
            torch.testing.assert_close(param.detach().float(), reference.detach(),
                                       rtol=tolerance, atol=tolerance)
    except AssertionError:
        return False
    return True


def baseline(shapes, grads, device, dtype):
    """The first of BASELINES that steps right in this dtype on this device."""
    for name in BASELINES:
        if steps_right(VARIANTS[name], shapes, grads, device, dtype):
            return name
    raise RuntimeError(f"no torch SGD steps right in {dtype} on {device}: no baseline")


def copy_gb_per_s(device, min_run_time):
    """Device-to-device copy bandwidth, counting the bytes read and written."""
    src = torch.empty(COPY_BYTES, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    ms = median_ms("dst.copy_(src)", {"dst": dst, "src": src}, min_run_time)
    return 2 * COPY_BYTES / ms / 1e6


def step_under_grad_scaler(optimizer, scaler, one):
    """One AMP training step's optimizer part, as a loop does it."""
    scaler.scale(one)  # what scaler.scale(loss) does before backward: the scale's tensor
    scaler.step(optimizer)
    scaler.update()


def bench_device(shapes, device, dtype, min_run_time, rounds, bandwidth=True,
                 grad_scaler=False):
    """One row per variant (median ms/step, speedup, bandwidth unless not `bandwidth`), and the
    copy GB/s (None without bandwidth). The variants take turns over `rounds` rounds, so a drift
    in the machine's speed (it is shared) hits them alike; a variant's time is the median of
    its rounds' medians. `grad_scaler`: each step through a GradScaler of its own (the
    gradients stay as they are: a scale of 1)."""
    grads = [torch.randn(shape) for shape in shapes]
    baseline_name = baseline(shapes, grads, device, dtype)
    steps = {}
    for name, make_optimizer in VARIANTS.items():
        optimizer = make_optimizer(make_params(shapes, grads, device, dtype))
        if grad_scaler:
            scaler = torch.amp.GradScaler(device, init_scale=1.0, growth_interval=2**30)
            step = functools.partial(step_under_grad_scaler, optimizer, scaler,
                                     torch.ones((), device=device))
        else:
            step = optimizer.step
        step()  # warm-up: creates the momentum buffers
        steps[name] = ("step()", {"step": step})
    per_round = {name: [] for name in steps}
    for name, (stmt, globals_) in taking_turns(steps.items(), rounds):
        per_round[name].append(median_ms(stmt, globals_, min_run_time / rounds))
    timings = {name: statistics.median(times) for name, times in per_round.items()}
    del steps

    step_bytes = 5 * sum(shape.numel() for shape in shapes) * dtype.itemsize
    # On a CPU a copy's stores first read their cache lines (write-allocate), traffic it does
    # not count: the in-place step came out above 100% of it. A GPU's copy is the bound.
    copy = copy_gb_per_s(device, min_run_time) if bandwidth and device != "cpu" else None
    rows = []
    for name, ms in timings.items():
        gb_per_s = step_bytes / ms / 1e6 if bandwidth else None
        rows.append({"device": device, "dtype": str(dtype).removeprefix("torch."),
                     "variant": name, "ms_per_step": ms, "baseline": baseline_name,
                     "speedup_vs_baseline": timings[baseline_name] / ms,
                     "gb_per_s": gb_per_s,
                     "pct_of_copy": copy and 100 * gb_per_s / copy})
    return rows, copy


def print_table(rows, copies):
    header = (f"{'device':<6} {'variant':<19} {'ms/step':>9} {'vs base':>9} "
              f"{'GB/s':>7} {'% copy':>7}")
    print(header)
    print("-" * len(header))
    for row in rows:
        bandwidth = ("       -" if row["gb_per_s"] is None else f"{row['gb_per_s']:>7.0f}")
        bandwidth += ("       -" if row["pct_of_copy"] is None
                      else f" {row['pct_of_copy']:>6.1f}%")
        print(f"{row['device']:<6} {row['variant']:<19} {row['ms_per_step']:>9.3f} "
              f"{row['speedup_vs_baseline']:>8.2f}x {bandwidth}")
    for device in copies:
        name = next(row["baseline"] for row in rows if row["device"] == device)
        print(f"{device} baseline (vs base): {name}"
              + ("" if name == BASELINES[0] else
                 f" ({BASELINES[0]} stepped wrong in this dtype: not timed as one)"))
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
        (("--grad-scaler",), {"action": "store_true",
                              "help": "every step through a torch.amp.GradScaler"}),
    ]).parse_args()
    devices = pick_devices(args.device)
    if args.grad_scaler and args.dtype == "float16":
        # GradScaler refuses float16 gradients anywhere ("Attempting to unscale FP16
        # gradients"): scaled training keeps float32 parameters
        raise SystemExit("--grad-scaler: GradScaler cannot unscale float16 gradients (AMP "
                         "keeps float32 parameters); use --dtype float32")
    if args.grad_scaler and args.dtype == "bfloat16" and "cuda" in devices:
        # torch's foreach variant needs GradScaler's unscale, which has no CUDA bfloat16 kernel
        raise SystemExit("--grad-scaler: GradScaler cannot unscale bfloat16 gradients on CUDA "
                         "(bfloat16 needs no scaler); use --dtype float32, or --device cpu")
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
                                                   bandwidth=not args.one_element,
                                                   grad_scaler=args.grad_scaler)
        rows += device_rows
    if args.csv:
        write_csv(args.csv, rows, CSV_FIELDS)
    print_table(rows, copies)


if __name__ == "__main__":
    main()
