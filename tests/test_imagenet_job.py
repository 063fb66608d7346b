"""The job's ImageNet path on real JPEG files: an ImageFolder tree (train/ and val/, a folder
per class) of Fashion-MNIST images encoded with Pillow, read by torchvision's ImageFolder, its
transforms and DataLoader worker processes, under torchrun with 2 processes over the torus.
Needs torchvision, so it runs in the CUDA-build environment of `make test`."""

import csv
import os

import pytest
import torch
from conftest import CUDA, needs_cuda
from train_job import import_script, run_single, torchrun

import torch_bigbatch as bb

pytestmark = [pytest.mark.cuda_build, pytest.mark.slow]

CLASSES = 10
TRAIN_PER_CLASS, VAL_PER_CLASS = 32, 8
# Small crops keep ResNet-50 quick on a CPU (about 55 images/s here); 2 ranks x 32 images: 5
# steps an epoch.
JOB = ["--dataset", "imagenet", "--batch-per-rank", "32", "--base-lr", "0.05",
       "--train-crop-size", "64", "--val-resize-size", "72", "--val-crop-size", "64",
       "--print-every", "1", "--epochs", "3"]
CPU_JOB = [*JOB, "--cpu"]  # also where a GPU is visible (two ranks would need two)


@pytest.fixture(scope="module")
def image_folder(tmp_path_factory):
    """The first Fashion-MNIST images of each class as 28x28 RGB JPEG files (ImageFolder
    reads every image as RGB), TRAIN_PER_CLASS in train/, VAL_PER_CLASS in val/."""
    from PIL import Image
    root = tmp_path_factory.mktemp("imagefolder")
    fashion_mnist = bb.data.fashion_mnist
    images, labels = (fashion_mnist.read_idx(os.path.join(fashion_mnist.DEFAULT_ROOT, name))
                      for name in fashion_mnist.FILES["train"])
    for label in range(CLASSES):
        chosen = (labels == label).nonzero().flatten()[:TRAIN_PER_CLASS + VAL_PER_CLASS]
        for number, index in enumerate(chosen.tolist()):
            split = "train" if number < TRAIN_PER_CLASS else "val"
            folder = root / split / f"class{label}"
            folder.mkdir(parents=True, exist_ok=True)
            Image.fromarray(images[index].numpy(), mode="L").convert("RGB").save(
                folder / f"{index}.jpeg", quality=90)
    return str(root)


def metrics(output):
    with open(os.path.join(output, "metrics.csv")) as file:
        return list(csv.DictReader(file))


def checkpoint(output):
    return torch.load(os.path.join(output, "checkpoint.pt"), weights_only=False)


def assert_same_end(straight, split):
    """Two runs' checkpoints hold the same weights, momenta and metrics, bit for bit."""
    a, b = checkpoint(straight), checkpoint(split)
    assert a["model"].keys() == b["model"].keys()
    for key in a["model"]:
        assert torch.equal(a["model"][key], b["model"][key]), key
    for index, state in a["optimizer"]["state"].items():
        assert torch.equal(state["momentum_buffer"],
                           b["optimizer"]["state"][index]["momentum_buffer"]), index
    for row, same in zip(a["metrics"], b["metrics"], strict=True):
        assert row["test_loss"] == same["test_loss"]
        assert row["test_accuracy"] == same["test_accuracy"]


