"""Parts of examples/train_resnet50.py, in this process: where a run starts and stops (RunSpan),
and the one data loader of in-memory tensors and of datasets of single samples; in real
processes, that every rank starts at the same point."""

import datetime
import errno
import os
import stat
from types import SimpleNamespace

import numpy
import pytest
import torch
import torch.distributed as dist
from multiprocess import run_ranks
from train_job import import_script

from torch_bigbatch.schedules import DistributedBatchSampler

train = import_script()
CPU = SimpleNamespace(device=torch.device("cpu"))


def test_a_run_starts_where_its_checkpoint_stopped():
    fresh = train.RunSpan([4, 4, 4])
    assert list(fresh.epochs()) == [0, 1, 2] and fresh.first_step(0) == 0
    mid_epoch = train.RunSpan([4, 4, 4], epoch=1, step=3)
    assert list(mid_epoch.epochs()) == [1, 2]
    assert (mid_epoch.first_step(1), mid_epoch.first_step(2)) == (3, 0)
    epoch_end = train.RunSpan([4, 4, 4], epoch=0, step=4)  # the next epoch's start
    assert list(epoch_end.epochs()) == [1, 2] and epoch_end.first_step(1) == 0
    assert not epoch_end.finished and train.RunSpan([4, 4, 4], epoch=2, step=4).finished
    assert not any(epoch_end.evaluation_only(epoch) for epoch in epoch_end.epochs())
    # An epoch trained but not evaluated (stopped in its evaluation): the run starts with it.
    unevaluated = train.RunSpan([4, 4, 4], epoch=2, step=4, evaluated=False)
    assert list(unevaluated.epochs()) == [2] and unevaluated.evaluation_only(2)
    assert not unevaluated.finished


def start_at(rank, world_size, port, starts, data=((100, 20, 7), (100, 20, 7))):
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world_size, timeout=datetime.timedelta(seconds=60))
    try:
        train.check_same_start(starts[rank], data[rank], torch.device("cpu"))
        return None
    except RuntimeError as error:
        return str(error)


def evaluate_share(rank, world_size, port, images, labels, label_smoothing):
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world_size, timeout=datetime.timedelta(seconds=60))
    torch.manual_seed(0)
    model = torch.nn.Linear(images.shape[1], 3)
    share = [(images[i:i + 2], labels[i:i + 2]) for i in range(rank * 2, len(images), 4)]
    return train.evaluate(model, share, torch.device("cpu"), label_smoothing)


def test_the_test_loss_is_the_training_loss_over_every_rank_share():
    """Two ranks' shares give the mean loss of the whole set, with the training's label
    smoothing (torchvision's recipe evaluates so; the job plotted a smoothed training loss
    beside an unsmoothed test loss as one quantity), and the accuracy of the whole set."""
    generator = torch.Generator().manual_seed(1)
    images, labels = torch.randn(10, 5, generator=generator), torch.arange(10) % 3
    torch.manual_seed(0)
    logits = torch.nn.Linear(5, 3)(images)
    for label_smoothing in (0.0, 0.1):
        results = run_ranks(evaluate_share, 2, images, labels, label_smoothing, deadline=60)
        expected = torch.nn.functional.cross_entropy(logits, labels,
                                                     label_smoothing=label_smoothing).item()
        accuracy = (logits.argmax(1) == labels).double().mean().item()
        for loss, ranks_accuracy in results:
            assert loss == pytest.approx(expected, rel=1e-6)
            assert ranks_accuracy == pytest.approx(accuracy, rel=1e-12)


@pytest.mark.slow
def test_ranks_that_would_start_at_different_points_all_stop():
    """Each rank reads the checkpoint in its --output: one that is not shared by every node
    lets ranks resume from different steps (they then hang or diverge)."""
    assert run_ranks(start_at, 2, [(1, 5), (1, 5)], deadline=60) == [None, None]
    # Each pair apart is a real start: (0, 7) to (1, 5), not (0, 5) to (1, 7).
    for message in run_ranks(start_at, 2, [(1, 5), (0, 7)], deadline=60):
        assert message == ("the ranks start at different points, from epoch 1 step 7 to epoch "
                           "2 step 5: each rank resumes from the checkpoint in its own "
                           "--output; put --output on storage every node shares"), message


