"""examples/train_resnet50.py refuses bad arguments, data and checkpoints up front, with one
message naming the problem: checked in this process on the script's parser and its Setup, which
run before any process group exists (nothing here trains, except the fixture of real
checkpoints, which runs the script in a process)."""

import os
import re

import pytest
import torch
from train_job import TINY, import_script, run_single

train = import_script()


def parse(args):
    return train.get_args_parser().parse_args(args)


@pytest.mark.parametrize("args, message", [
    (["--epochs", "0"], "argument --epochs: must be a positive integer, got 0"),
    (["--epochs", "-1"], "argument --epochs: must be a positive integer, got -1"),
    (["--epochs", "two"], "argument --epochs: invalid int value: 'two'"),
    (["--batch-per-rank", "0"], "argument --batch-per-rank: must be a positive integer, got 0"),
    (["--batch-per-rank", "-1"], "argument --batch-per-rank: must be a positive integer"),
    (["--base-lr", "-0.1"], "argument --base-lr: must be a finite number >= 0, got -0.1"),
    (["--base-lr", "nan"], "argument --base-lr: must be a finite number >= 0, got nan"),
    (["--base-lr", "inf"], "argument --base-lr: must be a finite number >= 0, got inf"),
    (["--bn-group-size", "1"], "argument --bn-group-size: must be 0 (nn.BatchNorm2d) or at "
                               "least 2 (one sample has no variance), got 1"),
    (["--bn-group-size", "-32"], "argument --bn-group-size: must be 0 (nn.BatchNorm2d)"),
    (["--max-local-batch", "-32"], "argument --max-local-batch: must be 0 (no micro-batches) "
                                   "or at least 2 (BatchNorm needs 2 samples), got -32"),
    (["--max-local-batch", "1"], "argument --max-local-batch: must be 0 (no micro-batches)"),
    (["--checkpoint-every", "-2"], "argument --checkpoint-every: must be 0 or a positive "
                                   "integer, got -2"),
    (["--stop-after-epochs", "-1"], "argument --stop-after-epochs: must be 0 or a positive"),
    (["--stop-after-steps", "-3"], "argument --stop-after-steps: must be 0 or a positive"),
    (["--workers", "-1"], "argument --workers: must be 0 or a positive integer, got -1"),
    (["--print-every", "0"], "argument --print-every: must be a positive integer, got 0"),
    (["--synthetic-size", "0"], "argument --synthetic-size: must be a positive integer, got 0"),
    (["--seed", "-1"], "argument --seed: must be an integer in [0, 2**32), got -1"),
    (["--seed", str(2**32)], "argument --seed: must be an integer in [0, 2**32)"),
    (["--timeout", "0"], "argument --timeout: must be a positive number of seconds, at most "
                         "1e9, got 0"),
    (["--timeout", "nan"], "argument --timeout: must be a positive number of seconds, at most "
                           "1e9, got nan"),
    (["--timeout", "1e300"], "argument --timeout: must be a positive number of seconds, at most "
                             "1e9, got 1e300"),  # an OverflowError once the arguments passed
    (["--output", ""], "argument --output: must name a folder, got "),  # os.makedirs('') failed
    (["--backend", "mpi"], "argument --backend: invalid choice: 'mpi'"),
])
def test_the_parser_refuses_bad_numbers(args, message, capsys):
    with pytest.raises(SystemExit) as exit:
        parse([*TINY, *args])
    assert exit.value.code == 2
    assert message in capsys.readouterr().err