def test_a_damaged_image_is_named_and_a_gray_one_read_as_rgb(image_folder, tmp_path):
    """The job's loader: PIL's error for a truncated JPEG names no file (a run stopped at step
    N of epoch E said only "image file is truncated"); a gray or CMYK file reads as RGB, as
    torchvision's loader reads it (the folder above holds RGB files only)."""
    from PIL import Image
    train = import_script()
    folder = os.path.join(image_folder, "train", "class0")
    whole = open(os.path.join(folder, sorted(os.listdir(folder))[0]), "rb").read()
    damaged = tmp_path / "damaged.jpeg"
    damaged.write_bytes(whole[:len(whole) // 2])
    with pytest.raises(OSError, match=f"cannot read the image {damaged}: .+"):  # and PIL's
        train.load_image(str(damaged))
    for mode in ("L", "CMYK"):
        path = tmp_path / f"{mode}.jpeg"
        Image.new(mode, (8, 8)).save(path)
        image = train.load_image(str(path))
        assert image.mode == "RGB" and image.size == (8, 8), mode


def test_the_jpeg_folder_is_what_imagefolder_expects(image_folder):
    from torchvision import datasets
    train = datasets.ImageFolder(os.path.join(image_folder, "train"))
    val = datasets.ImageFolder(os.path.join(image_folder, "val"))
    assert len(train.classes) == CLASSES and len(train) == CLASSES * TRAIN_PER_CLASS
    assert len(val) == CLASSES * VAL_PER_CLASS
    image, _ = train[0]
    assert image.mode == "RGB" and image.size == (28, 28)


def test_imagenet_job_trains_evaluates_and_resumes_bit_for_bit(image_folder, tmp_path):
    straight, split = str(tmp_path / "straight"), str(tmp_path / "split")
    stdout = torchrun([*CPU_JOB, "--data", image_folder, "--output", straight], timeout=600)
    assert "resnet50 on imagenet (320 images), 2 x cpu, backend torus (2x1)" in stdout, stdout
    rows = metrics(straight)
    assert [int(row["epoch"]) for row in rows] == [1, 2, 3]
    # Every step's loss, as rank 0 printed it: it falls from the first steps to the last.
    losses = [float(line.split(" loss ")[1].split()[0]) for line in stdout.splitlines()
              if line.startswith("epoch ") and " step " in line]
    assert len(losses) == 15, stdout
    assert sum(losses[-3:]) / 3 < 0.95 * sum(losses[:3]) / 3, losses
    assert float(rows[-1]["train_loss"]) < float(rows[0]["train_loss"]), rows
    for row in rows:
        assert 0.0 <= float(row["test_accuracy"]) <= 1.0 and float(row["test_loss"]) > 0
    assert "test accuracy" in stdout and "finished after epoch 3" in stdout
    print(f"JPEG run: step losses {losses}; per epoch {rows}")

    # Stopped mid-epoch 2 (step 2 of 5), resumed: the crops, the steps and the end are the same.
    stdout = torchrun([*CPU_JOB, "--data", image_folder, "--output", split, "--stop-after-steps",
                       "7"], timeout=600)
    assert "stopped after 7 steps" in stdout
    stdout = torchrun([*CPU_JOB, "--data", image_folder, "--output", split, "--resume"],
                      timeout=600)
    assert "resumed at epoch 2 step 2" in stdout
    assert_same_end(straight, split)
    # Other crops are another run: refused by name (they were taken), before a process group.
    refused = run_single([*CPU_JOB, "--data", image_folder, "--output", split, "--resume",
                          "--train-crop-size", "48"], world_size=2)
    assert refused.returncode == 2
    assert "written with --train-crop-size 64; this run has --train-crop-size 48" \
        in refused.stderr, refused.stderr


def test_torchvisions_resnet50_in_the_job(image_folder, tmp_path):
    output = str(tmp_path / "run")
    stdout = torchrun([*CPU_JOB, "--data", image_folder, "--output", output, "--model",
                       "torchvision.resnet50", "--epochs", "1", "--workers", "0"], timeout=600)
    assert "torchvision.resnet50 on imagenet" in stdout and "finished after epoch 1" in stdout
    state = checkpoint(output)["model"]
    # Local BatchNorm's buffers and torchvision's names: a state dict of the same keys as ours.
    assert state.keys() == bb.models.resnet50(num_classes=CLASSES).state_dict().keys()


@CUDA
@needs_cuda
def test_imagenet_job_on_one_gpu_trains_and_resumes_bit_for_bit(image_folder, tmp_path):
    """The GPU path: JPEG files through pinned loader batches, channels_last, bf16 autocast, the
    fused CUDA kernels, DDP over the torus; with deterministic kernels a run stopped mid-epoch
    and resumed ends as the straight run does."""
    job = [*JOB, "--data", image_folder, "--workers", "2", "--use-deterministic-algorithms"]
    straight, split = str(tmp_path / "straight"), str(tmp_path / "split")
    stdout = torchrun([*job, "--output", straight], processes=1, timeout=300)
    assert "resnet50 on imagenet (320 images), 1 x cuda, backend torus" in stdout, stdout
    rows = metrics(straight)
    assert [int(row["epoch"]) for row in rows] == [1, 2, 3]
    assert float(rows[-1]["train_loss"]) < float(rows[0]["train_loss"]), rows
    for row in rows:
        assert 0.0 <= float(row["test_accuracy"]) <= 1.0 and float(row["test_loss"]) > 0
    state = checkpoint(straight)
    assert state["model"]["conv1.weight"].dtype == torch.float32  # autocast keeps fp32 weights
    print(f"CUDA JPEG run: per epoch {rows}")

    # 10 steps an epoch: stopped at epoch 2 step 3, resumed.
    stdout = torchrun([*job, "--output", split, "--stop-after-steps", "13"], processes=1,
                      timeout=300)
    assert "stopped after 13 steps" in stdout
    stdout = torchrun([*job, "--output", split, "--resume"], processes=1, timeout=300)
    assert "resumed at epoch 2 step 3" in stdout
    assert_same_end(straight, split)
