"""examples/train_resnet50.py under torchrun on small synthetic data: the loss falls, a resumed
run (stopped at an epoch's end or mid-epoch) ends where a straight one does, a restarted worker
resumes by itself, a finished run resumed says so, micro-batches change nothing, and bad
arguments fail with one message."""

import csv
import os
import subprocess
import sys

import pytest
import torch
from conftest import process_environment
from multiprocess import free_port
from train_job import SCRIPT, TINY, run_single, torchrun

pytestmark = pytest.mark.slow  # every test here trains, or starts the script in processes


def metrics(output):
    with open(os.path.join(output, "metrics.csv")) as file:
        return list(csv.DictReader(file))


def test_loss_falls_under_torchrun(tmp_path):
    output = str(tmp_path / "run")
    stdout = torchrun([*TINY, "--epochs", "3", "--synthetic-size", "512", "--output", output])
    rows = metrics(output)
    assert [int(row["epoch"]) for row in rows] == [1, 2, 3]
    losses = [float(row["train_loss"]) for row in rows]
    assert losses[-1] < 0.95 * losses[0], losses
    assert "backend torus (2x1)" in stdout and "finished after epoch 3" in stdout
    assert os.path.exists(os.path.join(output, "metrics.png"))
    # The LR of each epoch's last step: goyal2017 shrunk to 3 epochs steps down at 1 and 2.
    peak = 1.0 * 64 / 256
    assert [float(row["lr"]) for row in rows] == pytest.approx([peak, peak * 0.1, peak * 0.001])


def test_resume_ends_where_a_straight_run_does(tmp_path):
    straight, split = str(tmp_path / "straight"), str(tmp_path / "split")
    torchrun([*TINY, "--epochs", "2", "--output", straight])
    torchrun([*TINY, "--epochs", "2", "--output", split, "--stop-after-epochs", "1"])
    assert [row["epoch"] for row in metrics(split)] == ["1"]
    stdout = torchrun([*TINY, "--epochs", "2", "--output", split, "--resume"])
    assert "resumed at epoch 2 step 0" in stdout
    a = torch.load(os.path.join(straight, "checkpoint.pt"), weights_only=False)
    b = torch.load(os.path.join(split, "checkpoint.pt"), weights_only=False)
    assert a["model"].keys() == b["model"].keys()
    for key in a["model"]:
        assert torch.equal(a["model"][key], b["model"][key]), key
    assert a["optimizer"]["state"].keys() == b["optimizer"]["state"].keys()
    for index, state in a["optimizer"]["state"].items():
        assert torch.equal(state["momentum_buffer"], b["optimizer"]["state"][index]["momentum_buffer"])
    assert a["metrics"][-1]["train_loss"] == b["metrics"][-1]["train_loss"]


def test_stop_at_an_epoch_boundary_keeps_its_evaluation(tmp_path):
    """--stop-after-steps on an epoch's last step still evaluates that epoch before stopping."""
    output = str(tmp_path / "run")
    torchrun([*TINY, "--epochs", "2", "--output", output, "--stop-after-steps", "4"])
    assert [row["epoch"] for row in metrics(output)] == ["1"]
    torchrun([*TINY, "--epochs", "2", "--output", output, "--resume"])
    assert [row["epoch"] for row in metrics(output)] == ["1", "2"]


def test_resume_mid_epoch(tmp_path):
    """Stopped after 6 steps (epoch 2 of 4-step epochs, step 2), resumed: the same end. With
    --use-deterministic-algorithms, which every op of the job supports (a CPU run needs none)."""
    straight, split = str(tmp_path / "straight"), str(tmp_path / "split")
    job = [*TINY, "--epochs", "2", "--use-deterministic-algorithms"]
    torchrun([*job, "--output", straight])
    stdout = torchrun([*job, "--output", split, "--stop-after-steps", "6"])
    assert "stopped after 6 steps" in stdout
    stdout = torchrun([*job, "--output", split, "--resume"])
    assert "resumed at epoch 2 step 2" in stdout
    a = torch.load(os.path.join(straight, "checkpoint.pt"), weights_only=False)
    b = torch.load(os.path.join(split, "checkpoint.pt"), weights_only=False)
    for key in a["model"]:
        assert torch.equal(a["model"][key], b["model"][key]), key
    for row, same in zip(a["metrics"], b["metrics"], strict=True):
        assert row["test_loss"] == same["test_loss"] and row["lr"] == same["lr"]
        # The epoch's losses are summed in another order across the stop: equal up to rounding.
        assert row["train_loss"] == pytest.approx(same["train_loss"], rel=1e-12)


