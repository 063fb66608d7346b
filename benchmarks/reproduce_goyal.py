"""Goyal et al. 2017's Figures 1 to 3 at small scale: Fashion-MNIST, the small ResNet, kn = 32k.

One process stands for k workers of n = 32 samples each: the global batch is 32k, every
LocalBatchNorm2d(32) normalizes each worker's 32 samples apart, and the mean loss over the
batch gives the gradient that k workers' allreduce gives (normalized by kn, then summed).
Every run is the goyal2017 recipe shortened to --epochs (warmup and step decays move in
proportion), with the LR of batch n = 32 being 0.1 * 32 / 256, as the linear rule gives it.
The variants (Goyal et al., sections 2.1, 2.2 and 5.2):

    gradual      linear scaling, gradual warmup from the LR of batch n (the paper's method)
    no-warmup    linear scaling, no warmup
    constant     linear scaling, constant warmup: the LR of batch n, then a jump
    no-scaling   the LR of batch n at every k

At k = 1 the four are one run. Every run starts from the same weights (--seed) and sees the
same data order, so the runs differ by their schedule only.

Resumable: a finished run leaves OUTPUT/state/<run>.json, an unfinished one a checkpoint
after every epoch; the same command again skips the first and resumes the second. When every
run is done it writes OUTPUT/reproduce_goyal.csv (one row per variant and k), curves.csv (the
training loss over each 1/--points of an epoch) and the plots fig1_error_vs_batch.png,
fig2_warmup.png and fig3_batch_sizes.png.

    python benchmarks/reproduce_goyal.py --quick          # within 20 minutes on 2 cores
    python benchmarks/reproduce_goyal.py --output runs/goyal_full
"""

import argparse
import concurrent.futures
import dataclasses
import functools
import json
import multiprocessing
import os
import time

import torch

from common import write_csv
from torch_bigbatch.data import load_fashion_mnist
from torch_bigbatch.models import resnet_small
from torch_bigbatch.recipes import goyal2017

WORKER_BATCH = 32  # n: the samples of one worker, and of one BatchNorm group
VARIANTS = ("gradual", "no-warmup", "constant", "no-scaling")
FULL = {"epochs": 5, "ks": (1, 2, 4, 8, 16, 32, 64), "train_size": 30000}
QUICK = {"epochs": 3, "ks": (1, 4, 16, 64), "train_size": 20000}
RESULT_FIELDS = ["variant", "k", "batch", "peak_lr", "epochs", "iterations", "train_loss",
                 "test_error", "seconds"]
CURVE_FIELDS = ["variant", "k", "batch", "epoch", "train_loss"]


@dataclasses.dataclass(frozen=True)
class Settings:
    epochs: int
    train_size: int | None  # None: all 60,000 training images
    test_size: int | None  # None: all 10,000 test images
    seed: int
    points: int  # training-loss points per epoch


def run_name(variant, k):
    """The four variants are one run at k = 1."""
    return "k1" if k == 1 else f"{variant}-k{k}"


def variant_recipe(variant, k, epochs):
    """goyal2017 over `epochs` for k workers of n = 32, with the variant's LR schedule."""
    base_lr = goyal2017.base_lr * WORKER_BATCH / goyal2017.base_batch  # the LR of batch n
    recipe = goyal2017.shortened(epochs).replace(batch_per_rank=WORKER_BATCH, base_lr=base_lr,
                                                 base_batch=WORKER_BATCH,
                                                 bn_group_size=WORKER_BATCH)
    if variant == "gradual":
        return recipe
    if variant == "no-warmup":
        return recipe.replace(warmup="none")
    if variant == "constant":
        return recipe.replace(warmup="constant")
    if variant == "no-scaling":  # the base batch is the whole batch: the peak is base_lr
        return recipe.replace(warmup="none", base_batch=WORKER_BATCH * k)
    raise ValueError(f"unknown variant {variant!r}; known: {', '.join(VARIANTS)}")


@functools.cache
def dataset(split, size):
    images, labels = load_fashion_mnist(split)
    return images[:size], labels[:size]


@torch.no_grad()
def test_error(model, size):
    model.eval()
    images, labels = dataset("test", size)
    wrong = sum((model(x).argmax(1) != y).sum().item()
                for x, y in zip(images.split(1000), labels.split(1000)))
    model.train()
    return wrong / len(labels)


