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


def test_bad_arguments():
    with pytest.raises(ValueError, match="warmup must be one of"):
        LargeBatchLR(optimizer(1.0), 10, 5, warmup="linear")
    with pytest.raises(ValueError, match="decay must be one of"):
        LargeBatchLR(optimizer(1.0), 10, 5, decay="exp")
    with pytest.raises(ValueError, match="iterations_per_epoch"):
        LargeBatchLR(optimizer(1.0), [10, 10], 5)
    with pytest.raises(ValueError, match="warmup_epochs"):
        LargeBatchLR(optimizer(1.0), 10, 5, warmup_epochs=6)
    with pytest.raises(ValueError, match="epoch 0"):
        BatchSizeSchedule({1: 64})
    with pytest.raises(ValueError, match="multiple of the world size"):
        DistributedBatchSampler(100, 10, rank=0, world_size=4)


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
        assert len(seen) == len(set(seen))
        global_batch = schedule(epoch)
        if drop_last:
            assert len(seen) == 103 // global_batch * global_batch
            assert all(len(b) == global_batch // 4 for batches in per_rank for b in batches)
        else:
            assert sorted(seen) == list(range(103))
        # The ranks' parts of a step form one global batch of the shuffled order.
        steps = list(zip(*per_rank))
        assert all(sum(len(part) for part in step) <= global_batch for step in steps)


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