def test_bad_arguments_end_with_one_clear_message(tmp_path):
    cases = [
        (["--recipe", "nope"], "invalid choice: 'nope'"),
        (["--dataset", "imagenet"], "needs --data PATH"),
        (["--data", str(tmp_path)], "no train/ directory"),
        ([*TINY, "--data", str(tmp_path)], "--dataset synthetic does not read it"),
        (["--dataset", "fashion-mnist", "--fashion-mnist-root", str(tmp_path)],
         "install the Debian package dataset-fashion-mnist"),
        ([*TINY, "--resume", "--output", str(tmp_path / "none")], "--resume: no checkpoint"),
        ([*TINY, "--recipe", "mlperf_lars"], "--batch-per-rank does not apply"),
        ([*TINY, "--bn-group-size", "0", "--max-local-batch", "31"],
         "leaves a last micro-batch of one sample"),
        ([*TINY, "--print-every", "0"], "argument --print-every: must be a positive integer"),
        ([*TINY, "--output", os.path.join(SCRIPT, "run")], "is a file, not a directory"),
    ]
    for args, message in cases:
        result = run_single(args)
        assert result.returncode == 2 and message in result.stderr, (args, result.stderr)
    # MLPerf's global batch of 3264 does not split across 5 ranks: rank 0 says so at once, the
    # others after a grace (torchrun would have ended them by then), all before a process group
    # exists (one would wait for the 4 missing ranks until the 60 s timeout of run_single).
    args = [arg for arg in TINY if arg not in ("--batch-per-rank", "32")]
    args += ["--recipe", "mlperf_lars"]
    first = run_single(args, rank=0, world_size=5)
    other = run_single(args, rank=3, world_size=5)
    assert first.returncode == other.returncode == 2
    assert "error: the global batch 3264 does not split across 5 ranks" in first.stderr
    assert "error: (rank 3) the global batch 3264 does not split across 5 ranks" in other.stderr


def test_micro_batches_give_the_same_steps(tmp_path):
    """64 per rank in micro-batches of 32 (BN groups of 32 either way): the same gradients,
    so the same parameters (the running statistics move once per micro-batch, so they differ)."""
    whole, micro = str(tmp_path / "whole"), str(tmp_path / "micro")
    args = [*TINY, "--epochs", "1", "--batch-per-rank", "64"]
    torchrun([*args, "--output", whole])
    torchrun([*args, "--output", micro, "--max-local-batch", "32"])
    a = torch.load(os.path.join(whole, "checkpoint.pt"), weights_only=False)["model"]
    b = torch.load(os.path.join(micro, "checkpoint.pt"), weights_only=False)["model"]
    parameters = [key for key in a if not key.endswith(("running_mean", "running_var",
                                                         "num_batches_tracked"))]
    assert len(parameters) > 20
    for key in parameters:
        torch.testing.assert_close(a[key], b[key], rtol=1e-4, atol=1e-5, msg=key)


def test_a_restarted_worker_resumes_by_itself(tmp_path):
    """Under torchrun --max-restarts, a restarted worker sees TORCHELASTIC_RESTART_COUNT > 0
    and resumes from the checkpoint without --resume. (Killing a worker under torchrun here
    also fails with plain Gloo now and then: its static rendezvous reuses the store and the new
    attempt may read a dead peer's address; so the restart is simulated.)"""
    output = str(tmp_path / "run")
    args = [*TINY, "--epochs", "2", "--output", output]
    first = run_single([*args, "--stop-after-epochs", "1"])
    assert first.returncode == 0, first.stderr[-3000:]
    again = run_single(args, restart_count=1)
    assert again.returncode == 0, again.stderr[-3000:]
    assert "resumed at epoch 2 step 0" in again.stdout and "finished after epoch 2" in again.stdout
    fresh = run_single(args)  # not a restart, no --resume: starts over
    assert "resumed" not in fresh.stdout



def test_a_restart_for_a_membership_change_resumes_its_jobs_checkpoint(tmp_path):
    """torchrun restarts a node's workers when another node joins without counting a restart:
    TORCHELASTIC_RESTART_COUNT stays 0, and the job moved its own checkpoint aside and trained
    from step 0. A checkpoint of the same TORCHELASTIC_RUN_ID is now resumed; another job's
    (or one under torchrun's default run id "none") is moved aside as before."""
    output = tmp_path / "run"
    args = [*TINY, "--epochs", "2", "--output", str(output)]
    first = run_single([*args, "--stop-after-steps", "3"], TORCHELASTIC_RUN_ID="job-1")
    assert first.returncode == 0, first.stderr[-3000:]
    again = run_single(args, TORCHELASTIC_RUN_ID="job-1")
    assert again.returncode == 0, again.stderr[-3000:]
    assert "resumed at epoch 1 step 3" in again.stdout and "moved to" not in again.stdout
    for other in ("job-2", "none"):
        new = run_single([*args, "--stop-after-steps", "1"], TORCHELASTIC_RUN_ID=other)
        assert new.returncode == 0, new.stderr[-3000:]
        assert "moved to" in new.stdout and "resumed" not in new.stdout