def save_atomically(path, save):
    """`save(temporary)`, then a rename: an interrupted run never leaves half a file."""
    temporary = f"{path}.tmp"
    save(temporary)
    os.replace(temporary, path)


def initial_model(recipe, seed):
    """The small ResNet as the recipe builds it (its BatchNorm groups, zero-gamma and fc
    initialization), from the same weights in every run of a seed."""
    torch.manual_seed(seed)
    model = resnet_small(bn_group_size=recipe.bn_group_size,
                         zero_init_residual=recipe.zero_init_residual)
    return recipe.init_fc(model)


def train_run(variant, k, settings, state_dir, stop_after_epochs=None):
    """Trains one run, resuming from its checkpoint; returns its result, or None when it
    stopped after `stop_after_epochs` epochs of this call with epochs left to do."""
    name = run_name(variant, k)
    recipe = variant_recipe(variant, k, settings.epochs)
    images, labels = dataset("train", settings.train_size)
    batch = WORKER_BATCH * k
    iterations = len(labels) // batch  # drop_last, as the DistributedBatchSampler does
    model = initial_model(recipe, settings.seed)
    optimizer = recipe.build_optimizer(model, world_size=k)
    scheduler = recipe.build_scheduler(optimizer, iterations, world_size=k)
    criterion = recipe.criterion()
    checkpoint_path = os.path.join(state_dir, f"{name}.pt")
    state = {"epoch": 0, "curve": [], "seconds": 0.0}
    if os.path.exists(checkpoint_path):
        state = torch.load(checkpoint_path, weights_only=True)
        model.load_state_dict(state.pop("model"))
        optimizer.load_state_dict(state.pop("optimizer"))
        scheduler.load_state_dict(state.pop("scheduler"))
    segments = torch.arange(iterations).tensor_split(min(settings.points, iterations))
    first_epoch = state["epoch"]
    for epoch in range(first_epoch, settings.epochs):
        if stop_after_epochs and epoch - first_epoch >= stop_after_epochs:
            return None
        start = time.perf_counter()
        order = torch.randperm(len(labels), generator=torch.Generator().manual_seed(
            settings.seed + epoch))[:iterations * batch].view(iterations, batch)
        for segment in segments:
            total = torch.zeros((), dtype=torch.float64)  # as a float sum: no sync per step
            for step in segment.tolist():
                loss = criterion(model(images[order[step]]), labels[order[step]])
                optimizer.zero_grad(set_to_none=True)
                loss.backward()
                optimizer.step()
                scheduler.step()
                total += loss.detach()
            state["curve"].append((epoch + (segment[-1].item() + 1) / iterations,
                                   total.item() / len(segment)))
        state["seconds"] += time.perf_counter() - start
        state["epoch"] = epoch + 1
        save_atomically(checkpoint_path, lambda path: torch.save(
            {**state, "model": model.state_dict(), "optimizer": optimizer.state_dict(),
             "scheduler": scheduler.state_dict()}, path))
    last_epoch = [loss for at, loss in state["curve"] if at > settings.epochs - 1]
    return {"k": k, "batch": batch, "peak_lr": recipe.peak_lr(k), "epochs": settings.epochs,
            "iterations": iterations * settings.epochs,
            "train_loss": sum(last_epoch) / len(last_epoch),
            "test_error": test_error(model, settings.test_size),
            "seconds": state["seconds"], "curve": state["curve"]}


def finish_run(variant, k, settings, state_dir, stop_after_epochs, threads):
    """train_run on `threads` threads, then its result saved as JSON and its checkpoint
    removed."""
    torch.set_num_threads(threads)
    name = run_name(variant, k)
    result = train_run(variant, k, settings, state_dir, stop_after_epochs)
    if result is not None:
        def save(path):
            with open(path, "w") as file:
                json.dump(result, file)
        save_atomically(os.path.join(state_dir, f"{name}.json"), save)
        os.remove(os.path.join(state_dir, f"{name}.pt"))
        print(f"{name:>16}: batch {result['batch']:5d}, peak LR {result['peak_lr']:.4f}, "
              f"train loss {result['train_loss']:.4f}, test error {result['test_error']:.2%}, "
              f"{result['seconds']:.0f} s", flush=True)
    return result


