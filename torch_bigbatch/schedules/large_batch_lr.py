"""The per-iteration learning rate of large-batch training: a warmup, then a decay."""

import bisect
import math
import numbers
from collections.abc import Iterable

import torch
from torch.optim.lr_scheduler import LRScheduler

from .._checks import is_int
from .batch_size import BatchSizeSchedule

WARMUPS = ("gradual", "constant", "none")
DECAYS = ("step", "poly", "cosine", "none")


class LargeBatchLR(LRScheduler):
    """Warmup then decay, computed in closed form from the iteration; call step() after every
    optimizer.step(). The optimizer's learning rates are the peak (scaled) ones, k * eta.

    Warmup over `warmup_epochs` (Goyal et al. 2017, section 2.2):
      "gradual"   from warmup_start_factor * peak to the peak, linearly per iteration;
      "constant"  warmup_start_factor * peak, then a jump to the peak;
      "none"      the peak from the start.
    Goyal et al.'s warmup starts at eta, the LR of batch 256: warmup_start_factor = 256 / batch.
    Then, over the remaining epochs:
      "step"      times gamma at every epoch of `milestones` reached (Goyal: 30, 60, 80 of 90);
      "poly"      (1 - t) ** power, t going from 0 after warmup to 1 at `epochs` (MLPerf LARS);
      "cosine"    (1 + cos(pi t)) / 2;
      "none"      constant.
    With a batch_size_schedule (batch-size control), the LR also follows the linear scaling rule
    at each epoch's batch: times schedule.lr_factor(epoch).

    iterations_per_epoch is an int, or one int per epoch when the batch size changes.
    state_dict() holds the progress only (the iteration), not the configuration: a resumed job
    continues where it stopped on the schedule it is constructed with.
    """

    PROGRESS = ("last_epoch", "_step_count", "_last_lr")

    def __init__(self, optimizer, iterations_per_epoch, epochs, warmup="gradual",
                 warmup_epochs=5.0, warmup_start_factor=0.0, decay="step",
                 milestones=(30, 60, 80), gamma=0.1, power=2.0, batch_size_schedule=None,
                 last_epoch=-1):
        if isinstance(epochs, bool) or not isinstance(epochs, int) or epochs <= 0:
            raise ValueError(f"epochs must be a positive int, got {epochs!r}")
        if warmup not in WARMUPS:
            raise ValueError(f"warmup must be one of {WARMUPS}, got {warmup!r}")
        if decay not in DECAYS:
            raise ValueError(f"decay must be one of {DECAYS}, got {decay!r}")
        if batch_size_schedule is not None and \
                not isinstance(batch_size_schedule, BatchSizeSchedule):
            # a dict or an int, as DistributedBatchSampler takes it (refused by name otherwise)
            batch_size_schedule = BatchSizeSchedule(batch_size_schedule)
        if warmup != "none" and not isinstance(warmup_epochs, numbers.Real):
            raise ValueError(f"warmup_epochs must be a number, got {warmup_epochs!r}")
        milestones = tuple(milestones)  # an iterator would be used up by the checks below
        if warmup == "constant" and warmup_epochs > 0 and warmup_start_factor == 0:
            raise ValueError("a constant warmup at warmup_start_factor=0 trains at LR 0 for "
                             f"{warmup_epochs} epochs: give the factor (Goyal et al.: 256 / batch)")
        if isinstance(iterations_per_epoch, int):
            # (a growth step after the last epoch changes nothing)
            if batch_size_schedule is not None and \
                    len({batch_size_schedule(epoch) for epoch in range(epochs)}) > 1:
                raise ValueError("iterations_per_epoch must be one int per epoch when the batch "
                                 f"size changes ({batch_size_schedule}), got one int")
            iterations_per_epoch = [iterations_per_epoch] * epochs
        # A float (len(dataset) / batch), a numpy int or a tensor: refused below, by name.
        given = iterations_per_epoch
        iterations_per_epoch = list(iterations_per_epoch) \
            if isinstance(iterations_per_epoch, Iterable) \
            and not isinstance(iterations_per_epoch, torch.Tensor) else [iterations_per_epoch]
        if len(iterations_per_epoch) != epochs \
                or not all(is_int(count) and count > 0 for count in iterations_per_epoch):
            raise ValueError(f"iterations_per_epoch must be a positive int or {epochs} of them "
                             f"(one per epoch), got {given!r}")
        if warmup != "none" and not 0 <= warmup_epochs <= epochs:
            raise ValueError(f"warmup_epochs must be in [0, {epochs}], got {warmup_epochs}")
        for name, value in (("warmup_start_factor", warmup_start_factor), ("gamma", gamma),
                            ("power", power), *(("milestones", m) for m in milestones)):
            if not value >= 0:
                raise ValueError(f"{name} must be non-negative, got {value}")
        if not warmup_start_factor <= 1:  # a warmup that comes down to the peak
            raise ValueError(f"warmup_start_factor must be in [0, 1], got {warmup_start_factor}")
        self.epoch_starts = [0]  # the first iteration of every epoch, and the total
        for count in iterations_per_epoch:
            self.epoch_starts.append(self.epoch_starts[-1] + count)
        self.epochs, self.warmup, self.decay = epochs, warmup, decay
        self.warmup_epochs = warmup_epochs if warmup != "none" else 0.0
        self.warmup_start_factor, self.milestones = warmup_start_factor, sorted(milestones)
        self.gamma, self.power, self.batch_size_schedule = gamma, power, batch_size_schedule
        # The boundaries as iterations: compared as floats, an epoch count that falls on an
        # iteration could round either way (1 + 2/3 < 5/3) and take effect one step late.
        self.warmup_end = self.first_iteration_at(self.warmup_epochs)
        self.milestone_iterations = [self.first_iteration_at(m) for m in self.milestones]
        super().__init__(optimizer, last_epoch)

    def first_iteration_at(self, epochs_elapsed):
        """The first iteration at which `epochs_elapsed` epochs have passed (the end of
        training, one past its last iteration, for the last epoch's end; past it, never)."""
        if epochs_elapsed > self.epochs:
            return math.inf
        epoch = min(math.floor(epochs_elapsed), self.epochs - 1)
        start, end = self.epoch_starts[epoch], self.epoch_starts[epoch + 1]
        # An epoch count a hair above an iteration's (0.33333333333333337 for 1 of 3) is that
        # iteration's: the tolerance is far below one iteration.
        return start + math.ceil((epochs_elapsed - epoch) * (end - start) - 1e-9)

    def progress(self, iteration):
        """(epoch, epochs elapsed as a float) at `iteration`; past the end, the last epoch's end."""
        iteration = min(iteration, self.epoch_starts[-1])
        epoch = min(bisect.bisect_right(self.epoch_starts, iteration) - 1, self.epochs - 1)
        length = self.epoch_starts[epoch + 1] - self.epoch_starts[epoch]
        return epoch, epoch + (iteration - self.epoch_starts[epoch]) / length

    def factor(self, iteration):
        """The LR at `iteration` as a multiple of the peak LR."""
        epoch, elapsed = self.progress(iteration)
        iteration = min(iteration, self.epoch_starts[-1])
        scale = 1.0 if self.batch_size_schedule is None \
            else self.batch_size_schedule.lr_factor(epoch)
        if iteration < self.warmup_end:
            if self.warmup == "constant":
                return scale * self.warmup_start_factor
            fraction = min(1.0, elapsed / self.warmup_epochs)
            return scale * (self.warmup_start_factor + (1 - self.warmup_start_factor) * fraction)
        if self.decay == "step":
            return scale * self.gamma ** bisect.bisect_right(self.milestone_iterations, iteration)
        span = self.epochs - self.warmup_epochs
        t = min(1.0, (elapsed - self.warmup_epochs) / span) if span > 0 else 1.0
        if self.decay == "poly":
            return scale * (1 - t) ** self.power
        if self.decay == "cosine":
            return scale * (1 + math.cos(math.pi * t)) / 2
        return scale

    def state_dict(self):
        return {key: self.__dict__[key] for key in self.PROGRESS}

    def load_state_dict(self, state_dict):
        self.__dict__.update({key: state_dict[key] for key in self.PROGRESS})

    def get_lr(self):
        factor = self.factor(self.last_epoch)
        return [base_lr * factor for base_lr in self.base_lrs]
