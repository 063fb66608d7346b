"""benchmarks/reproduce_goyal.py: its premise (one process stands for k workers), its four LR
schedules, and a small run that resumes to the same numbers as a straight one."""

import csv
import importlib.util
import json
import os
import pathlib
import subprocess
import sys

import pytest
import torch

import torch_bigbatch as bb
from conftest import process_environment

ROOT = pathlib.Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "benchmarks" / "reproduce_goyal.py"
sys.path.insert(0, str(SCRIPT.parent))  # the script imports benchmarks/common.py
spec = importlib.util.spec_from_file_location("reproduce_goyal", SCRIPT)
reproduce_goyal = importlib.util.module_from_spec(spec)
spec.loader.exec_module(reproduce_goyal)


def gradients(model):
    return [p.grad.clone() for p in model.parameters()]


def test_one_process_stands_for_k_workers():
    """The mean loss over kn samples with BatchNorm groups of n gives the average of k
    workers' gradients, each worker normalizing its own n samples (what DDP averages)."""
    torch.manual_seed(0)
    images, labels = torch.randn(96, 1, 28, 28), torch.randint(0, 10, (96,))
    grouped = bb.models.resnet_small(bn_group_size=32)
    torch.nn.functional.cross_entropy(grouped(images), labels).backward()
    worker = bb.models.resnet_small(bn_group_size=0)  # plain nn.BatchNorm2d: one worker
    worker.load_state_dict(grouped.state_dict())
    total = [torch.zeros_like(p) for p in worker.parameters()]
    for x, y in zip(images.split(32), labels.split(32)):
        worker.zero_grad()
        torch.nn.functional.cross_entropy(worker(x), y).backward()
        total = [t + g / 3 for t, g in zip(total, gradients(worker))]
    for mine, expected in zip(gradients(grouped), total):
        torch.testing.assert_close(mine, expected, rtol=1e-4, atol=1e-6)


def lrs(variant, k, iterations=10, epochs=5):
    """The LR of every iteration of the variant's schedule."""
    recipe = reproduce_goyal.variant_recipe(variant, k, epochs)
    optimizer = recipe.build_optimizer(torch.nn.Linear(2, 2), world_size=k)
    scheduler = recipe.build_scheduler(optimizer, iterations, world_size=k)
    rates = []
    for _ in range(iterations * epochs):
        rates.append(optimizer.param_groups[0]["lr"])
        optimizer.step()
        scheduler.step()
    return rates


def test_variant_schedules():
    """k = 8, 5 epochs of 10 iterations: goyal2017 shortened warms up for 5/18 of an epoch
    (2.78 iterations) and divides by 10 at epochs 5/3, 10/3 and 40/9."""
    eta = 0.1 * 32 / 256  # the LR of batch n = 32

    def decay(i):  # Goyal's steps, in iterations
        return 0.1 ** sum(i >= m for m in (50 / 3, 100 / 3, 400 / 9))

    gradual = [eta + (8 * eta - eta) * i / (50 / 18) if i < 50 / 18 else 8 * eta * decay(i)
               for i in range(50)]
    no_warmup = [8 * eta * decay(i) for i in range(50)]
    constant = [eta if i < 50 / 18 else 8 * eta * decay(i) for i in range(50)]
    no_scaling = [eta * decay(i) for i in range(50)]
    for variant, expected in (("gradual", gradual), ("no-warmup", no_warmup),
                              ("constant", constant), ("no-scaling", no_scaling)):
        assert lrs(variant, 8) == pytest.approx(expected), variant
    for variant in reproduce_goyal.VARIANTS:  # at k = 1 the variants are one run
        assert lrs(variant, 1) == pytest.approx([eta * decay(i) for i in range(50)])
    with pytest.raises(ValueError, match="unknown variant"):
        reproduce_goyal.variant_recipe("linear", 2, 5)


