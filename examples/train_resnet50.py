"""Large-minibatch ResNet training under torchrun: a paper's recipe with one flag.

Goyal et al. 2017 (goyal2017), Mikami et al. 2018 (mikami2018) or MLPerf's LARS setup
(mlperf_lars), each scaled to the world size by the linear rule: the fused SGD/LARS optimizer
with no weight decay on biases and BatchNorm, the per-iteration warmup and decay, local
BatchNorm over groups of 32 samples, zero-gamma residual init, label smoothing, batch-size
control, and DDP over the "torus" backend (2D-torus allreduce) by default.

    # ImageNet (an ImageFolder with train/ and val/; needs torchvision), 8 GPUs:
    torchrun --nproc-per-node 8 examples/train_resnet50.py --recipe goyal2017 --data /imagenet
    # Fashion-MNIST from Debian's dataset-fashion-mnist, 4 CPU processes (what `make demo` runs):
    torchrun --nproc-per-node 4 examples/train_resnet50.py --dataset fashion-mnist --epochs 3

Checkpoints (model, optimizer, scheduler, position, metrics) are written atomically by rank 0
every --checkpoint-every steps and at each epoch's end; --resume continues from the last one,
as does a restart by torchrun --max-restarts. Each epoch ends with an evaluation; the metrics
go to OUTPUT/metrics.csv and OUTPUT/metrics.png. Bad arguments, data or checkpoints are refused
with one message per node before any process group exists; a damaged ImageNet image, decoded
only when the training reaches it, stops the run with an error naming the file.
"""

import argparse
import contextlib
import csv
import dataclasses
import datetime
import faulthandler
import fcntl
import glob
import importlib.util
import math
import multiprocessing
import os
import signal
import sys
import time
import zlib

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import BatchSampler, DataLoader, TensorDataset, default_collate

import torch_bigbatch as bb
from torch_bigbatch.schedules import DistributedBatchSampler

CHECKPOINT = "checkpoint.pt"
PREVIOUS_CHECKPOINT = "checkpoint.previous{}.pt"  # where a new run moves an earlier one
LOCK = "job.lock"  # held by rank 0 while a run uses --output
MODELS = ("resnet50", "resnet18", "resnet_small")  # torch_bigbatch.models
TORCHVISION_RESNET50 = "torchvision.resnet50"
# What a checkpoint holds that resuming reads, and its type.
CHECKPOINT_FIELDS = {"model": dict, "optimizer": dict, "scheduler": dict, "epoch": int,
                     "step": int, "epoch_loss": torch.Tensor, "metrics": list, "settings": dict}
LATER_SETTINGS = ("classes", "--train-crop-size", "--val-resize-size", "--val-crop-size",
                  "image files")
# An epoch's training, saved before its evaluation (the checkpoint's "trained"): a run stopped
# or failed in the evaluation resumes with it, not with the epoch's training again.
TRAINED_FIELDS = ("train_loss", "lr", "images_per_second", "seconds")
METRICS = ("epoch", "train_loss", "test_loss", "test_accuracy", "lr", "global_batch",
           "images_per_second", "seconds")


def rank():
    return int(os.environ.get("RANK", 0))


# How long a rank other than its node's first waits before it says why it refused.
REFUSAL_GRACE_SECONDS = 5.0


class ArgumentParser(argparse.ArgumentParser):
    """argparse's parser whose errors each node says once (exit code 2 on every rank): the
    node's first rank at once, the others after REFUSAL_GRACE_SECONDS. The ranks of a node
    refuse alike, and torchrun ends a node's workers as soon as one fails, so the first's
    message is the node's; a rank whose refusal is its own (or comes first: a slower first
    rank was ended before it printed, and nothing said why) still says it. A refusal may hold
    on one node only (its data, its --output, the checkpoint there). Without LOCAL_RANK (not
    started by torchrun) a rank is its own node's first only as rank 0."""

    def error(self, message):
        if int(os.environ.get("LOCAL_RANK", rank())) != 0:
            time.sleep(REFUSAL_GRACE_SECONDS)
        super().error(message if rank() == 0 else f"(rank {rank()}) {message}")


def checked(kind, valid, requirement):
    """An argparse type: the text as a `kind`, refused with `requirement` unless valid(value)."""
    def convert(text):
        value = kind(text)  # a ValueError here gives argparse's "invalid int value: 'x'"
        if not valid(value):
            raise argparse.ArgumentTypeError(f"{requirement}, got {text}")
        return value
    convert.__name__ = kind.__name__
    return convert


POSITIVE = checked(int, lambda n: n > 0, "must be a positive integer")
NON_NEGATIVE = checked(int, lambda n: n >= 0, "must be 0 or a positive integer")


