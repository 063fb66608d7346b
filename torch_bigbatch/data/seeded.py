"""Random augmentation that a resumed run repeats exactly."""

import operator

import torch
from torch.utils.data import Dataset

_MIX = 0x9E3779B97F4A7C15  # 2**64 / golden ratio: spreads nearby (seed, epoch, index) apart


class SeededSamples(Dataset):
    """`dataset` with each sample loaded under torch's generator seeded by (seed, epoch, index).

    torchvision's random transforms (RandomResizedCrop, RandomHorizontalFlip) draw from torch's
    global generator. In DataLoader workers that generator is seeded from the main process's at
    each epoch's start, so a run resumed mid-epoch, or one with another worker count, would crop
    other images. Here a sample's crop depends only on the seed, the epoch (set_epoch, before
    the epoch's loader is iterated) and its index: a resumed run continues bit for bit.
    """

    def __init__(self, dataset, seed=0):
        self.dataset, self.seed, self.epoch = dataset, seed, 0

    def set_epoch(self, epoch):
        self.epoch = epoch

    def __len__(self):
        return len(self.dataset)

    def __getitem__(self, index):
        index = operator.index(index)  # numpy and tensor indices too (their products overflow)
        seed = ((self.seed * _MIX + self.epoch) * _MIX + index) % 2**63
        # The CPU generator alone (the transforms draw from it): torch.manual_seed would also
        # reseed every GPU's, which fork_rng(devices=[]) does not restore.
        with torch.random.fork_rng(devices=[]):  # the caller's generator is left as it was
            torch.default_generator.manual_seed(seed)
            return self.dataset[index]
