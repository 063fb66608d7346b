"""What the benchmarks share: options, timing, turns, the device's name, device choice and CSV
output."""

import argparse
import csv
import math
import os
import platform
import statistics
import time

import torch
from torch.utils import benchmark


DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


def positive_int(text):
    """An argparse type: an int of 1 or more (0 rounds would leave no time to take a median
    of, 0 nodes nothing to divide the ranks over)."""
    value = int(text)  # a ValueError here gives argparse's "invalid positive_int value"
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be 1 or more, got {text}")
    return value


def positive_seconds(text):
    """An argparse type: a finite number of seconds above 0 (a timeout of inf bounds nothing)."""
    value = float(text)
    if not 0 < value < math.inf:
        raise argparse.ArgumentTypeError(f"must be a finite number of seconds above 0, got {text}")
    return value


def argument_parser(docstring, min_run_time, rounds, extra=()):
    """The options every device benchmark takes: --device, --dtype, --min-run-time, --rounds
    and --csv; `extra` adds (flags, options) pairs."""
    parser = argparse.ArgumentParser(description=docstring.split("\n\n")[0])
    parser.add_argument("--device", choices=("cpu", "cuda", "all"), default="all",
                        help="all: CPU, and CUDA when available (default)")
    parser.add_argument("--dtype", choices=DTYPES, default="float32")
    for flags, options in extra:
        parser.add_argument(*flags, **options)
    parser.add_argument("--min-run-time", type=float, default=min_run_time,
                        help="seconds of timing per variant, over all rounds")
    parser.add_argument("--rounds", type=positive_int, default=rounds,
                        help="the variants take turns this many times")
    parser.add_argument("--csv", metavar="PATH", help="also write the rows to this CSV file")
    return parser


def taking_turns(items, rounds):
    """The items `rounds` times over, in reverse order every other round: each runs first as
    often as last, so what a place in the round gives or costs (a warm cache, a machine whose
    speed drifts within a round) falls on all alike, and a drift between rounds too."""
    items = list(items)
    for index in range(rounds):
        yield from (items if index % 2 == 0 else reversed(items))


def median_ms(stmt, globals_, min_run_time):
    """Median milliseconds per run of `stmt`, over blocks of runs of at least 10 ms each, until
    min_run_time is spent (3 blocks at least), each block timed by torch.utils.benchmark's
    Timer.timeit, which synchronizes CUDA. (Its blocked_autorange grows blocks until the
    timer's overhead is 1e-4 of them: 0.3 s blocks for a 0.3 ms CUDA step, which took
    bench_batchnorm past a minute on an H200.)"""
    timer = benchmark.Timer(stmt=stmt, globals=globals_, num_threads=torch.get_num_threads())
    timer.timeit(1)  # the warm-up (first-call costs would make the blocks too short)
    once = timer.timeit(1).median
    number = max(1, math.ceil(0.01 / max(once, 1e-9)))
    times = []
    start = time.perf_counter()
    while len(times) < 3 or time.perf_counter() - start < min_run_time:
        times.append(timer.timeit(number).median)
    return statistics.median(times) * 1e3


def device_name(device):
    if device == "cuda":
        return torch.cuda.get_device_name()
    if os.path.exists("/proc/cpuinfo"):  # platform.processor() is often empty on Linux
        with open("/proc/cpuinfo") as cpuinfo:
            for line in cpuinfo:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    return platform.processor() or platform.machine()


def pick_devices(choice):
    """"cpu", "cuda" (an error without CUDA) or "all": CPU, and CUDA when available."""
    if choice == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda: CUDA is not available")
    if choice == "all":
        return ["cpu", "cuda"] if torch.cuda.is_available() else ["cpu"]
    return [choice]


def write_csv(path, rows, fields):
    with open(path, "w", newline="") as file:
        writer = csv.DictWriter(file, fieldnames=fields)
        writer.writeheader()
        writer.writerows(rows)
