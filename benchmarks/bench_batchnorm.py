"""Benchmark local (ghost) BatchNorm on ResNet-50's BatchNorm shapes, forward plus backward:
torch_bigbatch.nn.LocalBatchNorm2d(group_size=32) against nn.BatchNorm2d (plain per-process
BatchNorm, one group: the time to approach) and against torch's two ghost BatchNorms: the usual
Python loop that runs nn.BatchNorm2d on each chunk of 32 samples, and the one-call form (as
cifar10-fast's GhostBatchNorm) that views the batch as 32 samples of N/32 * C channels, so that
one batch_norm normalizes every group (groups of every (N/32)-th sample rather than
consecutive ones; a channels_last input goes to NCHW and back for the view), all measured in
the same run.

Each step is a training forward (running statistics updated) and the backward to the input,
weight and bias (torch.autograd.grad, so no gradient accumulation is timed). The variants take
turns over several rounds; a variant's time is the median of its rounds' medians. The table
gives ms per step, ours / nn.BatchNorm2d, and the chunk loop's and the one call's time over
ours (our speedup over each).

Run it from the repository root:

    python benchmarks/bench_batchnorm.py                        # CPU, and CUDA when available
    python benchmarks/bench_batchnorm.py --device cuda --dtype bfloat16 --csv results.csv
    python benchmarks/bench_batchnorm.py --device cpu --batch 64 --memory-format nchw
"""

import os
import statistics

import torch
from torch import nn

import torch_bigbatch as bb
from common import (DTYPES, argument_parser, device_name, median_ms, pick_devices,
                    taking_turns, write_csv)

# (channels, height = width) of ResNet-50's BatchNorm layers, from the stem to the last stage.
SHAPES = [(64, 112), (64, 56), (256, 56), (512, 28), (1024, 14), (2048, 7)]
GROUP_SIZE = 32
FORMATS = {"nchw": torch.contiguous_format, "channels_last": torch.channels_last}
CSV_FIELDS = ["device", "dtype", "memory_format", "batch", "channels", "size", "variant",
              "ms_per_step", "vs_batchnorm2d"]


class ChunkLoopBatchNorm(nn.BatchNorm2d):
    """The usual ghost BatchNorm: nn.BatchNorm2d on each chunk of group_size samples."""

    def forward(self, input):
        return torch.cat([super(ChunkLoopBatchNorm, self).forward(chunk)
                          for chunk in input.split(GROUP_SIZE)])


class OneCallGhostBatchNorm(nn.BatchNorm2d):
    """Ghost BatchNorm in one batch_norm call: the batch viewed as group_size samples of
    (N / group_size) * C channels, the parameters and running statistics repeated per group
    (the statistics of each group, as the other variants keep them; averaged for evaluation)."""

    def forward(self, input):
        groups = input.shape[0] // GROUP_SIZE
        if self.running_mean.numel() != groups * self.num_features:
            self.running_mean = self.running_mean.repeat(groups)
            self.running_var = self.running_var.repeat(groups)
        channels_last = input.is_contiguous(memory_format=torch.channels_last)
        grouped = input.contiguous().view(GROUP_SIZE, groups * self.num_features,
                                          *input.shape[2:])
        output = nn.functional.batch_norm(
            grouped, self.running_mean, self.running_var, self.weight.repeat(groups),
            self.bias.repeat(groups), True, self.momentum, self.eps).view(input.shape)
        return output.contiguous(memory_format=torch.channels_last) if channels_last else output


VARIANTS = {
    "nn.BatchNorm2d": lambda channels: nn.BatchNorm2d(channels),
    "chunk loop": lambda channels: ChunkLoopBatchNorm(channels),
    "one call": lambda channels: OneCallGhostBatchNorm(channels),
    "LocalBatchNorm2d": lambda channels: bb.nn.LocalBatchNorm2d(channels, group_size=GROUP_SIZE),
}
BASELINE, OURS, LOOP, ONE_CALL = "nn.BatchNorm2d", "LocalBatchNorm2d", "chunk loop", "one call"


def step(layer, x, dy):
    return torch.autograd.grad(layer(x), (x, layer.weight, layer.bias), dy)


