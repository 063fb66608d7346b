"""Large-batch schedules against plain-Python formulas at known iterations, and the batch
sampler against the set of samples it must cover."""

import math

import pytest
import torch

import torch_bigbatch as bb
from torch_bigbatch.schedules import (BatchSizeSchedule, DistributedBatchSampler, LargeBatchLR,
                                      linear_scaling)


def optimizer(lr):
    return torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=lr, momentum=0.9)


def lrs(scheduler, iterations):
    """The LR used at iterations 0 .. iterations - 1 (step() after every optimizer step)."""
    values = []
    for _ in range(iterations):
        values.append(scheduler.get_last_lr()[0])
        scheduler.optimizer.step()
        scheduler.step()
    return values


def test_linear_scaling():
    assert linear_scaling(0.1, 8192) == pytest.approx(3.2)
    assert linear_scaling(0.1, 256) == 0.1
    assert linear_scaling(0.2, 1024, base_batch_size=512) == pytest.approx(0.4)
    with pytest.raises(ValueError, match="batch_size"):
        linear_scaling(0.1, 0)
    with pytest.raises(ValueError, match="batch_size must be a positive int"):
        linear_scaling(0.1, 100.5)
    for base_lr in (float("nan"), float("inf"), -0.1):  # nan was returned as the LR
        with pytest.raises(ValueError, match="base_lr must be finite and non-negative"):
            linear_scaling(base_lr, 256)


def test_goyal_gradual_warmup_then_steps():
    """Batch 8k (k = 32): from 0.1 to 3.2 over 5 epochs per iteration, x0.1 at 30, 60, 80."""
    peak = linear_scaling(0.1, 8192)
    scheduler = LargeBatchLR(optimizer(peak), iterations_per_epoch=10, epochs=90,
                             warmup="gradual", warmup_epochs=5, warmup_start_factor=256 / 8192)
    values = lrs(scheduler, 900)
    assert values[0] == pytest.approx(0.1)
    assert values[25] == pytest.approx(0.1 + (3.2 - 0.1) * 25 / 50)
    for i in range(1, 50):  # strictly increasing, by the same amount every iteration
        assert values[i] - values[i - 1] == pytest.approx((3.2 - 0.1) / 50)
    assert values[50] == pytest.approx(3.2) and values[299] == pytest.approx(3.2)
    assert values[300] == pytest.approx(0.32) and values[599] == pytest.approx(0.32)
    assert values[600] == pytest.approx(0.032) and values[800] == pytest.approx(0.0032)
    assert values[899] == pytest.approx(0.0032)


def test_constant_warmup_jumps():
    scheduler = LargeBatchLR(optimizer(3.2), 10, 90, warmup="constant", warmup_epochs=5,
                             warmup_start_factor=1 / 32)
    values = lrs(scheduler, 51)
    assert values[0] == values[49] == pytest.approx(0.1)
    assert values[50] == pytest.approx(3.2)


def test_poly_decay_mlperf_lars():
    """MLPerf's LARS: lr 10.5, warmup 2 epochs, (1 - t)^2 to 0 at epoch 37."""
    scheduler = LargeBatchLR(optimizer(10.5), 8, 37, warmup="gradual", warmup_epochs=2,
                             decay="poly", power=2)
    values = lrs(scheduler, 37 * 8 + 1)
    assert values[0] == 0.0 and values[8] == pytest.approx(10.5 / 2)
    assert values[16] == pytest.approx(10.5)
    middle = 16 + (37 * 8 - 16) // 2  # t = 0.5
    assert values[middle] == pytest.approx(10.5 * 0.25)
    assert values[-1] == pytest.approx(0.0)  # past the end: the end value


def test_cosine_without_warmup():
    scheduler = LargeBatchLR(optimizer(1.0), 10, 4, warmup="none", decay="cosine")
    values = lrs(scheduler, 41)
    assert values[0] == 1.0
    assert values[20] == pytest.approx(0.5)
    assert values[10] == pytest.approx((1 + math.cos(math.pi / 4)) / 2)
    assert values[40] == pytest.approx(0.0, abs=1e-12)