@pytest.mark.slow
def test_ranks_that_read_different_data_all_stop():
    """Each rank reads its node's copy of the data: one missing a file shuffled another order
    and scored overlapping test shares (a wrong result), or took other step counts (a hang);
    one with other file names trained on other images under the same labels."""
    same = [(1, 5), (1, 5)]
    cases = {((100, 20, 7), (99, 20, 7)): "from 99 to 100 training images",
             ((100, 20, 7), (100, 21, 7)): "from 20 to 21 test images",
             ((100, 20, 7), (100, 20, 8)): "the same number of images, but other file names"}
    for data, wanted in cases.items():
        for message in run_ranks(start_at, 2, same, data, deadline=60):
            assert message is not None and wanted in message, message
            assert "the ranks read different data" in message, message


def test_the_image_files_digest_follows_names_and_labels(tmp_path):
    """0 for in-memory data; for folders, a digest of the names (not where the folder is)
    and the labels, in order."""
    def folder(root, samples):
        return SimpleNamespace(root=str(tmp_path / root), samples=[
            (str(tmp_path / root / name), label) for name, label in samples])

    def digest(root, samples, val=(("a/9.jpg", 0),)):
        return train.image_files_digest(folder(root, samples), folder(f"{root}-val", val))
    images = [("a/1.jpg", 0), ("b/2.jpg", 1)]
    assert digest("x", images) == digest("elsewhere", images)
    for other in ([("a/1.jpg", 0), ("b/3.jpg", 1)], [("a/1.jpg", 1), ("b/2.jpg", 1)],
                  images[::-1], images[:1]):
        assert digest("x", other) != digest("x", images), other
    assert digest("x", images, val=[("a/8.jpg", 0)]) != digest("x", images)
    wrapped = SimpleNamespace(dataset=folder("x", images))  # as SeededSamples wraps train/
    assert train.image_files_digest(wrapped, folder("x-val", [("a/9.jpg", 0)])) == \
        digest("x", images)
    in_memory = train.TensorBatches(torch.zeros(2, 1), torch.zeros(2, dtype=torch.long))
    assert train.image_files_digest(in_memory, in_memory) == 0


def test_a_checkpoint_is_saved_where_the_folder_cannot_be_synced(tmp_path, monkeypatch):
    """Some file systems refuse fsync on a folder (EINVAL): the checkpoint is whole all the
    same, and training must not end on it."""
    synced = os.fsync

    def fsync(descriptor):
        if stat.S_ISDIR(os.fstat(descriptor).st_mode):
            raise OSError(errno.EINVAL, "Invalid argument")
        synced(descriptor)

    monkeypatch.setattr(os, "fsync", fsync)
    path = tmp_path / "run" / "checkpoint.pt"
    train.save_checkpoint(str(path), {"step": torch.tensor([3, 4])})
    assert torch.load(path, weights_only=True)["step"].tolist() == [3, 4]
    assert os.listdir(path.parent) == ["checkpoint.pt"]  # no temporary file left


def test_a_run_stops_after_its_steps_or_epochs():
    steps = train.RunSpan([4, 4], stop_after_steps=6)
    assert [steps.stop_after_step() for _ in range(4)] == [False] * 4
    assert not steps.stop_after_epoch()
    assert [steps.stop_after_step() for _ in range(2)] == [False, True]  # mid-epoch 2
    on_last_step = train.RunSpan([4, 4], stop_after_steps=4)
    assert [on_last_step.stop_after_step() for _ in range(4)] == [False] * 3 + [True]
    assert on_last_step.stop_after_epoch()  # after that epoch's evaluation
    epochs = train.RunSpan([4, 4, 4], stop_after_epochs=2)
    assert [epochs.stop_after_epoch() for _ in range(2)] == [False, True]
    endless = train.RunSpan([4, 4])
    assert not any(endless.stop_after_step() for _ in range(8))
    assert not any(endless.stop_after_epoch() for _ in range(2))


def test_the_loader_gives_the_samplers_batches_of_tensors():
    images, labels = torch.randn(40, 1, 4, 4), torch.arange(40)
    sampler = DistributedBatchSampler(40, 8, rank=1, world_size=2, seed=5)
    sampler.set_epoch(3, first_batch=1)
    loader = train.data_loader(train.TensorBatches(images, labels), sampler, CPU,
                               SimpleNamespace(workers=4))
    assert loader.num_workers == 0  # in-memory tensors: read in this process
    expected = [torch.tensor(indices) for indices in sampler]
    batches = list(loader)
    assert len(batches) == len(expected) == 4
    for (x, y), index in zip(batches, expected, strict=True):
        assert torch.equal(x, images[index]) and torch.equal(y, labels[index])


