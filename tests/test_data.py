"""The Fashion-MNIST reader against the Debian package's files (installed by `make test`) and
a hand-made IDX file; the synthetic images."""

import gzip

import pytest
import torch

from torch_bigbatch.data import load_fashion_mnist, missing_files, synthetic_images
from torch_bigbatch.data.fashion_mnist import read_idx


def test_reads_the_debian_package():
    assert missing_files() == []
    train_images, train_labels = load_fashion_mnist("train")
    test_images, test_labels = load_fashion_mnist("test")
    assert train_images.shape == (60000, 1, 28, 28) and test_images.shape == (10000, 1, 28, 28)
    assert train_images.dtype == torch.float32 and train_labels.dtype == torch.int64
    assert torch.equal(test_labels.bincount(), torch.full((10,), 1000))  # 1000 per class
    assert torch.equal(train_labels.bincount(), torch.full((10,), 6000))
    # Standardized by the training set's statistics.
    assert abs(train_images.mean().item()) < 1e-4 and abs(train_images.std().item() - 1) < 1e-4


def test_read_idx(tmp_path):
    array = torch.arange(24, dtype=torch.uint8).reshape(2, 3, 4)
    path = tmp_path / "a.gz"
    header = bytes([0, 0, 8, 3]) + b"".join(n.to_bytes(4, "big") for n in (2, 3, 4))
    with gzip.open(path, "wb") as file:
        file.write(header + bytes(array.flatten().tolist()))
    assert torch.equal(read_idx(path), array)
    with gzip.open(path, "wb") as file:
        file.write(bytes([0, 0, 9, 1]) + bytes(24))
    with pytest.raises(ValueError, match="not an IDX file of unsigned bytes"):
        read_idx(path)
    with gzip.open(path, "wb") as file:  # shorter than the header's first word: an IndexError
        file.write(bytes([0, 0, 8]))
    with pytest.raises(ValueError, match="not an IDX file of unsigned bytes"):
        read_idx(path)
    with gzip.open(path, "wb") as file:  # a short file with a valid header
        file.write(header + bytes(20))
    with pytest.raises(ValueError, match="holds 36 bytes where its header says 40"):
        read_idx(path)
    whole = gzip.compress(header + bytes(24))
    path.write_bytes(whole[:len(whole) // 2])  # a cut gzip stream
    with pytest.raises(ValueError, match="cannot be read"):
        read_idx(path)


def test_missing_files_are_named(tmp_path):
    assert len(missing_files(tmp_path)) == 4
    with pytest.raises(FileNotFoundError, match="dataset-fashion-mnist"):
        load_fashion_mnist("train", root=tmp_path)
    with pytest.raises(ValueError, match="split"):
        load_fashion_mnist("validation")


def test_synthetic_images_are_reproducible():
    a, labels = synthetic_images(100, seed=3)
    b, same = synthetic_images(100, seed=3)
    assert torch.equal(a, b) and torch.equal(labels, same) and a.shape == (100, 1, 28, 28)
    assert not torch.equal(a, synthetic_images(100, seed=4)[0])