def run_all(variants, ks, settings, state_dir, jobs, stop_after_epochs):
    """Every run not yet finished, `jobs` at a time in spawned processes that share the
    cores; returns the names of runs that stopped early."""
    todo = {run_name(variant, k): (variant, k) for k in ks for variant in variants}
    todo = {name: run for name, run in todo.items()
            if not os.path.exists(os.path.join(state_dir, f"{name}.json"))}
    if not todo:
        return []
    threads = max(1, (os.cpu_count() or 1) // jobs)
    context = multiprocessing.get_context("spawn")
    with concurrent.futures.ProcessPoolExecutor(jobs, mp_context=context) as pool:
        futures = {pool.submit(finish_run, variant, k, settings, state_dir, stop_after_epochs,
                               threads): name for name, (variant, k) in todo.items()}
        return [futures[future] for future in concurrent.futures.as_completed(futures)
                if future.result() is None]


def load_results(variants, ks, state_dir):
    results = {}
    for variant in variants:
        for k in ks:
            with open(os.path.join(state_dir, f"{run_name(variant, k)}.json")) as file:
                results[variant, k] = json.load(file)
    return results


def write_tables(results, output):
    write_csv(os.path.join(output, "reproduce_goyal.csv"),
              [{"variant": variant, **{field: result[field] for field in RESULT_FIELDS[1:]}}
               for (variant, _), result in results.items()], RESULT_FIELDS)
    write_csv(os.path.join(output, "curves.csv"),
              [{"variant": variant, "k": k, "batch": result["batch"], "epoch": round(epoch, 4),
                "train_loss": loss}
               for (variant, k), result in results.items() for epoch, loss in result["curve"]],
              CURVE_FIELDS)


def print_table(results, variants, ks):
    print("\ntest error (%) after training, by variant and global batch kn (n = 32)")
    print(f"{'kn':>6} | " + " | ".join(f"{variant:>10}" for variant in variants))
    for k in ks:
        cells = " | ".join(f"{results[variant, k]['test_error'] * 100:10.2f}"
                           for variant in variants)
        print(f"{WORKER_BATCH * k:>6} | {cells}")


def plot(results, variants, ks, output):
    """Figure 1 (error against batch), Figure 2 (small against large batch, per variant) and
    Figure 3 (the gradual-warmup loss curves of every batch)."""
    import matplotlib
    matplotlib.use("Agg")
    from matplotlib import pyplot

    batches = [WORKER_BATCH * k for k in ks]
    figure, axis = pyplot.subplots(figsize=(6, 4))
    for variant in variants:
        axis.plot(batches, [100 * results[variant, k]["test_error"] for k in ks], marker="o",
                  label=variant)
    axis.set_xscale("log", base=2)
    axis.set_xticks(batches, [str(batch) for batch in batches])
    axis.set_xlabel("global batch kn (n = 32 per worker)")
    axis.set_ylabel("Fashion-MNIST test error (%)")
    axis.set_title("Figure 1: error against batch size")
    axis.legend()
    figure.tight_layout()
    figure.savefig(os.path.join(output, "fig1_error_vs_batch.png"), dpi=90)
    pyplot.close(figure)

    def curve(axis, variant, k, **style):
        points = results[variant, k]["curve"]
        axis.plot([at for at, _ in points], [loss for _, loss in points],
                  label=f"kn = {WORKER_BATCH * k}", **style)

    figure, axes = pyplot.subplots(1, len(variants), figsize=(4 * len(variants), 3.5),
                                   sharey=True, squeeze=False)
    for axis, variant in zip(axes[0], variants):
        curve(axis, variant, ks[0], color="black")
        curve(axis, variant, ks[-1], color="tab:red")
        axis.set_title(f"Figure 2: {variant}")
        axis.set_xlabel("epoch")
        axis.set_yscale("log")
        axis.legend()
    axes[0][0].set_ylabel("training loss")
    figure.tight_layout()
    figure.savefig(os.path.join(output, "fig2_warmup.png"), dpi=90)
    pyplot.close(figure)

    variant = "gradual" if "gradual" in variants else variants[0]
    figure, axis = pyplot.subplots(figsize=(6, 4))
    for k in ks:
        curve(axis, variant, k)
    axis.set_yscale("log")
    axis.set_xlabel("epoch")
    axis.set_ylabel("training loss")
    axis.set_title(f"Figure 3: {variant}, every batch size")
    axis.legend()
    figure.tight_layout()
    figure.savefig(os.path.join(output, "fig3_batch_sizes.png"), dpi=90)
    pyplot.close(figure)


def get_args_parser():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true",
                        help=f"{QUICK['epochs']} epochs, {QUICK['train_size']} training images, "
                             f"k in {QUICK['ks']}")
    parser.add_argument("--epochs", type=int, help=f"default {FULL['epochs']}")
    parser.add_argument("--ks", type=int, nargs="+",
                        help=f"workers of 32 samples; default {' '.join(map(str, FULL['ks']))}")
    parser.add_argument("--train-size", type=int, help="the first N training images "
                        f"(default {FULL['train_size']})")
    parser.add_argument("--test-size", type=int, help="the first N test images (all)")
    parser.add_argument("--variants", nargs="+", choices=VARIANTS, default=list(VARIANTS))
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--points", type=int, default=8,
                        help="training-loss points per epoch in the curves")
    parser.add_argument("--jobs", type=int, default=2, help="runs trained at once")
    parser.add_argument("--output", help="default runs/reproduce_goyal[_quick]")
    parser.add_argument("--stop-after-epochs", type=int,
                        help="each run stops after this many epochs of this call (to be "
                             "resumed by the same command; 0: no limit)")
    return parser