def test_the_same_loader_stacks_a_dataset_of_single_samples():
    images, labels = torch.randn(6, 3, 2, 2), torch.arange(6)

    class Samples(torch.utils.data.Dataset):  # as ImageFolder: one (image, label) at a time
        def __len__(self):
            return 6

        def __getitem__(self, index):
            return images[index], labels[index].item()

    loader = train.data_loader(Samples(), [[4, 1, 2], [0, 5, 3]], CPU, SimpleNamespace(workers=0))
    for (x, y), indices in zip(loader, [[4, 1, 2], [0, 5, 3]], strict=True):
        assert torch.equal(x, images[indices]) and torch.equal(y, labels[indices])


class ReaderPids(torch.utils.data.Dataset):
    """Each sample: the process that read it and that process's parent."""

    def __len__(self):
        return 2

    def __getitem__(self, index):
        return torch.tensor([os.getpid(), os.getppid()])


def test_loader_workers_are_not_forks_of_the_training_process():
    # A fork of a process whose Gloo threads take Python thread states can hang in the child
    # (Python before 3.11.10): the workers come from a forkserver.
    loader = train.data_loader(ReaderPids(), [[0], [1]], CPU, SimpleNamespace(workers=2))
    readers = torch.cat(list(loader)).tolist()
    assert len(readers) == 2 and loader.num_workers == 2
    assert all(reader != os.getpid() and parent != os.getpid() for reader, parent in readers)


def test_loader_workers_per_rank_fit_the_cores(monkeypatch):
    monkeypatch.setattr(train.os, "sched_getaffinity", lambda pid: set(range(16)))
    assert [train.default_workers(ranks) for ranks in (1, 2, 8, 16, 32)] == [16, 8, 2, 1, 1]


def test_seeded_samples_depend_on_seed_epoch_and_index_only(monkeypatch):
    """Each sample's random draws come from (seed, epoch, index): the same in another order,
    another epoch's differ, and the caller's generators are left as they were (the GPUs' were
    reseeded at every sample)."""
    reseeded = []
    monkeypatch.setattr(torch.cuda, "manual_seed_all", reseeded.append)
    class Draws(torch.utils.data.Dataset):
        def __len__(self):
            return 4

        def __getitem__(self, index):
            return torch.rand(3)

    samples = train.bb.data.SeededSamples(Draws(), seed=7)
    torch.manual_seed(0)
    state = torch.get_rng_state()
    forward = [samples[i] for i in range(4)]
    assert torch.equal(torch.get_rng_state(), state)
    backward = [samples[i] for i in reversed(range(4))][::-1]
    assert all(torch.equal(a, b) for a, b in zip(forward, backward))
    assert not torch.equal(forward[0], forward[1])
    samples.set_epoch(1)
    assert not any(torch.equal(samples[i], forward[i]) for i in range(4))
    samples.set_epoch(0)
    for index in (numpy.int64(3), torch.tensor(3)):  # as custom samplers yield them
        assert torch.equal(samples[index], forward[3])  # was an OverflowError
    assert reseeded == [0]  # the test's own torch.manual_seed(0) only


def image_folder(classes, labels):
    """What ImageFolder holds: its sorted class names, their indices, (path, label) samples."""
    return SimpleNamespace(classes=classes, class_to_idx={c: i for i, c in enumerate(classes)},
                           samples=[(f"{classes[label]}/{i}.jpg", label)
                                    for i, label in enumerate(labels)])


def test_validation_is_scored_with_the_training_classes():
    """val/ without class "b" numbers "c" as 1 where training calls it 2: its labels are
    remapped by name; a class that train/ lacks is refused by name."""
    training = image_folder(["a", "b", "c"], [0, 1, 2])
    val = image_folder(["a", "c"], [0, 1, 1])
    train.score_with_training_classes(val, training, "/data")
    assert [label for _, label in val.samples] == val.targets == [0, 2, 2]
    assert val.classes == ["a", "b", "c"] and val.samples[1][0] == "c/1.jpg"
    with pytest.raises(ValueError, match="val/ has 1 classes that train/ lacks \\(d\\)"):
        train.score_with_training_classes(image_folder(["a", "d"], [0, 1]), training, "/data")



def test_the_models_start_as_the_recipe_says():
    """The job's model: the recipe's BatchNorm groups, zero gamma and fc initialization."""
    from torch_bigbatch.recipes import goyal2017, mlperf_lars
    torch.manual_seed(0)
    model = train.build_model("resnet_small", 10, 1, goyal2017)
    assert model.fc.weight.std().item() == pytest.approx(0.01, rel=0.25)
    assert torch.count_nonzero(model.fc.bias) == 0
    assert model.layer1[0].bn2.weight.abs().sum() == 0
    assert model.bn1.group_size == 32
    torch.manual_seed(0)
    model = train.build_model("resnet_small", 10, 1, mlperf_lars)
    assert torch.count_nonzero(model.fc.bias) > 0  # torchvision's uniform initialization