def test_lr_follows_the_batch_size():
    """Batch-size control: 1024 for 2 epochs, then 2048 (half as many iterations): LR x2."""
    schedule = BatchSizeSchedule({0: 1024, 2: 2048})
    iterations = [schedule.batches(epoch, 10240) for epoch in range(4)]
    assert iterations == [10, 10, 5, 5]
    scheduler = LargeBatchLR(optimizer(0.4), iterations, 4, warmup="none", decay="none",
                             batch_size_schedule=schedule)
    values = lrs(scheduler, 30)
    assert values[:20] == [pytest.approx(0.4)] * 20
    assert values[20:] == [pytest.approx(0.8)] * 10


def test_resume_from_state_dict():
    def make():
        opt = optimizer(3.2)
        return LargeBatchLR(opt, 10, 90, warmup_epochs=5, warmup_start_factor=1 / 32)

    straight = make()
    expected = lrs(straight, 60)
    first = make()
    lrs(first, 37)
    state = first.state_dict()
    resumed = make()
    resumed.optimizer.load_state_dict(first.optimizer.state_dict())
    resumed.load_state_dict(state)
    assert lrs(resumed, 23) == pytest.approx(expected[37:])
    # The state is the progress only: a scheduler built for another schedule keeps its own.
    assert set(state) == {"last_epoch", "_step_count", "_last_lr"}
    longer = LargeBatchLR(optimizer(3.2), 10, 180, warmup_epochs=5, warmup_start_factor=1 / 32)
    longer.load_state_dict(state)
    assert longer.epochs == 180 and longer.epoch_starts[-1] == 1800 and longer.last_epoch == 37


def test_boundaries_on_an_iteration_take_effect_at_that_iteration():
    """Goyal's recipe shortened to one epoch of 3 iterations decays at 1/3, 2/3 and 8/9 of it:
    at iterations 1, 2 and 3 (the end), the first whose elapsed epochs reach each milestone.
    In floats 30 * (1 / 90) is a hair above 1/3, and 1 + 2/3 below 5/3, which put decays
    one iteration late (and dropped the second one here); the same for the end of a warmup."""
    recipe = bb.recipes.goyal2017.shortened(1)
    scheduler = LargeBatchLR(optimizer(1.0), 3, 1, warmup="none", milestones=recipe.milestones)
    assert lrs(scheduler, 4) == pytest.approx([1.0, 0.1, 0.01, 0.001])
    scheduler = LargeBatchLR(optimizer(1.0), 3, 2, warmup="none", milestones=(5 / 3,))
    assert lrs(scheduler, 6) == pytest.approx([1.0] * 5 + [0.1])
    scheduler = LargeBatchLR(optimizer(1.0), 9, 2, warmup="constant", warmup_epochs=2 / 9 * 3,
                             warmup_start_factor=0.5, decay="none")
    assert lrs(scheduler, 8) == pytest.approx([0.5] * 6 + [1.0] * 2)


def test_a_batch_growth_after_the_last_epoch_takes_one_int_per_epoch():
    """A growth step past `epochs` changes no epoch's batch: one int of iterations is enough
    (it was refused as a changing batch size), and the LR is the constant batch's."""
    grown_late = LargeBatchLR(optimizer(1.0), 10, 5, warmup="none", decay="none",
                              batch_size_schedule={0: 32, 30: 64})
    assert grown_late.epoch_starts == [0, 10, 20, 30, 40, 50]
    rates = []
    for _ in range(50):
        rates.append(grown_late.get_last_lr()[0])
        grown_late.optimizer.step()
        grown_late.step()
    assert rates == [1.0] * 50


