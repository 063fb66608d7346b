"""Batch-size control (Mikami et al. 2018): a global batch that grows during training, and the
sampler that cuts each epoch's shuffled samples into global batches split across the ranks."""

import bisect

import torch
from torch.utils.data import Sampler

from .._checks import as_index, is_int


class BatchSizeSchedule:
    """The global batch size of every epoch, from {first epoch: batch size} (an int: constant).

    BatchSizeSchedule({0: 32768, 30: 65536}) trains epochs 0-29 at 32K and the rest at 64K.
    lr_factor(epoch) is batch(epoch) / batch(0): the linear scaling rule at the current batch.
    """

    def __init__(self, batch_sizes):
        if isinstance(batch_sizes, int) and not isinstance(batch_sizes, bool):
            batch_sizes = {0: batch_sizes}
        if not isinstance(batch_sizes, dict) or 0 not in batch_sizes:
            raise ValueError("batch sizes must be an int or a dict {first epoch: batch size} "
                             f"with an entry for epoch 0, got {batch_sizes!r}")
        for epoch, size in batch_sizes.items():
            if not (is_int(epoch) and epoch >= 0 and is_int(size) and size > 0):
                raise ValueError(f"invalid entry {epoch!r}: {size!r} (epochs are ints >= 0, "
                                 "batch sizes ints > 0)")
        self.starts = sorted(batch_sizes)
        self.sizes = [batch_sizes[epoch] for epoch in self.starts]

    def __call__(self, epoch):
        if not (is_int(epoch) and epoch >= 0):  # -1 gave the last epoch's size
            raise ValueError(f"epoch must be an int >= 0, got {epoch!r}")
        return self.sizes[bisect.bisect_right(self.starts, epoch) - 1]

    def lr_factor(self, epoch):
        return self(epoch) / self.sizes[0]

    def check_divisible(self, world_size):
        """Raises ValueError unless every batch size splits evenly across world_size ranks."""
        for size in self.sizes:
            if size % world_size:
                raise ValueError(f"the global batch {size} does not split across {world_size} "
                                 "ranks: it must be a multiple of the world size")

    def batches(self, epoch, dataset_size, drop_last=True):
        """Global batches in `epoch` over `dataset_size` samples."""
        size = self(epoch)
        return dataset_size // size if drop_last else -(-dataset_size // size)

    def __repr__(self):
        return f"BatchSizeSchedule({dict(zip(self.starts, self.sizes))})"


class DistributedBatchSampler(Sampler):
    """Yields this rank's share of every global batch of an epoch, as lists of indices.

    Each epoch draws one permutation of range(dataset_size) from a generator seeded with
    seed + epoch, the same on every rank; consecutive global batches of schedule(epoch) samples
    are cut from it and each is split into world_size equal, contiguous parts, so every sample
    is seen once per epoch across the ranks. drop_last=True (the default) drops the incomplete
    last global batch, keeping every step's batch (and its BatchNorm groups) the same size;
    with drop_last=False it is padded with samples from the start of the epoch's permutation to
    a multiple of world_size, so that every rank gets an equal share of it (as torch's
    DistributedSampler pads: a rank with no samples would fail while the others wait). Call set_epoch(epoch) before
    iterating, as with torch's DistributedSampler; set_epoch(epoch, first_batch) starts that
    epoch at a later batch (a job resumed mid-epoch skips what it has done without loading it).
    """

    def __init__(self, dataset_size, schedule, rank, world_size, seed=0, drop_last=True):
        if not (is_int(rank) and is_int(world_size) and 0 <= rank < world_size):
            raise ValueError(f"rank must be an int in [0, world_size), and world_size a positive "
                             f"int; got rank {rank!r}, world_size {world_size!r}")
        if not (is_int(dataset_size) and dataset_size >= 0):
            raise ValueError(f"dataset_size must be an int >= 0, got {dataset_size!r}")
        index = as_index(seed)  # numpy's integers too, as torch's DistributedSampler takes
        # torch's CPU generator keeps a seed's low 32 bits: 2**32 would repeat seed 0's orders.
        if index is None or not 0 <= index < 2**32:
            raise ValueError(f"seed must be an int in [0, 2**32), got {seed!r}")
        seed = index
        self.schedule = schedule if isinstance(schedule, BatchSizeSchedule) \
            else BatchSizeSchedule(schedule)
        self.schedule.check_divisible(world_size)
        self.dataset_size, self.rank, self.world_size = dataset_size, rank, world_size
        self.seed, self.drop_last, self.epoch, self.first_batch = seed, drop_last, 0, 0

    def set_epoch(self, epoch, first_batch=0):
        for name, value in (("epoch", epoch), ("first_batch", first_batch)):
            if not (is_int(value) and value >= 0):  # a negative first batch yielded an empty one
                raise ValueError(f"{name} must be an int >= 0, got {value!r}")
        self.epoch, self.first_batch = epoch, first_batch

    def __len__(self):
        """The batches still to come in this epoch."""
        total = self.schedule.batches(self.epoch, self.dataset_size, self.drop_last)
        return max(0, total - self.first_batch)

    def __iter__(self):
        generator = torch.Generator().manual_seed(self.seed + self.epoch)
        order = torch.randperm(self.dataset_size, generator=generator)
        size = self.schedule(self.epoch)
        padding = -self.dataset_size % self.world_size  # the last batch's (sizes split evenly)
        if not self.drop_last and padding:
            order = torch.cat([order, order.repeat(-(-padding // self.dataset_size))[:padding]])
        for start in range(self.first_batch * size, (self.first_batch + len(self)) * size, size):
            batch = order[start:start + size]
            yield batch.tensor_split(self.world_size)[self.rank].tolist()
