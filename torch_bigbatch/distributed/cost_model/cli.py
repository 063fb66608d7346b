"""The cost model's command line: `python -m torch_bigbatch.distributed.cost_model` prints the
projection of ResNet-50's gradient from 8 to 4096 GPUs per preset and plots it; `--calibrate
CSV` fits alpha and beta to benchmarks/bench_allreduce.py's Gloo rows and sets model and
measurement side by side."""

import argparse
import csv
import os

from .alpha_beta import ALGORITHMS, PRESETS, RESNET50_GRADIENT_BYTES, projection
from .calibration import calibrate
from .plot import plot

PROJECTION_FIELDS = (["hardware", "gpus"]
                     + [f"{name}_{kind}" for name in ALGORITHMS for kind in ("ms", "efficiency")]
                     + ["segment_mib", "best_columns", "best_torus_ms", "torus_speedup_over_tree"])


def gpu_list(rows):
    return ", ".join(str(row["gpus"]) for row in rows) or "none"


def print_projection(hardware, rows, nbytes, compute_ms):
    print(f"\n{hardware.name}: allreduce of {nbytes / 1e6:.1f} MB (ms), and scaling efficiency "
          f"with {compute_ms:g} ms of compute per step and no overlap")
    header = " | ".join(f"{name:>12}" for name in ALGORITHMS)
    print("(tree: NCCL's double binary tree; torus: X = the GPUs of a node; pipelined: at the "
          "segment size printed; best X: the row length the model finds fastest; torus/tree: "
          "the tree's time over the fastest torus's, above 1 where the torus wins)")
    print(f"{'GPUs':>5} | {header} | " + " | ".join(f"{'eff ' + n[:8]:>12}" for n in ALGORITHMS)
          + " | segment MiB | best X | its ms | torus/tree")
    for row in rows:
        times = " | ".join(f"{row[f'{name}_ms']:12.2f}" for name in ALGORITHMS)
        efficiency = " | ".join(f"{row[f'{name}_efficiency']:12.1%}" for name in ALGORITHMS)
        print(f"{row['gpus']:>5} | {times} | {efficiency} | {row['segment_mib']:11.1f} | "
              f"{row['best_columns']:>6} | {row['best_torus_ms']:6.2f} | "
              f"{row['torus_speedup_over_tree']:9.2f}x")
    torus_wins = [row for row in rows if row["torus_speedup_over_tree"] > 1]
    tree_wins = [row for row in rows if row["torus_speedup_over_tree"] < 1]
    print(f"the torus beats NCCL's tree at {gpu_list(torus_wins)} GPUs; "
          f"the tree beats the torus at {gpu_list(tree_wins)} GPUs")


def print_calibration(alpha, beta, table):
    print(f"\nloopback Gloo fit: alpha = {alpha * 1e3:.3f} ms, beta = {beta * 1e9:.3f} ns/byte "
          f"({1 / beta / 1e9:.2f} GB/s per core)")
    print(f"{'shape':>5} | {'bytes':>9} | {'gloo meas':>9} | {'ring model':>10} | "
          f"{'torus meas':>10} | {'torus model':>11}")
    pairs = {}
    for row in table:
        pairs.setdefault((row["shape"], row["bytes"]), {})[row["backend"]] = row
    for (shape, nbytes), pair in pairs.items():
        gloo, torus = pair.get("gloo"), pair.get("torus")
        cells = [f"{gloo['measured_ms']:9.2f} | {gloo['model_ms']:10.2f}" if gloo
                 else f"{'':>9} | {'':>10}",
                 f"{torus['measured_ms']:10.2f} | {torus['model_ms']:11.2f}" if torus
                 else f"{'':>10} | {'':>11}"]
        print(f"{shape:>5} | {nbytes:>9} | {cells[0]} | {cells[1]}")
    for backend in ("gloo", "torus"):
        errors = sorted(abs(row["model_ms"] / row["measured_ms"] - 1) for row in table
                        if row["backend"] == backend)
        if errors:
            print(f"{backend}: model within {errors[len(errors) // 2]:.0%} of the measurement "
                  f"at the median, {errors[-1]:.0%} at worst")


def get_args_parser():
    parser = argparse.ArgumentParser(
        prog="python -m torch_bigbatch.distributed.cost_model",
        description="The alpha-beta cost of allreduce algorithms, from one node to thousands "
                    "of GPUs.")
    parser.add_argument("--hardware", nargs="+", choices=PRESETS, default=list(PRESETS))
    parser.add_argument("--bytes", type=int, default=RESNET50_GRADIENT_BYTES,
                        help="allreduce size (default: ResNet-50's fp32 gradient)")
    parser.add_argument("--gpus", type=int, nargs="+",
                        default=[2 ** i for i in range(3, 13)], help="8 to 4096 by default")
    parser.add_argument("--compute-ms", type=float,
                        help="compute per step for the efficiency (default: the preset's)")
    parser.add_argument("--calibrate", metavar="CSV",
                        help="benchmarks/bench_allreduce.py --csv output to fit loopback to")
    parser.add_argument("--cores", type=int, default=os.cpu_count(),
                        help="cores of the machine the calibration CSV was measured on")
    parser.add_argument("--plot", metavar="PNG", default="cost_model.png")
    parser.add_argument("--csv", metavar="PATH", help="also write the projection rows")
    return parser


def main(argv=None):
    parser = get_args_parser()
    args = parser.parse_args(argv)
    if args.bytes <= 0:
        parser.error(f"--bytes must be positive, got {args.bytes}")
    if args.compute_ms is not None and not args.compute_ms >= 0:
        parser.error(f"--compute-ms must be 0 or more, got {args.compute_ms}")
    if args.cores is not None and args.cores < 1:
        parser.error(f"--cores must be at least 1, got {args.cores}")
    calibration = None
    if args.calibrate:  # before the projection: a bad file ends the run before any output
        try:
            calibration = calibrate(args.calibrate, args.cores)
        except (OSError, ValueError) as error:
            parser.error(f"--calibrate {args.calibrate}: {error}")
    projections = []
    for name in args.hardware:
        hardware = PRESETS[name]
        compute_ms = args.compute_ms if args.compute_ms is not None else hardware.compute_ms
        try:
            rows = projection(hardware, args.gpus, args.bytes, compute_ms)
        except ValueError as error:  # GPU counts the preset's nodes cannot hold
            parser.error(f"--gpus: {error}")
        print_projection(hardware, rows, args.bytes, compute_ms)
        projections.append((hardware, rows))
    if calibration:
        print_calibration(*calibration)
    if args.csv:
        with open(args.csv, "w", newline="") as file:
            writer = csv.DictWriter(file, fieldnames=PROJECTION_FIELDS)
            writer.writeheader()
            for hardware, rows in projections:
                writer.writerows({"hardware": hardware.name, **row} for row in rows)
    if args.plot:
        plot(projections, calibration, args.plot)
        print(f"wrote {args.plot}")
