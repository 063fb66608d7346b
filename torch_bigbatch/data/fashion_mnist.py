"""Fashion-MNIST from the Debian package dataset-fashion-mnist (the IDX files, gzipped, under
/usr/share/datasets/fashion-mnist), read with numpy: no download, no torchvision."""

import gzip
import os

import numpy as np
import torch

DEFAULT_ROOT = "/usr/share/datasets/fashion-mnist"
FILES = {"train": ("train-images-idx3-ubyte.gz", "train-labels-idx1-ubyte.gz"),
         "test": ("t10k-images-idx3-ubyte.gz", "t10k-labels-idx1-ubyte.gz")}
CLASSES = 10


def missing_files(root=DEFAULT_ROOT):
    """The paths of the four files that `root` lacks (empty when all are there)."""
    names = [name for pair in FILES.values() for name in pair]
    return [os.path.join(root, name) for name in names
            if not os.path.exists(os.path.join(root, name))]


def read_idx(path):
    """An IDX array (big-endian header: 0, 0, type 0x08 = uint8, number of dims; the sizes)."""
    with gzip.open(path, "rb") as file:
        data = file.read()
    if data[:3] != b"\x00\x00\x08":
        raise ValueError(f"{path} is not an IDX file of unsigned bytes")
    dims = data[3]
    sizes = np.frombuffer(data, dtype=">u4", count=dims, offset=4)
    return np.frombuffer(data, dtype=np.uint8, offset=4 + 4 * dims).reshape(sizes)


def load_fashion_mnist(split, root=DEFAULT_ROOT):
    """(images, labels) of "train" (60,000) or "test" (10,000): float32 [N, 1, 28, 28]
    standardized with the training set's mean and standard deviation, and int64 [N]."""
    if split not in FILES:
        raise ValueError(f"split must be 'train' or 'test', got {split!r}")
    missing = missing_files(root)
    if missing:
        raise FileNotFoundError(f"Fashion-MNIST files missing: {', '.join(missing)} (install "
                                "the Debian package dataset-fashion-mnist)")
    train = read_idx(os.path.join(root, FILES["train"][0]))
    mean, std = train.mean() / 255, train.std() / 255
    images_file, labels_file = FILES[split]
    images = read_idx(os.path.join(root, images_file)) if split != "train" else train
    labels = read_idx(os.path.join(root, labels_file))
    images = torch.from_numpy(images.astype(np.float32) / 255).sub_(mean).div_(std)
    return images.unsqueeze(1), torch.from_numpy(labels.astype(np.int64))