def test_a_rank_other_than_its_nodes_first_refuses_after_a_grace(monkeypatch, capsys):
    """Rank 3 (LOCAL_RANK 1) waits, then says why: it stayed silent, and under torchrun a node
    whose first rank was slower to refuse ended without a word. The first rank of a node says
    it at once."""
    waits = []
    monkeypatch.setattr(train.time, "sleep", waits.append)
    monkeypatch.setenv("RANK", "3")
    monkeypatch.setenv("LOCAL_RANK", "1")
    with pytest.raises(SystemExit) as exit:
        parse(["--epochs", "0"])
    assert exit.value.code == 2 and waits == [train.REFUSAL_GRACE_SECONDS] == [5.0]
    assert "error: (rank 3) argument --epochs: must be a positive integer, got 0" \
        in capsys.readouterr().err
    monkeypatch.setenv("LOCAL_RANK", "0")
    with pytest.raises(SystemExit):
        parse(["--epochs", "0"])
    assert len(waits) == 1 and "error: (rank 3) argument --epochs" in capsys.readouterr().err


def refusal(args, output):
    """Setup's message for these arguments (a test fails if Setup accepts them)."""
    with pytest.raises(ValueError) as error:
        train.Setup(parse([*TINY, "--output", str(output), *args]))
    return str(error.value)


@pytest.mark.parametrize("args, message", [
    (["--batch-per-rank", "1"], "a global batch of 1 on 1 ranks leaves one sample per rank, "
                                "and BatchNorm needs 2 or more"),
    (["--synthetic-size", "16"], "16 training images make no global batch of 32"),
    (["--synthetic-size", "3", "--batch-per-rank", "2", "--bn-group-size", "0"],
     "the test set is empty"),
    (["--cpu", "--backend", "nccl"], "--backend nccl needs CUDA devices"),
    (["--max-local-batch", "48"], "--max-local-batch 48 must be a multiple of the BatchNorm "
                                  "group size 32"),
    (["--bn-group-size", "0", "--max-local-batch", "31"],
     "--max-local-batch 31 leaves a last micro-batch of one sample of the 32 per rank"),
])
def test_setup_refuses_what_cannot_train(args, message, tmp_path):
    assert message in refusal(args, tmp_path / "run")


def test_an_output_that_is_or_is_under_a_file_is_refused(tmp_path):
    file = tmp_path / "file"
    file.write_text("")
    for output in (file, file / "run", file / "run" / "deeper"):
        assert refusal([], output) == f"--output {output}: {file} is a file, not a directory"


def test_setup_accepts_good_arguments(tmp_path):
    setup = train.Setup(parse([*TINY, "--epochs", "2", "--output", str(tmp_path / "a" / "b")]))
    assert setup.iterations == [8, 8] and setup.resumed is None
    assert (setup.span.start_epoch, setup.span.start_step) == (0, 0)
    assert not os.path.exists(tmp_path / "a")  # checked, not created: rank 0 creates it


def write_bytes(path):
    path.write_bytes(bytes(range(256)) * 8)


def write_empty(path):
    path.write_bytes(b"")


def write_a_list(path):
    torch.save([1, 2, 3], path)


def write_a_position_only(path):
    torch.save({"epoch": 0, "step": 3}, path)


@pytest.mark.parametrize("write, message", [
    (write_bytes, "is not a readable checkpoint (UnpicklingError)"),
    (write_empty, "is not a readable checkpoint (EOFError)"),
    (write_a_list, "is not a checkpoint of this job (no valid model, optimizer, scheduler, "
                   "epoch, step, epoch_loss, metrics, settings)"),
    (write_a_position_only, "is not a checkpoint of this job (no valid model, optimizer, "
                            "scheduler, epoch_loss, metrics, settings)"),
])
def test_a_damaged_checkpoint_is_refused_by_name(write, message, tmp_path):
    (tmp_path / "run").mkdir()
    path = tmp_path / "run" / "checkpoint.pt"
    write(path)
    text = refusal(["--resume"], tmp_path / "run")
    assert text.startswith(f"--resume: {path} {message}")
    assert text.endswith("delete it, or give another --output")