def get_args_parser():
    parser = ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--recipe", choices=bb.recipes.RECIPES, default="goyal2017")
    parser.add_argument("--dataset", choices=("imagenet", "fashion-mnist", "synthetic"),
                        default=None, help="default: imagenet with --data, else fashion-mnist")
    parser.add_argument("--data", metavar="PATH", help="ImageNet root with train/ and val/")
    parser.add_argument("--fashion-mnist-root", default=bb.data.fashion_mnist.DEFAULT_ROOT)
    parser.add_argument("--synthetic-size", type=POSITIVE, default=2048,
                        help="training images of --dataset synthetic (a quarter more to test)")
    parser.add_argument("--model", choices=(*MODELS, TORCHVISION_RESNET50),
                        help="default: resnet50 on ImageNet, resnet_small otherwise; "
                        f"{TORCHVISION_RESNET50}: torchvision's own, its BatchNorm made local")
    parser.add_argument("--epochs", type=POSITIVE,
                        help="train this many epochs, the recipe's schedule shrunk to fit")
    parser.add_argument("--batch-per-rank", type=POSITIVE, help="samples per rank per step")
    parser.add_argument("--base-lr", type=checked(float, lambda x: math.isfinite(x) and x >= 0,
                                                  "must be a finite number >= 0"),
                        help="LR per the recipe's base batch (256 samples in goyal2017)")
    parser.add_argument("--bn-group-size",
                        type=checked(int, lambda n: n == 0 or n >= 2, "must be 0 (nn.BatchNorm2d) "
                                     "or at least 2 (one sample has no variance)"),
                        help="samples per BatchNorm group (0: nn.BatchNorm2d; default: the "
                        "recipe's)")
    parser.add_argument("--max-local-batch", default=0,
                        type=checked(int, lambda n: n == 0 or n >= 2, "must be 0 (no micro-"
                                     "batches) or at least 2 (BatchNorm needs 2 samples)"),
                        help="accumulate gradients over micro-batches of at most this size")
    parser.add_argument("--backend", choices=("torus", "gloo", "nccl"), default="torus")
    parser.add_argument("--cpu", action="store_true", help="train on the CPU even with CUDA")
    parser.add_argument("--output", default="runs/train_resnet50", help="checkpoints, metrics",
                        type=checked(str, bool, "must name a folder"))
    parser.add_argument("--checkpoint-every", type=NON_NEGATIVE, default=500,
                        help="also checkpoint every N steps (0: only at epoch ends)")
    parser.add_argument("--resume", action="store_true", help="continue from OUTPUT's checkpoint")
    parser.add_argument("--stop-after-epochs", type=NON_NEGATIVE, default=0,
                        help="end this run after N epochs (checkpointed), to resume later")
    parser.add_argument("--stop-after-steps", type=NON_NEGATIVE, default=0,
                        help="end this run after N steps (checkpointed), even mid-epoch")
    parser.add_argument("--workers", type=NON_NEGATIVE,
                        help="data-loading processes per rank (ImageNet; in-memory data needs "
                        "none); default: the CPU cores of each rank on this machine")
    # As in torchvision's reference recipe.
    parser.add_argument("--train-crop-size", type=POSITIVE, default=224,
                        help="ImageNet: the training images' random crop, pixels")
    parser.add_argument("--val-resize-size", type=POSITIVE, default=256,
                        help="ImageNet: evaluation images resized to this, pixels")
    parser.add_argument("--val-crop-size", type=POSITIVE, default=224,
                        help="ImageNet: then center-cropped to this, pixels")
    parser.add_argument("--print-every", type=POSITIVE, default=20,
                        help="steps between progress lines")
    # torch's CPU generator keeps a seed's low 32 bits: 2**32 would repeat seed 0's run.
    parser.add_argument("--seed", default=0, type=checked(int, lambda n: 0 <= n < 2**32,
                                                          "must be an integer in [0, 2**32)"))
    # As in torchvision's reference recipe: a resumed CUDA run then repeats a straight one.
    parser.add_argument("--use-deterministic-algorithms", action="store_true",
                        help="only deterministic kernels (cuDNN's, cuBLAS's), slower on CUDA")
    parser.add_argument("--timeout", default=300,
                        type=checked(float, lambda x: 0 < x <= 1e9,  # a timedelta holds it
                                     "must be a positive number of seconds, at most 1e9"),
                        help="collective timeout, seconds")
    return parser


class RunSpan:
    """Where this run starts and where it stops: the one place of the resume and stop logic.

    A run starts at its checkpoint's position (an epoch and the steps of it done; an evaluated
    epoch's end is the next epoch's start) or at the beginning, and ends after the recipe's last epoch,
    or early, after --stop-after-epochs epochs or --stop-after-steps steps of this run (0: no
    limit). A stop on an epoch's last step still evaluates and checkpoints that epoch; a stop
    mid-epoch checkpoints the steps done.
    """

    def __init__(self, iterations, epoch=0, step=0, stop_after_epochs=0, stop_after_steps=0,
                 evaluated=True):
        if step == iterations[epoch] and evaluated:  # else the run starts with its evaluation
            epoch, step = epoch + 1, 0
        self.iterations, self.start_epoch, self.start_step = iterations, epoch, step
        self.stop_after_epochs, self.stop_after_steps = stop_after_epochs, stop_after_steps
        self.epochs_run = self.steps_run = 0

    def evaluation_only(self, epoch):
        """`epoch` was trained before this run, which evaluates it."""
        return self.first_step(epoch) == self.iterations[epoch]

    @property
    def finished(self):
        """The checkpoint's run has trained every epoch: nothing is left."""
        return self.start_epoch == len(self.iterations)

    def epochs(self):
        return range(self.start_epoch, len(self.iterations))

    def first_step(self, epoch):
        """The steps of `epoch` done before this run started (skipped without loading them)."""
        return self.start_step if epoch == self.start_epoch else 0

    def stop_after_step(self):
        """Counts a step of this run; True when the run stops after it."""
        self.steps_run += 1
        return self.steps_run == self.stop_after_steps

    def stop_after_epoch(self, trained=True):
        """Counts an epoch this run trained (not one it only evaluated); True when the run stops
        after it (also when the step limit fell on its last step)."""
        self.epochs_run += trained
        return (0 < self.stop_after_epochs == self.epochs_run
                or 0 < self.stop_after_steps == self.steps_run)


class TensorBatches(TensorDataset):
    """A TensorDataset read a batch at a time: a DataLoader with a batch_sampler hands
    __getitems__ all the batch's indices, and one indexing per tensor replaces the stacking of
    single samples (a third of the time for Fashion-MNIST's batches of 64)."""

    def __getitems__(self, indices):
        index = torch.tensor(indices)
        return tuple(tensor[index] for tensor in self.tensors)


def collate(batch):
    """A batch read whole (a tuple of tensors) passes as it is; a list of samples is stacked."""
    return batch if isinstance(batch, tuple) else default_collate(batch)