def test_a_new_run_moves_an_earlier_runs_checkpoint_aside(tmp_path):
    """A run without --resume in an --output that holds a finished run's checkpoint moves it to
    checkpoint.previous.pt: a torchrun restart of the new run, before its first checkpoint,
    found that one instead and ended the job at once ("holds a finished run")."""
    output = tmp_path / "run"
    args = [*TINY, "--epochs", "1", "--output", str(output)]
    assert run_single(args).returncode == 0
    finished = (output / "checkpoint.pt").read_bytes()
    new = run_single([*args, "--stop-after-steps", "1"])
    assert new.returncode == 0, new.stderr[-3000:]
    assert "moved to" in new.stdout and "resumed" not in new.stdout
    assert (output / "checkpoint.previous.pt").read_bytes() == finished
    restarted = run_single(args, restart_count=1)
    assert restarted.returncode == 0, restarted.stderr[-3000:]
    assert "resumed at epoch 1 step 1" in restarted.stdout, restarted.stdout


def test_runs_without_resume_never_replace_a_moved_checkpoint(tmp_path):
    """A second run without --resume replaced checkpoint.previous.pt, the first run's only
    copy; and --resume after such a run said only "no checkpoint"."""
    output = tmp_path / "run"
    args = [*TINY, "--epochs", "2", "--output", str(output)]
    assert run_single([*args, "--stop-after-steps", "3"]).returncode == 0
    first = (output / "checkpoint.pt").read_bytes()
    for _ in range(2):  # --resume forgotten twice, each run stopped after a step
        assert run_single([*args, "--stop-after-steps", "1"]).returncode == 0
    assert (output / "checkpoint.previous.pt").read_bytes() == first
    assert (output / "checkpoint.previous.2.pt").exists()
    os.remove(output / "checkpoint.pt")
    refused = run_single([*args, "--resume"])
    assert refused.returncode == 2
    assert f"moved an earlier one to {output / 'checkpoint.previous.2.pt'}" in refused.stderr