def test_bad_arguments():
    for epochs in (0, -3, 2.5):
        with pytest.raises(ValueError, match="epochs must be a positive int"):
            LargeBatchLR(optimizer(1.0), 10, epochs)
    for name in ("warmup_start_factor", "gamma", "power"):
        with pytest.raises(ValueError, match=f"{name} must be non-negative"):
            LargeBatchLR(optimizer(1.0), 10, 5, **{name: -1.0})
    with pytest.raises(ValueError, match="milestones must be non-negative"):
        LargeBatchLR(optimizer(1.0), 10, 5, milestones=(-1,))
    with pytest.raises(ValueError, match="one int per epoch when the batch size changes"):
        LargeBatchLR(optimizer(1.0), 10, 5, batch_size_schedule=BatchSizeSchedule({0: 8, 2: 16}))
    with pytest.raises(ValueError, match="warmup must be one of"):
        LargeBatchLR(optimizer(1.0), 10, 5, warmup="linear")
    with pytest.raises(ValueError, match="decay must be one of"):
        LargeBatchLR(optimizer(1.0), 10, 5, decay="exp")
    # True ran as 1 an epoch, 1.5 was taken; a float or a tensor raised TypeErrors
    # that named nothing ("'float' object is not iterable").
    for iterations in ([10, 10], True, [1.5] * 5, 234.375, torch.tensor(234),
                       torch.tensor([10] * 5)):
        with pytest.raises(ValueError, match="iterations_per_epoch"):
            LargeBatchLR(optimizer(1.0), iterations, 5)
    with pytest.raises(ValueError, match="warmup_start_factor must be in \\[0, 1\\]"):
        LargeBatchLR(optimizer(1.0), 10, 5, warmup_start_factor=5.0)  # warmed down to the peak
    for epoch in (-1, 0.5):  # -1 gave the last epoch's batch size
        with pytest.raises(ValueError, match="epoch must be an int >= 0"):
            BatchSizeSchedule({0: 256, 30: 512})(epoch)
    with pytest.raises(ValueError, match="warmup_epochs"):
        LargeBatchLR(optimizer(1.0), 10, 5, warmup_epochs=6)
    with pytest.raises(ValueError, match="warmup_epochs must be a number, got None"):
        LargeBatchLR(optimizer(1.0), 10, 5, warmup_epochs=None)  # was a bare TypeError
    LargeBatchLR(optimizer(1.0), 10, 5, warmup="none", warmup_epochs=None)  # no warmup: unread
    for schedule in ([64], (64,), 64.0, "64"):  # were AttributeErrors ('list' has no 'sizes')
        with pytest.raises(ValueError, match="batch sizes must be an int or a dict"):
            LargeBatchLR(optimizer(1.0), 10, 5, batch_size_schedule=schedule)
    with pytest.raises(ValueError, match="epoch 0"):
        BatchSizeSchedule({1: 64})
    with pytest.raises(ValueError, match="multiple of the world size"):
        DistributedBatchSampler(100, 10, rank=0, world_size=4)

    with pytest.raises(ValueError, match="constant warmup at warmup_start_factor=0"):
        LargeBatchLR(optimizer(1.0), 10, 5, warmup="constant")  # was LR 0 for 5 epochs
    with pytest.raises(ValueError, match="invalid entry 2: True"):
        BatchSizeSchedule({0: 32, 2: True})  # was a batch of 1
    for rank, world_size, dataset_size in ((0.5, 2, 100), (0, 2.0, 100), (0, 2, -1)):
        with pytest.raises(ValueError, match="must be an int"):
            DistributedBatchSampler(dataset_size, 10, rank=rank, world_size=world_size)
    for seed in (None, 1.5, "7", -1, 2**32):  # 2**32 repeated seed 0 (torch keeps 32 bits)
        with pytest.raises(ValueError, match=r"seed must be an int in \[0, 2\*\*32\)"):
            DistributedBatchSampler(50, 10, rank=0, world_size=2, seed=seed)
    # what operator.index takes (a 0-d integer tensor, numpy's integers) counts as its int
    indexed = DistributedBatchSampler(50, 10, rank=0, world_size=2, seed=torch.tensor(7))
    assert indexed.seed == 7 and type(indexed.seed) is int
    assert list(indexed) == list(DistributedBatchSampler(50, 10, 0, 2, seed=7))
    sampler = DistributedBatchSampler(50, 10, rank=0, world_size=2)
    for epoch, first_batch in ((0, -1), (-1, 0), (0, 1.5)):
        with pytest.raises(ValueError, match="must be an int >= 0"):
            sampler.set_epoch(epoch, first_batch)  # (0, -1) yielded an empty first batch