def bench_shape(device, dtype, memory_format, batch, channels, size, min_run_time, rounds):
    x = torch.randn(batch, channels, size, size, device=device, dtype=dtype)
    x = x.to(memory_format=memory_format).requires_grad_()
    dy = torch.randn_like(x)
    # Parameters in float32 with low-precision activations, as under autocast.
    layers = {name: make(channels).to(device) for name, make in VARIANTS.items()}
    for layer in layers.values():
        step(layer, x, dy)  # warm-up
    per_round = {name: [] for name in layers}
    for name, layer in taking_turns(layers.items(), rounds):
        per_round[name].append(median_ms("step(layer, x, dy)",
                                         {"step": step, "layer": layer, "x": x, "dy": dy},
                                         min_run_time / rounds))
    return {name: statistics.median(times) for name, times in per_round.items()}


def print_table(rows):
    header = (f"{'device':<6} {'format':<13} {'shape (N,C,H,W)':<21} {'BatchNorm2d':>11} "
              f"{'chunk loop':>10} {'one call':>9} {'Local':>8} {'Local/BN2d':>10} "
              f"{'loop/Local':>10} {'call/Local':>10}")
    print(header)
    print("-" * len(header))
    by_case = {}
    for row in rows:
        key = (row["device"], row["memory_format"], row["batch"], row["channels"], row["size"])
        by_case.setdefault(key, {})[row["variant"]] = row["ms_per_step"]
    totals = {}
    for (device, memory_format, batch, channels, size), ms in by_case.items():
        total = totals.setdefault((device, memory_format), dict.fromkeys(ms, 0.0))
        for name in ms:
            total[name] += ms[name]
        print_line(device, memory_format, f"{batch},{channels},{size},{size}", ms)
    for (device, memory_format), ms in totals.items():
        print_line(device, memory_format, "all shapes (sum)", ms)


def print_line(device, memory_format, label, ms):
    print(f"{device:<6} {memory_format:<13} {label:<21} {ms[BASELINE]:>11.2f} {ms[LOOP]:>10.2f} "
          f"{ms[ONE_CALL]:>9.2f} {ms[OURS]:>8.2f} {ms[OURS] / ms[BASELINE]:>9.2f}x "
          f"{ms[LOOP] / ms[OURS]:>9.2f}x {ms[ONE_CALL] / ms[OURS]:>9.2f}x")


def main():
    args = argument_parser(__doc__, min_run_time=2.0, rounds=3, extra=[
        (("--memory-format",), {"choices": (*FORMATS, "both"), "default": "both"}),
        (("--batch",), {"type": int, "default": 256, "help": "samples per step (default 256)"}),
    ]).parse_args()
    devices = pick_devices(args.device)
    formats = list(FORMATS) if args.memory_format == "both" else [args.memory_format]
    dtype = DTYPES[args.dtype]
    torch.set_num_threads(os.cpu_count())
    torch.manual_seed(0)
    names = ", ".join(f"{device}: {device_name(device)}" for device in devices)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, {names}; BatchNorm "
          f"forward + backward, {args.dtype}, batch {args.batch}, groups of {GROUP_SIZE}")
    rows = []
    for device in devices:
        for format_name in formats:
            for channels, size in SHAPES:
                timings = bench_shape(device, dtype, FORMATS[format_name], args.batch, channels,
                                      size, args.min_run_time, args.rounds)
                # (as it goes: a run stopped at a time limit still shows what it measured)
                print(f"measured {device} {format_name} {args.batch},{channels},{size},{size}: "
                      + ", ".join(f"{name} {ms:.3f} ms" for name, ms in timings.items()),
                      flush=True)
                rows += [{"device": device, "dtype": args.dtype, "memory_format": format_name,
                          "batch": args.batch, "channels": channels, "size": size,
                          "variant": name, "ms_per_step": ms,
                          "vs_batchnorm2d": ms / timings[BASELINE]}
                         for name, ms in timings.items()]
    if args.csv:
        write_csv(args.csv, rows, CSV_FIELDS)
    print_table(rows)


if __name__ == "__main__":
    main()
