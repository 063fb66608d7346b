"""The paper presets: their numbers at a world size, and what they build."""

import pytest
import torch
from torch import nn

import torch_bigbatch as bb
from torch_bigbatch.recipes import get_recipe, goyal2017, mikami2018, mlperf_lars


def tiny_model():
    return nn.Sequential(nn.Conv2d(1, 4, 3), nn.BatchNorm2d(4), nn.Flatten(), nn.Linear(4, 2))


def test_goyal2017_at_8k():
    """256 ranks of 32: batch 8192, LR 3.2, warmup from 0.1 over 5 epochs, steps at 30/60/80."""
    assert goyal2017.batch_size_schedule(256)(0) == 8192
    assert goyal2017.peak_lr(256) == pytest.approx(3.2)
    optimizer = goyal2017.build_optimizer(tiny_model(), 256)
    assert isinstance(optimizer, bb.optim.SGD)
    assert [g["weight_decay"] for g in optimizer.param_groups] == [1e-4, 0.0]
    assert optimizer.param_groups[0]["nesterov"] and optimizer.param_groups[0]["momentum"] == 0.9
    scheduler = goyal2017.build_scheduler(optimizer, 10, 256)
    assert scheduler.factor(0) * 3.2 == pytest.approx(0.1)
    assert scheduler.factor(50) == pytest.approx(1.0)
    assert scheduler.factor(300) == pytest.approx(0.1)
    assert goyal2017.criterion().label_smoothing == 0.0


def test_mikami2018_doubles_the_batch_and_the_lr():
    schedule = mikami2018.batch_size_schedule(1088)
    assert (schedule(0), schedule(29), schedule(30)) == (34816, 34816, 69632)
    optimizer = mikami2018.build_optimizer(tiny_model(), 1088)
    iterations = [schedule.batches(epoch, 1_281_167) for epoch in range(90)]
    scheduler = mikami2018.build_scheduler(optimizer, iterations, 1088)
    before, after = sum(iterations[:30]) - 1, sum(iterations[:30])
    ratio = scheduler.factor(after) / scheduler.factor(before)
    assert ratio == pytest.approx(2.0, rel=0.02)  # x2 for the batch, times a little poly decay
    assert mikami2018.criterion().label_smoothing == 0.1


def test_mlperf_lars_fixed_global_batch():
    assert mlperf_lars.batch_size_schedule(8)(0) == 3264
    assert mlperf_lars.peak_lr(8) == pytest.approx(10.5)
    optimizer = mlperf_lars.build_optimizer(tiny_model(), 8)
    assert isinstance(optimizer, bb.optim.LARS)
    scheduler = mlperf_lars.build_scheduler(optimizer, 392, 8)
    assert scheduler.factor(0) == 0.0 and scheduler.factor(2 * 392) == pytest.approx(1.0)
    assert scheduler.factor(37 * 392) == pytest.approx(0.0)
    with pytest.raises(ValueError, match="does not split across 5 ranks"):
        mlperf_lars.batch_size_schedule(5)


def test_shortened_keeps_the_shape_of_the_schedule():
    short = goyal2017.shortened(9)
    assert short.epochs == 9 and short.warmup_epochs == pytest.approx(0.5)
    assert short.milestones == pytest.approx((3, 6, 8))
    assert mikami2018.shortened(9).batch_growth == ((3, 2),)
    # one epoch: the growth would start at epoch 1, which never runs (a job of one epoch
    # checked that 2x the batch split across its data: refused where 1x fit)
    assert mikami2018.shortened(1).batch_growth == ()
    assert mikami2018.shortened(1).batch_size_schedule(2).sizes == [64]


def test_unknown_recipe():
    with pytest.raises(ValueError, match="known recipes: goyal2017, mikami2018, mlperf_lars"):
        get_recipe("nope")


def test_bad_world_size_and_batch_are_named():
    for world_size in (0, -8, 2.0, True):
        with pytest.raises(ValueError, match=f"world_size must be a positive int, got {world_size}"):
            goyal2017.peak_lr(world_size)
    with pytest.raises(ValueError, match="goyal2017: batch_per_rank must be a positive int, got 0"):
        goyal2017.replace(batch_per_rank=0).batch_size_schedule(8)
    with pytest.raises(ValueError, match="set warmup_from_base_lr=True"):
        mlperf_lars.replace(warmup="constant").build_scheduler(
            mlperf_lars.build_optimizer(tiny_model(), 8), 10, 8)


def test_goyal2017_draws_the_fc_weights_from_a_gaussian_of_std_0_01():
    """Section 5.1 of the paper; the other presets keep torchvision's initialization."""
    torch.manual_seed(0)
    model = bb.models.resnet50(num_classes=1000)
    before = model.fc.weight.clone()
    assert mikami2018.init_fc(model) is model and torch.equal(model.fc.weight, before)
    goyal2017.init_fc(model)
    assert model.fc.weight.mean().abs() < 1e-4
    assert model.fc.weight.std().item() == pytest.approx(0.01, rel=0.01)
    assert model.fc.weight.abs().max() > 0.04  # a Gaussian's tail; torchvision's stays < 0.023
    assert torch.count_nonzero(model.fc.bias) == 0
    without_bias = nn.Sequential()
    without_bias.fc = nn.Linear(8, 2, bias=False)
    assert goyal2017.init_fc(without_bias).fc.weight.std() < 0.05
    with pytest.raises(ValueError, match="model.fc, as an nn.Linear; got NoneType"):
        goyal2017.init_fc(tiny_model())


def test_replace_keeps_presets_unchanged():
    changed = goyal2017.replace(batch_per_rank=64)
    assert changed.batch_size_schedule(4)(0) == 256 and goyal2017.batch_per_rank == 32


def test_no_warmup_above_the_peak():
    """Below the base batch the peak LR is under base_lr: the warmup must not start above it."""
    recipe = goyal2017.replace(batch_per_rank=8)  # global batch 16 on 2 ranks: peak 0.00625
    scheduler = recipe.build_scheduler(recipe.build_optimizer(tiny_model(), 2), 10, 2)
    assert max(scheduler.factor(i) for i in range(900)) == pytest.approx(1.0)


def test_zero_base_lr_builds_a_zero_schedule():
    """base_lr = 0 (a frozen run) is allowed by the linear rule: the warmup still starts at
    base_batch / batch of the peak, and every LR is 0."""
    recipe = goyal2017.replace(base_lr=0.0)
    optimizer = recipe.build_optimizer(tiny_model(), 16)  # batch 512: the warmup starts at 1/2
    scheduler = recipe.build_scheduler(optimizer, 10, 16)
    assert scheduler.factor(0) == pytest.approx(0.5)
    assert optimizer.param_groups[0]["lr"] == 0.0
