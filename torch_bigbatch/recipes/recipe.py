"""A paper's training setup as one value that scales with the world size by the linear rule."""

import dataclasses

import torch
from torch import nn

from .._checks import is_int
from ..optim import LARS, SGD, param_groups
from ..schedules import BatchSizeSchedule, LargeBatchLR, linear_scaling


@dataclasses.dataclass(frozen=True)
class Recipe:
    """Hyperparameters of a large-batch ResNet run, and what they build.

    The global batch is batch_per_rank * world_size (or global_batch, when a paper fixes it),
    times the factors of batch_growth from their epochs on (batch-size control); the peak LR is
    base_lr per base_batch samples, scaled linearly. Replace fields with `recipe.replace(...)`.
    """

    name: str
    epochs: int = 90
    batch_per_rank: int = 32
    global_batch: int | None = None
    batch_growth: tuple = ()  # ((epoch, factor), ...): the global batch times factor from epoch on
    base_lr: float = 0.1
    base_batch: int = 256
    optimizer: str = "sgd"  # "sgd" or "lars"
    momentum: float = 0.9
    nesterov: bool = True
    weight_decay: float = 1e-4  # not on biases or BatchNorm parameters
    trust_coefficient: float = 0.001  # LARS
    warmup: str = "gradual"
    warmup_epochs: float = 5.0
    warmup_from_base_lr: bool = True  # start the warmup at base_lr (Goyal), else at 0
    decay: str = "step"
    milestones: tuple = (30, 60, 80)
    gamma: float = 0.1
    power: float = 2.0
    label_smoothing: float = 0.0
    bn_group_size: int | None = 32  # samples per BatchNorm group; 0: nn.BatchNorm2d
    zero_init_residual: bool = True
    fc_init_std: float | None = None  # the last layer's weights from N(0, std), bias 0 (Goyal)

    def replace(self, **changes):
        return dataclasses.replace(self, **changes)

    def init_fc(self, model):
        """Draws `model.fc`'s weights from N(0, fc_init_std) and zeroes its bias (Goyal et al.,
        section 5.1), where the recipe sets fc_init_std; returns the model."""
        if self.fc_init_std is not None:
            fc = getattr(model, "fc", None)
            if not isinstance(fc, nn.Linear):
                raise ValueError(f"{self.name} initializes the model's last layer, model.fc, as "
                                 f"an nn.Linear; got {type(fc).__name__}")
            with torch.no_grad():
                fc.weight.normal_(0.0, self.fc_init_std)
                if fc.bias is not None:
                    fc.bias.zero_()
        return model

    def shortened(self, epochs):
        """The same recipe over `epochs` epochs: warmup, milestones and batch growth move in
        proportion (goyal2017.shortened(3) warms up for 1/6 epoch, decays at 1, 2 and 2.67); a
        growth that would start at or after the last epoch is left out (its batch would never
        run, yet the job checks that it splits across the ranks and the data)."""
        if epochs <= 0:
            raise ValueError(f"epochs must be positive, got {epochs}")
        ratio = epochs / self.epochs
        growth = ((max(1, round(e * ratio)), f) for e, f in self.batch_growth)
        return self.replace(epochs=epochs, warmup_epochs=self.warmup_epochs * ratio,
                            milestones=tuple(m * ratio for m in self.milestones),
                            batch_growth=tuple((e, f) for e, f in growth if e < epochs))

    def batch_size_schedule(self, world_size):
        """Global batch per epoch; every size must split evenly across the ranks."""
        if not (is_int(world_size) and world_size >= 1):
            raise ValueError(f"world_size must be a positive int, got {world_size!r}")
        if not self.global_batch and not (is_int(self.batch_per_rank)
                                          and self.batch_per_rank >= 1):
            raise ValueError(f"{self.name}: batch_per_rank must be a positive int, got "
                             f"{self.batch_per_rank!r}")
        first = self.global_batch or self.batch_per_rank * world_size
        sizes = {0: first}
        for epoch, factor in self.batch_growth:
            sizes[epoch] = int(first * factor)
        schedule = BatchSizeSchedule(sizes)
        schedule.check_divisible(world_size)
        return schedule

    def peak_lr(self, world_size):
        return linear_scaling(self.base_lr, self.batch_size_schedule(world_size)(0),
                              self.base_batch)

    def criterion(self):
        return nn.CrossEntropyLoss(label_smoothing=self.label_smoothing)

    def build_optimizer(self, model, world_size):
        """Fused SGD (Nesterov) or LARS at the peak LR, with no decay on biases and BN."""
        groups = param_groups(model, self.weight_decay)
        options = {"lr": self.peak_lr(world_size), "momentum": self.momentum,
                   "nesterov": self.nesterov}
        if self.optimizer == "lars":
            return LARS(groups, trust_coefficient=self.trust_coefficient, **options)
        if self.optimizer == "sgd":
            return SGD(groups, **options)
        raise ValueError(f"optimizer must be 'sgd' or 'lars', got {self.optimizer!r}")

    def build_scheduler(self, optimizer, iterations_per_epoch, world_size):
        """LargeBatchLR over `epochs`; iterations_per_epoch: one per epoch (an int where the
        batch size stays the same)."""
        if self.warmup == "constant" and not self.warmup_from_base_lr:
            raise ValueError(f"{self.name}: a constant warmup from 0 would train at LR 0 for "
                             f"{self.warmup_epochs} epochs: set warmup_from_base_lr=True")
        schedule = self.batch_size_schedule(world_size)
        # From base_lr up to the peak (by the linear rule, base_batch / batch of the peak); a
        # batch below base_batch has no warmup to do.
        start = min(1.0, self.base_batch / schedule(0)) if self.warmup_from_base_lr else 0.0
        return LargeBatchLR(optimizer, iterations_per_epoch, self.epochs, warmup=self.warmup,
                            warmup_epochs=self.warmup_epochs, warmup_start_factor=start,
                            decay=self.decay, milestones=self.milestones, gamma=self.gamma,
                            power=self.power, batch_size_schedule=schedule)