@pytest.fixture(scope="module")
def stopped(tmp_path_factory):
    """(arguments, checkpoint path) of a real run on one rank: 2 epochs of 8 steps, stopped after
    3 steps (mid-epoch)."""
    output = tmp_path_factory.mktemp("stopped") / "run"
    args = [*TINY, "--epochs", "2", "--output", str(output)]
    result = run_single([*args, "--stop-after-steps", "3"])
    assert result.returncode == 0, result.stderr[-3000:]
    return args, output / "checkpoint.pt"


@pytest.mark.slow
def test_resume_continues_at_the_checkpoint(stopped):
    """Settings that do not change the schedule may differ (micro-batches, stops, printing)."""
    args, _ = stopped
    setup = train.Setup(parse([*args, "--resume", "--max-local-batch", "32",
                               "--stop-after-steps", "2", "--print-every", "1"]))
    assert (setup.span.start_epoch, setup.span.start_step) == (0, 3)
    assert setup.resumed["settings"] == setup.settings


@pytest.mark.slow
def test_a_checkpoint_from_before_the_later_settings_resumes(stopped, tmp_path):
    """A checkpoint written before the number of classes was recorded lacks it: refused
    ("written with classes None"), an upgraded job could not resume its run."""
    args, path = stopped
    state = torch.load(path, weights_only=True)
    for key in train.LATER_SETTINGS:
        state["settings"].pop(key, None)
    older = tmp_path / "older"
    older.mkdir()
    torch.save(state, older / "checkpoint.pt")
    output = args.index("--output") + 1
    setup = train.Setup(parse([*args[:output], str(older), *args[output + 1:], "--resume"]))
    assert (setup.span.start_epoch, setup.span.start_step) == (0, 3)


@pytest.mark.slow
@pytest.mark.parametrize("changes, world_size, difference", [
    ([], 2, "world size 1; this run has world size 2"),
    (["--batch-per-rank", "64"], 1, "--batch-per-rank 32; this run has --batch-per-rank 64"),
    (["--epochs", "1"], 1, "--epochs 2; this run has --epochs 1"),
    (["--recipe", "mikami2018"], 1, "--recipe goyal2017; this run has --recipe mikami2018"),
    (["--model", "resnet18"], 1, "--model resnet_small; this run has --model resnet18"),
    (["--dataset", "fashion-mnist"], 1, "--dataset synthetic, training images 256; this run "
                                        "has --dataset fashion-mnist, training images 60000"),
    (["--synthetic-size", "512"], 1, "training images 256; this run has training images 512"),
    (["--base-lr", "0.5"], 1, "--base-lr 1.0; this run has --base-lr 0.5"),
    (["--bn-group-size", "16"], 1, "--bn-group-size 32; this run has --bn-group-size 16"),
    (["--seed", "1"], 1, "--seed 0; this run has --seed 1"),
])
def test_resume_refuses_other_settings(stopped, changes, world_size, difference, monkeypatch):
    """A 1-rank checkpoint at step 3 of batch 32 resumed on 2 ranks would retrain samples at
    another LR; a larger batch, fewer epochs or another recipe would not fit its schedule."""
    args, path = stopped
    monkeypatch.setenv("WORLD_SIZE", str(world_size))
    with pytest.raises(ValueError) as error:
        train.Setup(parse([*args, "--resume", *changes]))
    assert str(error.value) == (f"--resume: {path} was written with {difference}. Resume with "
                                "the checkpoint's settings, or give another --output to start "
                                "a new run")


@pytest.mark.slow
def test_resume_refuses_a_position_outside_the_run(stopped, tmp_path):
    args, path = stopped
    state = torch.load(path, weights_only=True)
    state["epoch"] = 5
    (tmp_path / "run").mkdir()
    torch.save(state, tmp_path / "run" / "checkpoint.pt")
    message = re.escape(f"{tmp_path / 'run' / 'checkpoint.pt'} stopped at epoch 5 step 3, "
                        "outside this run's 2 epochs")
    with pytest.raises(ValueError, match=message):
        train.Setup(parse([*args, "--resume", "--output", str(tmp_path / "run")]))