def default_workers(local_world_size):
    """The CPU cores each of this machine's ranks has (at least one loader process)."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return max(1, (cores or 1) // local_world_size)


def data_loader(dataset, batch_sampler, setup, args):
    """The one loader of every dataset; tensors in memory need no worker processes."""
    if isinstance(dataset, TensorDataset):
        workers = 0
    else:
        workers = args.workers if args.workers is not None else default_workers(
            setup.local_world_size)
    return DataLoader(dataset, batch_sampler=batch_sampler, collate_fn=collate,
                      num_workers=workers, pin_memory=setup.device.type == "cuda",
                      multiprocessing_context=worker_start() if workers else None)


def worker_start():
    """Loader workers start from a forkserver, not as forks of this process: its threads that
    are not Python's (Gloo's among them) take Python thread states when they free tensors that
    Python held, and a fork at that moment leaves the child waiting forever for the
    interpreter's lock on Python before 3.11.10 (CPython issue 112275; it hung this job's
    evaluation). The forkserver runs no such threads; it imports the modules a worker needs
    once (1.8 s a worker otherwise, 0.07 s with them)."""
    context = multiprocessing.get_context("forkserver")
    context.set_forkserver_preload(["torch_bigbatch", "torchvision"])
    return context


def load_data(dataset, args):
    """(train, test, classes, channels): Datasets of (image, label)."""
    if dataset == "fashion-mnist":
        return (TensorBatches(*bb.data.load_fashion_mnist("train", args.fashion_mnist_root)),
                TensorBatches(*bb.data.load_fashion_mnist("test", args.fashion_mnist_root)),
                bb.data.fashion_mnist.CLASSES, 1)
    if dataset == "synthetic":
        images, labels = bb.data.synthetic_images(args.synthetic_size * 5 // 4, seed=args.seed)
        split = args.synthetic_size
        return (TensorBatches(images[:split], labels[:split]),
                TensorBatches(images[split:], labels[split:]), 10, 1)
    from torchvision import datasets, transforms
    normalize = transforms.Normalize(mean=[0.485, 0.456, 0.406], std=[0.229, 0.224, 0.225])
    train = datasets.ImageFolder(os.path.join(args.data, "train"), transforms.Compose([
        transforms.RandomResizedCrop(args.train_crop_size), transforms.RandomHorizontalFlip(),
        transforms.ToTensor(), normalize]), loader=load_image)
    test = datasets.ImageFolder(os.path.join(args.data, "val"), transforms.Compose([
        transforms.Resize(args.val_resize_size), transforms.CenterCrop(args.val_crop_size),
        transforms.ToTensor(), normalize]), loader=load_image)
    score_with_training_classes(test, train, args.data)
    # Each image's random crop and flip from (seed, epoch, index): a resume repeats them.
    return bb.data.SeededSamples(train, args.seed), test, len(train.classes), 3


def load_image(path):
    """torchvision's loader (RGB), whose error for a truncated file names no file. At module
    level: the loader workers unpickle the dataset that holds it."""
    from torchvision.datasets.folder import default_loader
    try:
        return default_loader(path)
    except OSError as error:
        raise OSError(f"cannot read the image {path}: {error}") from error


def score_with_training_classes(test, train, data):
    """Gives the ImageFolder `test` the class indices of `train`: each folder numbers its own
    sorted class names, so a class missing from val/ shifted every later label (scored against
    the wrong classes, and no error); a class train/ lacks has no output to score."""
    unknown = sorted(set(test.classes) - set(train.classes))
    if unknown:
        raise ValueError(f"--data {data}: val/ has {len(unknown)} classes that train/ lacks "
                         f"({', '.join(unknown[:3])}{', ...' if len(unknown) > 3 else ''})")
    if test.classes == train.classes:
        return
    test.samples = [(path, train.class_to_idx[test.classes[label]])
                    for path, label in test.samples]
    test.imgs, test.targets = test.samples, [label for _, label in test.samples]
    test.classes, test.class_to_idx = train.classes, train.class_to_idx


def check_data(dataset, args):
    if args.data and dataset != "imagenet":  # the run would train on other data than asked
        raise ValueError(f"--data is ImageNet's root: --dataset {dataset} does not read it")
    if dataset == "imagenet":
        if not args.data:
            raise ValueError("--dataset imagenet needs --data PATH (train/ and val/ inside)")
        for split in ("train", "val"):
            if not os.path.isdir(os.path.join(args.data, split)):
                raise ValueError(f"--data {args.data}: no {split}/ directory in it")
        if importlib.util.find_spec("torchvision") is None:
            raise ValueError("ImageNet needs torchvision: pip install torchvision")
    elif dataset == "fashion-mnist":
        missing = bb.data.missing_files(args.fashion_mnist_root)
        if missing:
            raise ValueError(f"Fashion-MNIST not found ({missing[0]}): install the Debian "
                             "package dataset-fashion-mnist, or pass --fashion-mnist-root")


def check_output(output):
    """Rank 0 can create the directory `output` (or it is one) and write in it."""
    existing = os.path.abspath(output)
    while not os.path.exists(existing):  # the nearest part of the path that exists
        existing = os.path.dirname(existing)
    if not os.path.isdir(existing):
        raise ValueError(f"--output {output}: {existing} is a file, not a directory")
    if not os.access(existing, os.W_OK | os.X_OK):
        raise ValueError(f"--output {output}: {existing} is not writable")


def job_id():
    """torchrun's run id (--rdzv-id, or --standalone's own) where it names a job; else None."""
    run_id = os.environ.get("TORCHELASTIC_RUN_ID")
    return run_id if run_id not in (None, "", "none") else None


def written_by_this_job(path):
    """Whether the checkpoint at `path` was written under this torchrun job's run id (read
    without loading its tensors; an unreadable file is not)."""
    if job_id() is None or not os.path.exists(path):
        return False
    try:
        state = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    except Exception:  # damaged: a new run moves it aside, a restart's read names the damage
        return False
    return isinstance(state, dict) and state.get("job") == job_id()


def read_checkpoint(path, settings, iterations):
    """The checkpoint at `path` if this run can continue it, else a ValueError that names the
    file, the difference and what to do."""
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as error:  # random bytes, an empty file, a pickle of other objects...
        raise ValueError(f"--resume: {path} is not a readable checkpoint ({type(error).__name__})"
                         ": delete it, or give another --output") from error
    wrong = [key for key, kind in CHECKPOINT_FIELDS.items()
             if not isinstance(state, dict) or not isinstance(state.get(key), kind)]
    if wrong:
        raise ValueError(f"--resume: {path} is not a checkpoint of this job (no valid "
                         f"{', '.join(wrong)}): delete it, or give another --output")
    # Settings recorded since 2026-11-27 (image files since 2026-11-28): a checkpoint from
    # before lacks them, and resumes.
    changed = [key for key in settings if state["settings"].get(key) != settings[key]
               and (key in state["settings"] or key not in LATER_SETTINGS)]
    if changed:
        theirs = ", ".join(f"{key} {state['settings'].get(key)}" for key in changed)
        ours = ", ".join(f"{key} {settings[key]}" for key in changed)
        raise ValueError(f"--resume: {path} was written with {theirs}; this run has {ours}. "
                         "Resume with the checkpoint's settings, or give another --output to "
                         "start a new run")
    epoch, step = state["epoch"], state["step"]
    if not (0 <= epoch < len(iterations) and 0 <= step <= iterations[epoch]):
        raise ValueError(f"--resume: {path} stopped at epoch {epoch} step {step}, outside this "
                         f"run's {len(iterations)} epochs: delete it, or give another --output")
    trained = state.get("trained")
    if trained is not None and not (isinstance(trained, dict) and step == iterations[epoch]
                                    and set(trained) == set(TRAINED_FIELDS)):
        raise ValueError(f"--resume: {path} is not a checkpoint of this job (its trained "
                         "epoch): delete it, or give another --output")
    return state


def lock_output(output):
    """Rank 0's lock on --output for as long as the process lives: a second run in the same
    --output (orphaned ranks of a stopped torchrun, a job started twice) wrote the same
    checkpoint and then failed with a misleading error. Where the file system has no locks,
    none is taken."""
    os.makedirs(output, exist_ok=True)
    try:
        file = open(os.path.join(output, LOCK), "a+")
    except OSError as error:  # another user's lock file, a read-only folder
        raise ValueError(f"--output {output}: cannot open its lock file: {error}") from error
    try:
        fcntl.flock(file, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        file.seek(0)
        holder = file.read().strip() or "another process"
        file.close()
        raise ValueError(f"--output {output} is in use by another run of this job ({holder} "
                         "holds its lock): wait for it to end, stop it, or give another --output")
    except OSError:  # no locks on this file system (ENOLCK)
        return file
    file.truncate(0)
    file.write(f"pid {os.getpid()} on {os.uname().nodename}\n")
    file.flush()
    return file


def moved_checkpoints(directory):
    """The checkpoints that new runs moved aside in `directory`, oldest first."""
    pattern = os.path.join(glob.escape(directory), PREVIOUS_CHECKPOINT.format("*"))
    return sorted(glob.glob(pattern), key=os.path.getmtime)


def free_previous_name(directory):
    """checkpoint.previous.pt, else checkpoint.previous.2.pt, ...: a name no earlier move
    took (a second run without --resume replaced the first one's, and with it the run)."""
    for number in range(1, 100001):
        path = os.path.join(directory, PREVIOUS_CHECKPOINT.format(f".{number}" if number > 1
                                                                    else ""))
        if not os.path.exists(path):
            return path
    raise ValueError(f"{directory} holds 100000 moved checkpoints: clear it, or give another "
                     "--output")


class Setup:
    """Everything decided and checked before any process group exists: the recipe, the data,
    and where the run starts and stops. A bad argument, data set or checkpoint is a ValueError
    here, which each node's first rank prints (see ArgumentParser)."""

    def __init__(self, args):
        self.rank = rank()
        self.world_size = int(os.environ.get("WORLD_SIZE", 1))
        self.local_rank = int(os.environ.get("LOCAL_RANK", 0))
        self.local_world_size = int(os.environ.get("LOCAL_WORLD_SIZE", 1))
        self.dataset = args.dataset or ("imagenet" if args.data else "fashion-mnist")
        recipe = bb.recipes.get_recipe(args.recipe)
        if recipe.global_batch and args.batch_per_rank:
            raise ValueError(f"{recipe.name} fixes the global batch at {recipe.global_batch}: "
                             "--batch-per-rank does not apply to it")
        if args.epochs:
            recipe = recipe.shortened(args.epochs)
        changes = {"batch_per_rank": args.batch_per_rank, "base_lr": args.base_lr,
                   "bn_group_size": args.bn_group_size}
        self.recipe = recipe.replace(**{key: value for key, value in changes.items()
                                        if value is not None})
        self.schedule = self.recipe.batch_size_schedule(self.world_size)  # checks divisibility
        self.model_name = args.model or ("resnet50" if self.dataset == "imagenet"
                                         else "resnet_small")
        self.device = torch.device(f"cuda:{self.local_rank}" if torch.cuda.is_available()
                                   and not args.cpu else "cpu")
        if args.backend == "nccl" and self.device.type != "cuda":
            raise ValueError("--backend nccl needs CUDA devices: use torus or gloo on the CPU")
        if self.model_name == TORCHVISION_RESNET50 and self.dataset != "imagenet":
            raise ValueError(f"--model {TORCHVISION_RESNET50} takes 3-channel 224x224 images: "
                             "use it with --dataset imagenet")
        self.check_batches(args)
        check_output(args.output)
        check_data(self.dataset, args)
        try:
            self.train, self.test, self.classes, self.channels = load_data(self.dataset, args)
        except (OSError, EOFError) as error:  # an empty ImageFolder, a damaged Fashion-MNIST
            raise ValueError(f"cannot read the {self.dataset} data: {error}") from error
        self.check_sizes()
        self.image_files = image_files_digest(self.train, self.test)
        self.iterations = [self.schedule.batches(epoch, len(self.train))
                           for epoch in range(self.recipe.epochs)]
        self.checkpoint = os.path.join(args.output, CHECKPOINT)
        self.settings = {  # what a resumed run must share with the one it continues
            "world size": self.world_size, "--recipe": self.recipe.name,
            "--epochs": self.recipe.epochs, "--batch-per-rank": self.recipe.batch_per_rank,
            "--base-lr": self.recipe.base_lr, "--bn-group-size": self.recipe.bn_group_size,
            "--model": self.model_name, "--dataset": self.dataset,
            "training images": len(self.train), "classes": self.classes, "--seed": args.seed}
        if self.dataset == "imagenet":  # its files, and the transforms' sizes (its alone)
            self.settings.update({"image files": self.image_files,
                                  "--train-crop-size": args.train_crop_size,
                                  "--val-resize-size": args.val_resize_size,
                                  "--val-crop-size": args.val_crop_size})
        # Before read_resumed moves a checkpoint; a folder not made yet holds none, and main()
        # makes and locks it (a refused run makes nothing).
        self.lock = lock_output(args.output) if self.rank == 0 and os.path.isdir(args.output) \
            else None
        try:
            self.resumed = self.read_resumed(args)  # the checkpoint's contents, when resuming
        except ValueError:
            if self.lock:  # a refused run holds nothing (in a test, its Setup lives on)
                self.lock.close()
            raise
        start = (self.resumed["epoch"], self.resumed["step"]) if self.resumed else (0, 0)
        self.span = RunSpan(self.iterations, *start, args.stop_after_epochs,
                            args.stop_after_steps,
                            evaluated=not self.resumed or self.resumed.get("trained") is None)

    def read_resumed(self, args):
        """The checkpoint this run continues (with --resume, or restarted by torchrun), checked
        against this run's settings; None for a new run. A new run moves an earlier run's
        checkpoint aside (rank 0): torchrun's restarts of this run resume what they find, and
        found that one (a finished run: the job ended without training).

        A restart is a TORCHELASTIC_RESTART_COUNT above 0, or a checkpoint written under this
        job's TORCHELASTIC_RUN_ID (torchrun's --rdzv-id; not its default "none"): a restart for
        a membership change (a node replaced) keeps the count at 0, and a run that started
        over threw away the job's progress."""
        restarted = (int(os.environ.get("TORCHELASTIC_RESTART_COUNT", 0)) > 0
                     or written_by_this_job(self.checkpoint))
        directory = os.path.dirname(self.checkpoint)
        if args.resume and not os.path.exists(self.checkpoint):
            moved = moved_checkpoints(directory)
            raise ValueError(f"--resume: no checkpoint at {self.checkpoint}" + (
                f" (a run without --resume moved an earlier one to {moved[-1]}: move it back "
                "to resume that run)" if moved else ""))
        if (args.resume or restarted) and os.path.exists(self.checkpoint):
            return read_checkpoint(self.checkpoint, self.settings, self.iterations)
        if self.rank == 0 and os.path.exists(self.checkpoint):
            previous = free_previous_name(directory)
            os.replace(self.checkpoint, previous)
            print(f"{self.checkpoint}: an earlier run's checkpoint, moved to {previous} (pass "
                  "--resume to continue a run)", flush=True)
        return None

    def check_batches(self, args):
        """Every rank's batch, and each micro-batch of it, holds 2 samples or more: BatchNorm
        normalizes none of fewer."""
        group = self.recipe.bn_group_size
        if args.max_local_batch and group and args.max_local_batch % group:
            raise ValueError(f"--max-local-batch {args.max_local_batch} must be a multiple of "
                             f"the BatchNorm group size {group}")
        for size in self.schedule.sizes:
            local = size // self.world_size
            if local < 2:  # 1: the global batch is a multiple of the world size
                raise ValueError(f"a global batch of {size} on {self.world_size} ranks leaves "
                                 "one sample per rank, and BatchNorm needs 2 or more: raise "
                                 "--batch-per-rank or use fewer ranks")
            if args.max_local_batch and local % args.max_local_batch == 1:
                raise ValueError(f"--max-local-batch {args.max_local_batch} leaves a last "
                                 f"micro-batch of one sample of the {local} per rank")

    def check_sizes(self):
        largest = max(self.schedule.sizes)
        if len(self.train) < largest:
            raise ValueError(f"{len(self.train)} training images make no global batch of "
                             f"{largest}: use more data (--synthetic-size) or smaller batches")
        if len(self.test) == 0:
            raise ValueError("the test set is empty: use more data (--synthetic-size)")


def micro_batches(images, labels, size):
    """The batch cut into micro-batches of at most `size` samples (all of it for 0)."""
    if not size or len(labels) <= size:
        return [(images, labels)]
    return list(zip(images.split(size), labels.split(size)))


def autocast(device):
    return torch.autocast("cuda", dtype=torch.bfloat16, enabled=device.type == "cuda")


def train_step(model, criterion, optimizer, images, labels, device, max_local_batch):
    """One optimizer step over this rank's batch (accumulated over micro-batches, with DDP's
    allreduce only after the last); returns the batch's mean loss as a tensor on the device
    (no host synchronization here)."""
    parts = micro_batches(images, labels, max_local_batch)
    memory_format = torch.channels_last if device.type == "cuda" else torch.preserve_format
    total = torch.zeros((), device=device)
    for index, (x, y) in enumerate(parts):
        x = x.to(device, memory_format=memory_format, non_blocking=True)
        y = y.to(device, non_blocking=True)
        last = index == len(parts) - 1
        with contextlib.nullcontext() if last else model.no_sync():
            with autocast(device):
                loss = criterion(model(x), y) * (len(y) / len(labels))
            loss.backward()
        total += loss.detach().float()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return total


def train_one_epoch(model, criterion, optimizer, scheduler, loader, epoch, epoch_loss, setup,
                    args, save):
    """Trains the steps of `epoch` left to this run, adding each step's loss to epoch_loss (this
    rank's sum, on the device); save(epoch, steps done, epoch_loss) checkpoints mid-epoch.
    Returns (the last step's LR, whether the run stopped before the epoch's end)."""
    schedule, steps, span = setup.schedule, setup.iterations[epoch], setup.span
    first = span.first_step(epoch)
    loader.batch_sampler.set_epoch(epoch, first_batch=first)
    if hasattr(loader.dataset, "set_epoch"):  # seeded augmentation (before the workers start)
        loader.dataset.set_epoch(epoch)
    start = time.time()
    for step, (images, labels) in enumerate(loader, first):
        loss = train_step(model, criterion, optimizer, images, labels, setup.device,
                          args.max_local_batch)
        epoch_loss += loss
        lr = optimizer.param_groups[0]["lr"]  # the LR of this step, before the next one's
        scheduler.step()
        last = step + 1 == steps
        if setup.rank == 0 and ((step + 1) % args.print_every == 0 or last):
            rate = (step + 1 - first) * schedule(epoch) / (time.time() - start)
            left = images_left(setup.iterations, schedule, epoch, step + 1)
            print(f"epoch {epoch + 1}/{len(setup.iterations)} step {step + 1}/{steps} "
                  f"loss {loss.item():.4f} lr {lr:.4g} batch {schedule(epoch)} "
                  f"{rate:.1f} img/s ETA {format_seconds(left / rate)}", flush=True)
        stopping = span.stop_after_step()
        # At the epoch's last step, the epoch-end checkpoints (before and after evaluation) do.
        if not last and (stopping or args.checkpoint_every
                         and (step + 1) % args.checkpoint_every == 0):
            save(epoch, step + 1, epoch_loss)
        if stopping and not last:
            return lr, True
    return lr, False


@torch.no_grad()
def evaluate(model, loader, device, label_smoothing):
    """(mean loss, accuracy) on the whole test set: each rank's share, summed. The loss is the
    training's (label smoothing included, as torchvision's recipe evaluates): the two losses
    the job reports and plots side by side measure the same thing."""
    model.eval()
    sums = torch.zeros(3, dtype=torch.float64, device=device)  # loss, correct, count
    criterion = nn.CrossEntropyLoss(reduction="sum", label_smoothing=label_smoothing)
    for x, y in loader:
        x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
        with autocast(device):
            logits = model(x).float()
        sums += torch.stack([criterion(logits, y), (logits.argmax(1) == y).sum(),
                             torch.tensor(len(y), device=device)]).double()
    dist.all_reduce(sums)
    model.train()
    return (sums[0] / sums[2]).item(), (sums[1] / sums[2]).item()


def images_left(iterations, schedule, epoch, steps_done):
    """Training images from step `steps_done` of `epoch` to the recipe's end (for the ETA)."""
    later = sum(iterations[e] * schedule(e) for e in range(epoch + 1, len(iterations)))
    return later + (iterations[epoch] - steps_done) * schedule(epoch)


def save_checkpoint(path, state):
    """Written to a temporary file, on the disk before it is renamed (and the rename after):
    neither a crash nor a power loss leaves half a checkpoint where the last whole one was."""
    directory = os.path.dirname(path) or "."
    os.makedirs(directory, exist_ok=True)
    temporary = f"{path}.tmp"
    with open(temporary, "wb") as file:
        torch.save(state, file)
        file.flush()
        os.fsync(file.fileno())
    os.replace(temporary, path)
    descriptor = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(descriptor)
    except OSError:  # some file systems (FUSE, network ones) refuse it for a folder: the
        pass  # checkpoint is whole; only the rename's durability is then theirs to keep
    finally:
        os.close(descriptor)


def check_same_start(start, data, device):
    """Every rank continues from the same (epoch, step) on the same data. Ranks that read
    different checkpoints (an --output that not every node shares) would train different
    steps; ranks that read different files (a node's copy of the data missing some) would
    shuffle other orders, score overlapping shares of the test set, or take other step counts
    and hang. `data`: (training images, test images, image_files_digest). One MAX allreduce
    of (-value, value) for each value gives the smallest and the largest."""
    values = [start[0] * 2**32 + start[1], *data]  # a place: epoch * 2**32 + step
    both = torch.tensor([[-value, value] for value in values], dtype=torch.int64, device=device)
    dist.all_reduce(both, op=dist.ReduceOp.MAX)
    first, *fewest, low_digest = (-both[:, 0]).tolist()
    last, *most, high_digest = both[:, 1].tolist()
    if first != last:
        earliest, latest = divmod(first, 2**32), divmod(last, 2**32)
        raise RuntimeError(
            f"the ranks start at different points, from epoch {earliest[0] + 1} step "
            f"{earliest[1]} to epoch {latest[0] + 1} step {latest[1]}: each rank resumes from "
            "the checkpoint in its own --output; put --output on storage every node shares")
    for name, low, high in zip(("training images", "test images"), fewest, most):
        if low != high:
            raise RuntimeError(f"the ranks read different data: from {low} to {high} {name}; "
                               "every node must read the same files")
    if low_digest != high_digest:
        raise RuntimeError("the ranks read different data: the same number of images, but "
                           "other file names or classes; every node must read the same files")


def image_files_digest(train, test):
    """A CRC-32 of the ImageFolders' file names (relative to their folder) and labels, in
    order; 0 for in-memory data, which every rank reads from the same arrays."""
    folders = [getattr(dataset, "dataset", dataset) for dataset in (train, test)]
    if not all(hasattr(folder, "samples") for folder in folders):
        return 0
    digest = 0
    for folder in folders:
        prefix = os.path.join(folder.root, "")  # cut, not os.path.relpath: 3x faster
        for path, label in folder.samples:
            name = path[len(prefix):] if path.startswith(prefix) else path
            digest = zlib.crc32(f"{name}\t{label}\n".encode(errors="surrogateescape"), digest)
    return digest


def write_metrics(output, rows):
    with open(os.path.join(output, "metrics.csv"), "w", newline="") as file:
        writer = csv.DictWriter(file, fieldnames=METRICS)
        writer.writeheader()
        writer.writerows(rows)
    try:
        import matplotlib
    except ImportError:
        print("matplotlib is not installed: no metrics.png (pip install matplotlib)")
        return
    matplotlib.use("Agg")
    from matplotlib import pyplot
    epochs = [row["epoch"] for row in rows]
    figure, axes = pyplot.subplots(1, 4, figsize=(16, 3.5))
    panels = [("loss", ("train_loss", "test_loss")), ("test accuracy", ("test_accuracy",)),
              ("learning rate (last step)", ("lr",)), ("global batch", ("global_batch",))]
    for axis, (title, keys) in zip(axes, panels):
        for key in keys:
            axis.plot(epochs, [row[key] for row in rows], marker="o", label=key)
        axis.set_title(title)
        axis.set_xlabel("epoch")
        if len(keys) > 1:
            axis.legend()
    figure.tight_layout()
    figure.savefig(os.path.join(output, "metrics.png"), dpi=80)
    pyplot.close(figure)


def format_seconds(seconds):
    return str(datetime.timedelta(seconds=int(seconds)))


def build_model(name, classes, channels, recipe):
    """One of torch_bigbatch's ResNets, or torchvision's ResNet-50, with the recipe's local
    BatchNorm, zero-initialized residual BatchNorm and fc initialization put in."""
    if name == TORCHVISION_RESNET50:
        import torchvision
        model = torchvision.models.resnet50(num_classes=classes,
                                            zero_init_residual=recipe.zero_init_residual)
        if recipe.bn_group_size != 0:
            model = bb.nn.convert_local_batchnorm(model, recipe.bn_group_size)
    else:
        model = getattr(bb.models, name)(num_classes=classes, in_channels=channels,
                                         bn_group_size=recipe.bn_group_size,
                                         zero_init_residual=recipe.zero_init_residual)
    return recipe.init_fc(model)


def describe_backend():
    """The process group's backend, with the shape the torus really got: "torus (2x2)"."""
    backend = dist.get_backend()
    if backend != "torus":
        return backend
    columns, rows = bb.distributed.torus_shape()
    return f"torus ({columns}x{rows})"


def main(args):
    # With PYTHONFAULTHANDLER=1 (as the tests run it), a rank that torchrun stops (SIGTERM,
    # after another rank failed) prints where each of its threads was, as a crashing one does.
    if faulthandler.is_enabled():
        faulthandler.register(signal.SIGTERM, all_threads=True, chain=True)
    try:
        setup = Setup(args)
        if setup.rank == 0 and setup.lock is None:
            setup.lock = lock_output(args.output)
    except ValueError as error:  # one message per node, before any process group
        get_args_parser().error(str(error))
    recipe, schedule, device, span = setup.recipe, setup.schedule, setup.device, setup.span
    if args.use_deterministic_algorithms:
        # cuBLAS is deterministic only with a fixed workspace, set before its first call.
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        torch.use_deterministic_algorithms(True)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    elif "OMP_NUM_THREADS" not in os.environ:  # share the cores among this node's ranks
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // setup.local_world_size))
    # A plain `python train_resnet50.py` (no WORLD_SIZE: one process) needs no rendezvous: a
    # store in this process, not a port that two such runs would both take.
    store = dist.HashStore() if "WORLD_SIZE" not in os.environ else None
    dist.init_process_group(args.backend, store=store, rank=setup.rank,
                            world_size=setup.world_size,
                            timeout=datetime.timedelta(seconds=args.timeout))
    # A finished run ends only after the ranks compared where they start: a rank that ended
    # before the rendezvous left the others waiting in it for the whole timeout.
    check_same_start((span.start_epoch, span.start_step),
                     (len(setup.train), len(setup.test), setup.image_files), device)
    if span.finished:
        if setup.rank == 0:  # its metrics again: a stop after the last checkpoint lost them
            write_metrics(args.output, setup.resumed["metrics"])
            print(f"{setup.checkpoint} holds a finished run: nothing to resume (metrics in "
                  f"{args.output})", flush=True)
        dist.barrier()
        dist.destroy_process_group()
        return
    torch.manual_seed(args.seed)

    model = build_model(setup.model_name, setup.classes, setup.channels, recipe).to(device)
    if device.type == "cuda":
        model = model.to(memory_format=torch.channels_last)
    optimizer = recipe.build_optimizer(model, setup.world_size)
    scheduler = recipe.build_scheduler(optimizer, setup.iterations, setup.world_size)
    criterion = recipe.criterion()

    # This rank's sum of step losses in the epoch (their count is world_size x steps); a run
    # resumed mid-epoch puts the checkpoint's total (all ranks') on rank 0, so the epoch's
    # all_reduce still sums them all (an epoch-end checkpoint holds 0).
    def zero_loss():
        return torch.zeros((), dtype=torch.float64, device=device)

    rows, resumed_loss = [], zero_loss()
    if setup.resumed:
        model.load_state_dict(setup.resumed["model"])
        optimizer.load_state_dict(setup.resumed["optimizer"])
        scheduler.load_state_dict(setup.resumed["scheduler"])
        rows = setup.resumed["metrics"]
        if setup.rank == 0:
            resumed_loss = setup.resumed["epoch_loss"].to(device)
    # DDP broadcasts rank 0's BatchNorm buffers (running statistics) before every forward, as
    # torch's reference recipe does; each rank's forward then moves its own copy, so the epoch
    # ends with rank 0's broadcast once more before evaluation (see below).
    ddp = DistributedDataParallel(model, device_ids=[device.index]
                                  if device.type == "cuda" else None)

    sampler = DistributedBatchSampler(len(setup.train), schedule, setup.rank, setup.world_size,
                                      seed=args.seed)
    train_loader = data_loader(setup.train, sampler, setup, args)
    shard = torch.arange(len(setup.test)).tensor_split(setup.world_size)[setup.rank]
    # The evaluation's batch: what training feeds the model at once fits in memory.
    test_batch = args.max_local_batch or schedule(0) // setup.world_size
    test_loader = data_loader(setup.test, BatchSampler(shard.tolist(), test_batch, False),
                              setup, args)

    def save(epoch, step, epoch_loss, trained=None):
        """Every rank calls it at the same steps: it sums the epoch's losses over the ranks."""
        total = epoch_loss.clone()
        dist.all_reduce(total)
        if setup.rank == 0:
            save_checkpoint(setup.checkpoint, {
                "model": model.state_dict(), "optimizer": optimizer.state_dict(),
                "scheduler": scheduler.state_dict(), "epoch": epoch, "step": step,
                "epoch_loss": total, "metrics": rows, "settings": setup.settings,
                "trained": trained, "job": job_id(),
                "args": vars(args), "recipe": dataclasses.asdict(recipe)})

    if setup.rank == 0:
        resumed = f", resumed at epoch {span.start_epoch + 1} step {span.start_step}" \
            if setup.resumed else ""
        if setup.resumed and span.evaluation_only(span.start_epoch):
            resumed += " (trained, not yet evaluated)"
        print(f"{recipe.name}: {setup.model_name} on {setup.dataset} ({len(setup.train)} "
              f"images), {setup.world_size} x {device.type}, backend {describe_backend()}, "
              f"global batch {schedule(0)} (LR {recipe.peak_lr(setup.world_size):.4g}), "
              f"{recipe.epochs} epochs{resumed}", flush=True)
    stopped_mid_epoch = False
    for epoch in span.epochs():
        steps = setup.iterations[epoch]
        if span.evaluation_only(epoch):
            trained = setup.resumed["trained"]
        else:
            epoch_start = time.time()
            epoch_loss = resumed_loss.clone() if epoch == span.start_epoch else zero_loss()
            lr, stopped_mid_epoch = train_one_epoch(ddp, criterion, optimizer, scheduler,
                                                    train_loader, epoch, epoch_loss, setup, args,
                                                    save)
            if stopped_mid_epoch:
                break
            train_seconds = time.time() - epoch_start
            train_loss = epoch_loss.clone()
            dist.all_reduce(train_loss)
            trained = {"train_loss": (train_loss / (setup.world_size * steps)).item(), "lr": lr,
                       "images_per_second": (steps - span.first_step(epoch)) * schedule(epoch)
                       / train_seconds, "seconds": train_seconds}
            save(epoch, steps, zero_loss(), trained)  # kept if the evaluation fails
        evaluation_start = time.time()
        for buffer in model.buffers():  # every rank evaluates rank 0's (checkpointed) statistics
            dist.broadcast(buffer, src=0)
        test_loss, accuracy = evaluate(model, test_loader, device, recipe.label_smoothing)
        rows.append({"epoch": epoch + 1, "train_loss": trained["train_loss"],
                     "test_loss": test_loss, "test_accuracy": accuracy,
                     "lr": trained["lr"], "global_batch": schedule(epoch),
                     "images_per_second": trained["images_per_second"],
                     "seconds": trained["seconds"] + time.time() - evaluation_start})
        save(epoch, steps, zero_loss())
        if setup.rank == 0:
            write_metrics(args.output, rows)
            print(f"epoch {epoch + 1}: train loss {rows[-1]['train_loss']:.4f}, test loss "
                  f"{test_loss:.4f}, test accuracy {100 * accuracy:.2f}% "
                  f"({rows[-1]['seconds']:.0f} s)", flush=True)
        if span.stop_after_epoch(trained=not span.evaluation_only(epoch)):
            break
    if setup.rank == 0 and stopped_mid_epoch:
        print(f"stopped after {span.steps_run} steps, checkpoint in {setup.checkpoint}",
              flush=True)
    elif setup.rank == 0 and rows:
        finished = "finished" if rows[-1]["epoch"] == recipe.epochs else "stopped"
        print(f"{finished} after epoch {rows[-1]['epoch']}: test accuracy "
              f"{100 * rows[-1]['test_accuracy']:.2f}% (metrics in {args.output})", flush=True)
    # No rank leaves while another still runs a collective.
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(get_args_parser().parse_args())
    # Gloo's worker threads drop a collective's tensors after its caller has moved on, and
    # dropping a tensor that Python sees takes the GIL: where the interpreter is finalizing by
    # then, Python (before 3.14) ends that thread with pthread_exit, which aborts the process
    # ("terminate called without an active exception", from ~AsyncWork on pt_gloo_runloop: 5 of
    # 8 runs of a 4-rank Gloo job here; 1 rank in a CI run even after the barrier above).
    # destroy_process_group() does not join those threads (the group survives, referenced from
    # torch's C++ side), so the job ends without finalizing: every file is closed and the
    # output flushed by now (main(), run from Python, returns as any function does).
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
