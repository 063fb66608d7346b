"""Benchmark ResNet-50 training steps: torch_bigbatch (local BatchNorm over groups of 32 and its
fused SGD) against plain PyTorch (nn.BatchNorm2d, cuDNN's on a GPU, and
torch.optim.SGD(fused=True)), measured in the same run.

One process trains each variant on one synthetic batch already on the device (no data loading:
the model and the optimizer are what differ), channels_last, under autocast to --dtype (bfloat16
by default; float32: no autocast), in eager mode and compiled with torch.compile. A step is
forward, cross-entropy, backward and the SGD step (lr 0.1, momentum 0.9, weight decay 1e-4).
After warm-up steps (which compile), the variants take turns over --rounds rounds of --steps
steps each; the table gives the median images/s and torch_bigbatch / torch per mode.

Run it from the repository root:

    python benchmarks/bench_training.py --device cuda                     # batch 256, 224 px
    python benchmarks/bench_training.py --device cpu --batch 32 --image-size 64 --steps 2
"""

import argparse
import statistics
import time

import torch
import torch.nn.functional as F

import torch_bigbatch
from common import DTYPES, device_name, positive_int, taking_turns, write_csv

HYPERPARAMETERS = {"lr": 0.1, "momentum": 0.9, "weight_decay": 1e-4}
VARIANTS = {  # the model's BatchNorm group size (0: nn.BatchNorm2d), the optimizer
    "torch": (0, lambda params: torch.optim.SGD(params, fused=True, **HYPERPARAMETERS)),
    "torch_bigbatch": (32, lambda params: torch_bigbatch.optim.SGD(params, **HYPERPARAMETERS)),
}
BASELINE = "torch"
CSV_FIELDS = ["device", "dtype", "mode", "batch", "image_size", "variant", "images_per_second",
              "ratio_vs_torch"]


def make_step(variant, mode, device, dtype):
    """A function that runs one training step of `variant` on a batch."""
    group_size, make_optimizer = VARIANTS[variant]
    torch.manual_seed(0)
    model = torch_bigbatch.models.resnet50(bn_group_size=group_size).to(
        device, memory_format=torch.channels_last)
    optimizer = make_optimizer(model.parameters())
    forward = torch.compile(model) if mode == "compile" else model

    def step(images, labels):
        with torch.autocast(device, dtype=dtype, enabled=dtype != torch.float32):
            loss = F.cross_entropy(forward(images), labels)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    return step


def synchronize(device):
    if device == "cuda":
        torch.cuda.synchronize()


def images_per_second(step, images, labels, steps, device):
    synchronize(device)
    start = time.perf_counter()
    for _ in range(steps):
        step(images, labels)
    synchronize(device)
    return steps * images.shape[0] / (time.perf_counter() - start)


def print_profile(mode, steps, images, labels, args):
    """The ops that took most of one step's device time, per variant: where a ratio comes
    from."""
    activities = [torch.profiler.ProfilerActivity.CPU]
    if args.device == "cuda":
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    for name, step in steps.items():
        with torch.profiler.profile(activities=activities) as profiler:
            step(images, labels)
            synchronize(args.device)
        print(f"{mode} {name}: the {args.profile} ops that took most of one step")
        print(profiler.key_averages().table(
            sort_by=f"self_{'device' if args.device == 'cuda' else 'cpu'}_time_total",
            row_limit=args.profile, max_name_column_width=60))


def bench_mode(mode, args):
    """One row per variant: the median images/s of its rounds, and against torch's."""
    dtype = DTYPES[args.dtype]
    images = torch.randn(args.batch, 3, args.image_size, args.image_size, device=args.device)
    images = images.contiguous(memory_format=torch.channels_last)
    labels = torch.randint(0, 1000, (args.batch,), device=args.device)
    steps = {name: make_step(name, mode, args.device, dtype) for name in VARIANTS}
    for step in steps.values():
        for _ in range(args.warmup):
            step(images, labels)
    rates = {name: [] for name in steps}
    for name, step in taking_turns(steps.items(), args.rounds):
        rates[name].append(images_per_second(step, images, labels, args.steps, args.device))
    medians = {name: statistics.median(values) for name, values in rates.items()}
    if args.profile:
        print_profile(mode, steps, images, labels, args)
    return [{"device": args.device, "dtype": args.dtype, "mode": mode, "batch": args.batch,
             "image_size": args.image_size, "variant": name, "images_per_second": rate,
             "ratio_vs_torch": rate / medians[BASELINE]} for name, rate in medians.items()]


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cuda")
    parser.add_argument("--dtype", choices=("float32", "bfloat16"), default="bfloat16",
                        help="autocast to this dtype (float32: none)")
    parser.add_argument("--modes", nargs="+", choices=("eager", "compile"),
                        default=["eager", "compile"])
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--image-size", type=int, default=224)
    parser.add_argument("--warmup", type=int, default=3, help="steps per variant before timing")
    parser.add_argument("--steps", type=int, default=10, help="steps per variant and round")
    parser.add_argument("--rounds", type=positive_int, default=3)
    parser.add_argument("--csv", metavar="PATH", help="also write the rows to this CSV file")
    parser.add_argument("--profile", type=int, default=0, metavar="N",
                        help="also print each variant's N costliest ops in one profiled step")
    args = parser.parse_args()
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: CUDA is not available")
    if args.batch % 32:
        parser.error(f"--batch must be a multiple of 32 (local BatchNorm's groups), got "
                     f"{args.batch}")
    torch.backends.cudnn.benchmark = True
    print(f"torch {torch.__version__}, {args.device}: {device_name(args.device)}; ResNet-50 "
          f"training, batch {args.batch} of {args.image_size}x{args.image_size}, "
          f"{args.dtype}, channels_last")
    rows = [row for mode in args.modes for row in bench_mode(mode, args)]
    print(f"{'mode':<8} {'variant':<15} {'images/s':>10} {'vs torch':>9}")
    for row in rows:
        print(f"{row['mode']:<8} {row['variant']:<15} {row['images_per_second']:>10.1f} "
              f"{row['ratio_vs_torch']:>8.2f}x")
    if args.csv:
        write_csv(args.csv, rows, CSV_FIELDS)


if __name__ == "__main__":
    main()
