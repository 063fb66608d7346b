"""The benchmarks' own arithmetic, where a slip would print a wrong ratio: bench_ddp's steady
rate from the job's progress lines, bench_optimizer's choice of baseline, and the turns; and
what the emulated cluster takes from the driver (its rates, its environment)."""

import argparse
import os
import sys
import time

import pytest
import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                                "benchmarks"))
import bench_ddp  # noqa: E402
import common  # noqa: E402
import bench_optimizer  # noqa: E402
import emulated_cluster  # noqa: E402


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


def test_a_rate_is_one_tc_takes():
    """tc rounds a rate below 8 bit/s to 0 (and refuses it when the cluster is built), and its
    32-bit queue limit overflows above about 680 Gbit/s: both refused when parsed."""
    assert emulated_cluster.parse_rate(" 1Gbit ") == 1e9
    assert emulated_cluster.parse_rate("8bit") == 8
    for rate in ("4bit", "0kbit", "600gbit", "1 gbit", "1gbps", ""):
        with pytest.raises(ValueError, match="rate"):
            emulated_cluster.parse_rate(rate)


def test_a_node_inherits_no_launcher_variables(monkeypatch):
    """torchrun reads PET_<OPTION> for an option not given (PET_STANDALONE broke the
    rendezvous); the others are a launcher's, or name the host's interfaces."""
    dropped = ["PET_STANDALONE", "PET_NNODES", "TORCHELASTIC_RUN_ID", "MASTER_ADDR",
               "MASTER_PORT", "RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE",
               "GROUP_RANK", "ROLE_RANK", "ROLE_NAME", "GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME"]
    kept = ["TORCH_BIGBATCH_TORUS_ALGORITHM", "PYTHONPATH", "NCCL_DEBUG", "GLOO_DEVICE_TRANSPORT"]
    for name in dropped + kept:
        monkeypatch.setenv(name, "x")
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    env = emulated_cluster.node_environment(PYTHONPATH="mine")
    assert not set(dropped) & set(env)
    assert [env[name] for name in kept] == ["x", "mine", "x", "x"]
    assert env["OMP_NUM_THREADS"] == "1" and env["PATH"] == os.environ["PATH"]
    monkeypatch.setenv("OMP_NUM_THREADS", "3")
    assert emulated_cluster.node_environment()["OMP_NUM_THREADS"] == "3"


def test_the_run_exits_with_the_first_node_that_failed_by_itself():
    """A node's own failure (its code) before one the run ended (a signal): the largest
    absolute code was a killed bystander's 9."""
    assert emulated_cluster.exit_code([0, 0]) == 0
    assert emulated_cluster.exit_code([-9, 1, 2]) == 1
    assert emulated_cluster.exit_code([0, -15, -9]) == 15


def test_a_cluster_folder_without_an_owner_is_stale_after_a_minute(tmp_path):
    """A run killed between making its folder and writing its owner left a folder no later run
    removed; one being made right now is left alone."""
    assert not emulated_cluster.owner_died(str(tmp_path))
    old = time.time() - emulated_cluster.OWNERLESS_SECONDS - 5
    os.utime(tmp_path, (old, old))
    assert emulated_cluster.owner_died(str(tmp_path))
    (tmp_path / "owner").write_text("not json")  # not this module's: left alone
    os.utime(tmp_path, (old, old))
    assert not emulated_cluster.owner_died(str(tmp_path))


def test_a_rate_on_one_node_is_refused():
    """One node's ranks talk over its loopback: "1gbit" would have measured unlimited links."""
    parser = argparse.ArgumentParser()
    emulated_cluster.refuse_a_rate_on_one_node(parser, 2, ["1gbit"])
    emulated_cluster.refuse_a_rate_on_one_node(parser, 1, ["none"])
    with pytest.raises(SystemExit):
        emulated_cluster.refuse_a_rate_on_one_node(parser, 1, ["none", "1gbit"])