def test_milestones_and_a_batch_size_schedule_in_any_form():
    scheduler = LargeBatchLR(optimizer(1.0), 1, 5, warmup="none",
                             milestones=(m for m in (2, 4)))  # a generator: was used up, no decay
    assert lrs(scheduler, 5) == pytest.approx([1.0, 1.0, 0.1, 0.1, 0.01])
    scheduler = LargeBatchLR(optimizer(1.0), [4, 4, 2], 3, warmup="none", decay="none",
                             batch_size_schedule={0: 64, 2: 128})  # a dict, as the sampler takes
    assert lrs(scheduler, 10) == pytest.approx([1.0] * 8 + [2.0] * 2)


def epoch_batches(dataset_size, schedule, world_size, epoch, seed=0, drop_last=True):
    """Every rank's batches of one epoch."""
    per_rank = []
    for rank in range(world_size):
        sampler = DistributedBatchSampler(dataset_size, schedule, rank, world_size, seed, drop_last)
        sampler.set_epoch(epoch)
        per_rank.append(list(sampler))
        assert len(per_rank[-1]) == len(sampler)
    return per_rank


@pytest.mark.parametrize("drop_last", [False, True])
def test_sampler_covers_every_sample_once(drop_last):
    schedule = BatchSizeSchedule({0: 8, 1: 12})
    for epoch in (0, 1):
        per_rank = epoch_batches(103, schedule, 4, epoch, drop_last=drop_last)
        seen = [i for batches in per_rank for batch in batches for i in batch]
        global_batch = schedule(epoch)
        if drop_last:
            assert len(seen) == len(set(seen)) == 103 // global_batch * global_batch
            assert all(len(b) == global_batch // 4 for batches in per_rank for b in batches)
        else:  # the last batch (7 samples) padded to 8 with the epoch's first sample
            assert sorted(set(seen)) == list(range(103)) and len(seen) == 104
            assert seen.count(per_rank[0][0][0]) == 2
        # The ranks' parts of a step are equal and form one global batch of the shuffled order.
        for step in zip(*per_rank):
            assert len({len(part) for part in step}) == 1
            assert sum(len(part) for part in step) <= global_batch


def test_sampler_gives_every_rank_a_share_of_a_last_batch_smaller_than_the_ranks():
    """10 samples in batches of 8 over 4 ranks: the last 2 padded to 4, one per rank, as torch's
    DistributedSampler pads, instead of empty batches that fail on two ranks only."""
    per_rank = epoch_batches(10, 8, 4, epoch=0, drop_last=False)
    assert [len(batches[-1]) for batches in per_rank] == [1, 1, 1, 1]
    first_two = per_rank[0][0]  # rank 0's part of the first batch: the permutation's first two
    assert sorted(b[-1][0] for b in per_rank[2:]) == sorted(first_two)


def test_sampler_shuffles_once_per_epoch_with_a_shared_seed():
    a = epoch_batches(64, 16, 2, epoch=3, seed=7)
    assert a == epoch_batches(64, 16, 2, epoch=3, seed=7)  # every rank computes the same order
    assert a != epoch_batches(64, 16, 2, epoch=4, seed=7)
    assert a != epoch_batches(64, 16, 2, epoch=3, seed=8)


def test_exported_from_the_package():
    assert bb.schedules.LargeBatchLR is LargeBatchLR


def test_sampler_starts_an_epoch_at_a_later_batch():
    whole = epoch_batches(96, 16, 2, epoch=1)
    sampler = DistributedBatchSampler(96, 16, rank=1, world_size=2)
    sampler.set_epoch(1, first_batch=4)
    assert len(sampler) == 2 and list(sampler) == whole[1][4:]