def test_a_second_run_in_a_used_output_is_refused(tmp_path):
    """A run whose --output another run holds (here the lock taken as rank 0 takes it) is
    refused by name: two such runs wrote one checkpoint and failed with a misleading error."""
    import fcntl
    output = tmp_path / "run"
    output.mkdir()
    with open(output / "job.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        lock.write("pid 12345 on somewhere\n")
        lock.flush()
        refused = run_single([*TINY, "--epochs", "1", "--output", str(output)])
    assert refused.returncode == 2
    assert "is in use by another run of this job (pid 12345 on somewhere holds" in refused.stderr
    assert run_single([*TINY, "--epochs", "1", "--output", str(output)]).returncode == 0


FAILING_EVALUATION = """import sys
sys.path.insert(0, {directory!r})
import train_resnet50 as job
def evaluate(*args):
    raise RuntimeError("evaluation failed")
job.evaluate = evaluate
job.main(job.get_args_parser().parse_args({args!r}))
"""


@pytest.mark.parametrize("limit", [["--stop-after-epochs", "1"], []])
def test_an_epoch_whose_evaluation_failed_resumes_with_the_evaluation(tmp_path, limit):
    """The epoch-end checkpoint came after the evaluation: a failure in it (an unreadable
    val/ image) lost the epoch's training, which a resume ran again. Now the epoch is saved
    before its evaluation, a resume evaluates it, and the run ends as a straight one does
    (with no --stop-after-epochs it stopped after that evaluation: 0 epochs trained matched
    the limit 0, "none")."""
    straight, split = str(tmp_path / "straight"), str(tmp_path / "split")
    job = [*TINY, "--epochs", "2", "--use-deterministic-algorithms"]
    assert run_single([*job, "--output", straight]).returncode == 0
    failed = subprocess.run(
        [sys.executable, "-c", FAILING_EVALUATION.format(
            directory=os.path.dirname(SCRIPT), args=[*job, "--output", split])],
        capture_output=True, text=True, timeout=60, env=process_environment())
    assert failed.returncode != 0 and "evaluation failed" in failed.stderr
    state = torch.load(os.path.join(split, "checkpoint.pt"), weights_only=False)
    assert (state["epoch"], state["step"]) == (0, 8) and state["trained"] is not None
    # --stop-after-epochs counts the epochs this run trains: the one it only evaluates is not
    # one of them (counted, it stopped the run after that evaluation, with no training).
    resumed = run_single([*job, "--output", split, "--resume", *limit])
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "resumed at epoch 1 step 8 (trained, not yet evaluated)" in resumed.stdout
    assert "train loss" in resumed.stdout and "finished after epoch 2" in resumed.stdout
    a = torch.load(os.path.join(straight, "checkpoint.pt"), weights_only=False)
    b = torch.load(os.path.join(split, "checkpoint.pt"), weights_only=False)
    for key in a["model"]:
        assert torch.equal(a["model"][key], b["model"][key]), key
    for row, same in zip(a["metrics"], b["metrics"], strict=True):
        for key in ("train_loss", "test_loss", "test_accuracy", "lr", "global_batch"):
            assert row[key] == same[key], key
    assert [row["epoch"] for row in metrics(split)] == ["1", "2"]


def test_one_plain_process_needs_no_port(tmp_path):
    """`python train_resnet50.py` without torchrun keeps its rendezvous in the process: two at
    once both run (a fixed port 29500 made the second fail with EADDRINUSE)."""
    env = process_environment()
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(name, None)
    runs = [subprocess.Popen([sys.executable, SCRIPT, *TINY, "--epochs", "1", "--output",
                              str(tmp_path / f"run{i}")], env=env, stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True) for i in range(2)]
    for run in runs:
        stdout, stderr = run.communicate(timeout=120)
        assert run.returncode == 0, stderr[-3000:]
        assert "finished after epoch 1" in stdout


def test_resuming_a_finished_run(tmp_path):
    """A finished run resumed says so and ends cleanly; resumed on other ranks, it is refused
    by every rank, before any process group (rank 0 alone would wait for rank 1 in one): each
    node's first at once, the others after a grace (they said nothing, and under torchrun a
    node whose first rank was slower to refuse ended without a word). A refusal may hold on one
    node only: rank 1, another node's first, printed nothing, and rank 0 then failed with a
    rendezvous timeout that named no cause."""
    args = [*TINY, "--epochs", "1", "--output", str(tmp_path / "run")]
    assert run_single(args).returncode == 0
    os.remove(tmp_path / "run" / "metrics.csv")  # a stop after the last checkpoint
    again = run_single([*args, "--resume"])
    assert again.returncode == 0, again.stderr[-3000:]
    assert "holds a finished run: nothing to resume" in again.stdout
    assert [row["epoch"] for row in metrics(tmp_path / "run")] == ["1"]  # written again
    first = run_single([*args, "--resume"], rank=0, world_size=2)
    other = run_single([*args, "--resume"], rank=1, world_size=2)
    assert first.returncode == other.returncode == 2
    assert "was written with world size 1; this run has world size 2" in first.stderr
    assert "error: (rank 1) --resume: " in other.stderr  # after the grace; it said nothing
    first_of_its_node = run_single([*args, "--resume"], rank=1, world_size=2, LOCAL_RANK="0")
    assert first_of_its_node.returncode == 2
    assert "error: (rank 1) --resume: " in first_of_its_node.stderr
    assert "this run has world size 2" in first_of_its_node.stderr


def test_a_restart_where_only_rank_0_finds_the_finished_run_stops_every_rank(tmp_path):
    """A torchrun restart on nodes that share no --output: rank 0 finds the finished run, rank 1
    no checkpoint. Rank 0 ended at once and rank 1 waited in the rendezvous for the whole
    --timeout; now both stop at once, naming the cause."""
    finished, empty = str(tmp_path / "finished"), str(tmp_path / "empty")
    args = [*TINY, "--epochs", "1", "--timeout", "60"]
    torchrun([*args, "--output", finished])
    env = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()), "WORLD_SIZE": "2",
           "TORCHELASTIC_RESTART_COUNT": "1"}
    ranks = [subprocess.Popen([sys.executable, SCRIPT, *args, "--output", output],
                              env=process_environment(RANK=str(rank), **env),
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for rank, output in enumerate((finished, empty))]
    try:
        results = [rank.communicate(timeout=45) for rank in ranks]
    finally:
        for rank in ranks:
            rank.kill()
    for rank, (stdout, stderr) in zip(ranks, results):
        assert rank.returncode != 0, stdout
        assert "the ranks start at different points, from epoch 1 step 0 to epoch 2 step 0" \
            in stderr, stderr[-3000:]
