"""The benchmarks' own arithmetic, where a slip would print a wrong ratio: bench_ddp's steady
rate from the job's progress lines, bench_optimizer's choice of baseline, and the turns."""

import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                                "benchmarks"))
import bench_ddp  # noqa: E402
import common  # noqa: E402
import bench_optimizer  # noqa: E402


def progress(epoch, step, batch, seconds):
    """The job's progress line at `step` of `epoch`, `seconds` after the epoch began."""
    return (f"epoch {epoch}/5 step {step}/58 loss 0.5 lr 0.1 batch {batch} "
            f"{step * batch / seconds:.1f} img/s ETA 1:00\n")


def test_steady_rate_counts_between_two_lines_of_the_first_epoch():
    # 1000 images/s from step 40 on, after a slow start; the run goes on into epoch 2, whose
    # steps and clock start again (it read epoch 1's step 40 against epoch 2's: a rate of 0)
    output = "".join(progress(1, step, 1024, 10 + (step - 10) * 1.024)
                     for step in range(10, 59, 10))
    output += progress(1, 58, 1024, 10 + 48 * 1.024)
    output += "".join(progress(2, step, 1024, 1.024 * step) for step in range(10, 59, 10))
    assert bench_ddp.steady_rate(output, settled=20) == pytest.approx(1000, rel=1e-4)
    with pytest.raises(RuntimeError, match="fewer than two progress lines in the first epoch"):
        bench_ddp.steady_rate(output, settled=60)


def test_the_job_prints_the_rate_as_the_benchmark_reads_it():
    """A rate of about 55 img/s printed as an integer put 1% into each line, 5% into a
    ratio of two runs: the job prints tenths, the pattern reads them."""
    epoch, step, batch, rate = bench_ddp.PROGRESS.findall(progress(1, 20, 32, 32 * 20 / 54.87))[0]
    assert (epoch, step, batch, rate) == ("1", "20", "32", "54.9")
    with open(os.path.join(bench_ddp.ROOT, "examples", "train_resnet50.py")) as file:
        assert '{rate:.1f} img/s' in file.read()


def test_the_optimizer_baseline_is_the_first_torch_sgd_that_steps_right(monkeypatch):
    shapes = [torch.Size([1000]), torch.Size([8, 3, 3, 3])]
    grads = [torch.randn(shape) for shape in shapes]
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        for name in ("torch foreach", "torch_bigbatch"):
            assert bench_optimizer.steps_right(bench_optimizer.VARIANTS[name], shapes, grads,
                                               "cpu", dtype), (name, dtype)
    assert bench_optimizer.baseline(shapes, grads, "cpu", torch.float32) == "torch fused"
    # a fused step that goes wrong (as torch 2.13's CPU kernel in bfloat16) is no baseline
    monkeypatch.setitem(bench_optimizer.VARIANTS, "torch fused", lambda params: torch.optim.SGD(
        params, fused=True, **{**bench_optimizer.HYPERPARAMETERS, "lr": 0.11}))
    assert bench_optimizer.baseline(shapes, grads, "cpu", torch.float32) == "torch foreach"
    monkeypatch.setitem(bench_optimizer.VARIANTS, "torch foreach",
                        bench_optimizer.VARIANTS["torch fused"])
    with pytest.raises(RuntimeError, match="no torch SGD steps right in torch.float32"):
        bench_optimizer.baseline(shapes, grads, "cpu", torch.float32)


def test_the_variants_take_turns_first_and_last():
    """Every other round runs the variants in reverse: the baseline, first in the dict, ran
    first in every round (a place that can give or cost: a warm cache, a drift in a round)."""
    turns = list(common.taking_turns({"torch": 1, "ours": 2}.items(), 3))
    assert [name for name, _ in turns] == ["torch", "ours", "ours", "torch", "torch", "ours"]
    assert list(common.taking_turns(["gloo", "torus"], 0)) == []