def test_runs_start_from_the_recipes_initialization():
    """goyal2017's fc from N(0, 0.01) with a zero bias (it kept torch's default init), zero-gamma
    in each block's last BatchNorm, the same weights in every run of a seed."""
    recipe = reproduce_goyal.variant_recipe("gradual", 4, 5)
    model = reproduce_goyal.initial_model(recipe, seed=0)
    assert recipe.fc_init_std == 0.01
    assert abs(model.fc.weight.std().item() - 0.01) < 0.002
    assert torch.count_nonzero(model.fc.bias) == 0
    last_norms = [block.bn2 for block in model.modules() if hasattr(block, "bn2")]
    assert last_norms and all(torch.count_nonzero(norm.weight) == 0 for norm in last_norms)
    again = reproduce_goyal.initial_model(reproduce_goyal.variant_recipe("no-scaling", 4, 5), 0)
    for mine, other in zip(model.state_dict().values(), again.state_dict().values()):
        assert torch.equal(mine, other)


def run(output, *extra):
    command = [sys.executable, str(SCRIPT), "--ks", "1", "2", "--variants", "gradual",
               "no-scaling", "--epochs", "2", "--train-size", "256", "--test-size", "500",
               "--points", "2",
               "--jobs", "1", "--output", str(output), *extra]
    return subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=300,
                          env=process_environment())


def read(path):
    with open(path, newline="") as file:
        return list(csv.DictReader(file))


@pytest.mark.slow
def test_small_run_resumes_to_the_same_numbers(tmp_path):
    straight = run(tmp_path / "straight", "--stop-after-epochs", "0")  # 0: no limit
    assert straight.returncode == 0, straight.stderr
    first = run(tmp_path / "resumed", "--stop-after-epochs", "1")
    assert first.returncode == 0, first.stderr
    assert "stopped early" in first.stdout
    assert not (tmp_path / "resumed" / "reproduce_goyal.csv").exists()
    assert sorted(os.listdir(tmp_path / "resumed" / "state")) == [
        "gradual-k2.pt", "k1.pt", "no-scaling-k2.pt", "settings.json"]
    second = run(tmp_path / "resumed")
    assert second.returncode == 0, second.stderr

    rows = read(tmp_path / "straight" / "reproduce_goyal.csv")
    assert [(row["variant"], row["k"], row["batch"]) for row in rows] == [
        ("gradual", "1", "32"), ("gradual", "2", "64"),
        ("no-scaling", "1", "32"), ("no-scaling", "2", "64")]
    assert rows[0]["test_error"] == rows[2]["test_error"]  # one run at k = 1
    assert float(rows[1]["peak_lr"]) == pytest.approx(0.025)
    assert float(rows[3]["peak_lr"]) == pytest.approx(0.0125)
    assert [row["iterations"] for row in rows] == ["16", "8", "16", "8"]
    for row in rows:
        assert 0 < float(row["test_error"]) < 0.9 and float(row["train_loss"]) > 0
    resumed = read(tmp_path / "resumed" / "reproduce_goyal.csv")
    measured = ("train_loss", "test_error")  # bit for bit, not the wall time
    assert [{key: row[key] for key in measured} for row in resumed] == \
        [{key: row[key] for key in measured} for row in rows]
    assert read(tmp_path / "resumed" / "curves.csv") == read(tmp_path / "straight" / "curves.csv")
    assert len(read(tmp_path / "straight" / "curves.csv")) == 4 * 2 * 2  # runs x epochs x points
    for figure in ("fig1_error_vs_batch.png", "fig2_warmup.png", "fig3_batch_sizes.png"):
        assert (tmp_path / "straight" / figure).stat().st_size > 0

    # Done runs are not trained again; other settings in the same folder are refused.
    with open(tmp_path / "straight" / "state" / "k1.json") as file:
        before = json.load(file)
    again = run(tmp_path / "straight")
    assert again.returncode == 0 and "test error" not in again.stdout.split("wall time")[0]
    with open(tmp_path / "straight" / "state" / "k1.json") as file:
        assert json.load(file) == before
    other = run(tmp_path / "straight", "--seed", "1")
    assert other.returncode != 0 and "other settings" in other.stderr


def test_bad_arguments(tmp_path):
    result = run(tmp_path, "--train-size", "32")
    assert result.returncode != 0 and "--train-size" in result.stderr
    result = run(tmp_path, "--stop-after-epochs", "-1")  # stopped every run before it began
    assert result.returncode != 0 and "--stop-after-epochs must be 0" in result.stderr