def settings_from(args):
    preset = QUICK if args.quick else FULL
    epochs = args.epochs or preset["epochs"]
    ks = sorted(set(args.ks or preset["ks"]))
    train_size = args.train_size or preset["train_size"]
    if epochs < 1 or ks[0] < 1 or args.jobs < 1 or args.points < 1:
        raise SystemExit("--epochs, --ks, --jobs and --points must be positive")
    if not WORKER_BATCH * ks[-1] <= (train_size or 60000) <= 60000:
        raise SystemExit(f"--train-size must hold a batch of the largest k ({WORKER_BATCH} x "
                         f"{ks[-1]} = {WORKER_BATCH * ks[-1]}) and at most 60000 images, got "
                         f"{train_size or 60000}")
    if args.stop_after_epochs is not None and args.stop_after_epochs < 0:
        raise SystemExit(f"--stop-after-epochs must be 0 (no limit) or more, got "
                         f"{args.stop_after_epochs}")
    if args.test_size is not None and not 1 <= args.test_size <= 10000:
        raise SystemExit(f"--test-size must be in [1, 10000], got {args.test_size}")
    return Settings(epochs, train_size, args.test_size, args.seed, args.points), ks


def check_settings(state_dir, settings):
    """Runs of one output folder share their settings; k and the variants may differ."""
    path = os.path.join(state_dir, "settings.json")
    if os.path.exists(path):
        with open(path) as file:
            saved = json.load(file)
        if saved != dataclasses.asdict(settings):
            raise SystemExit(f"{os.path.dirname(state_dir)} holds runs of other settings "
                             f"({saved}): choose another --output")
    else:
        with open(path, "w") as file:
            json.dump(dataclasses.asdict(settings), file)


def main():
    args = get_args_parser().parse_args()
    settings, ks = settings_from(args)
    output = args.output or ("runs/reproduce_goyal_quick" if args.quick
                             else "runs/reproduce_goyal")
    state_dir = os.path.join(output, "state")
    os.makedirs(state_dir, exist_ok=True)
    check_settings(state_dir, settings)
    start = time.perf_counter()
    stopped = run_all(args.variants, ks, settings, state_dir, args.jobs, args.stop_after_epochs)
    print(f"wall time of this call: {time.perf_counter() - start:.0f} s")
    if stopped:
        print(f"stopped early, to be resumed: {', '.join(sorted(stopped))}")
        return
    results = load_results(args.variants, ks, state_dir)
    write_tables(results, output)
    print_table(results, args.variants, ks)
    plot(results, args.variants, ks, output)
    print(f"wrote {output}/reproduce_goyal.csv, curves.csv and the figures")


if __name__ == "__main__":
    main()
