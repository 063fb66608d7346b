"""examples/train_resnet50.py refuses bad arguments and data up front, with one message naming
the problem: checked in this process on the script's parser and its Setup, which run before any
process group exists (nothing here trains)."""

import os

import pytest
from train_job import TINY, import_script

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
    (["--seed", "-1"], "argument --seed: must be an integer in [0, 2**63), got -1"),
    (["--seed", str(2**63)], "argument --seed: must be an integer in [0, 2**63)"),
    (["--timeout", "0"], "argument --timeout: must be a positive number of seconds, got 0"),
    (["--timeout", "nan"], "argument --timeout: must be a positive number of seconds, got nan"),
    (["--backend", "mpi"], "argument --backend: invalid choice: 'mpi'"),
])
def test_the_parser_refuses_bad_numbers(args, message, capsys):
    with pytest.raises(SystemExit) as exit:
        parse([*TINY, *args])
    assert exit.value.code == 2
    assert message in capsys.readouterr().err


def test_only_rank_0_prints_a_refusal(monkeypatch, capsys):
    monkeypatch.setenv("RANK", "3")
    with pytest.raises(SystemExit) as exit:
        parse(["--epochs", "0"])
    assert exit.value.code == 2
    assert capsys.readouterr().err == ""


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
