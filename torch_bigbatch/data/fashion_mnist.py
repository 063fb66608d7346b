"""Fashion-MNIST from the Debian package dataset-fashion-mnist (the IDX files, gzipped, under
/usr/share/datasets/fashion-mnist, or where TORCH_BIGBATCH_FASHION_MNIST points: a copy on a
machine without the package), read with torch: no download, no torchvision."""

import functools
import gzip
import math
import os

import torch

DEFAULT_ROOT = os.environ.get("TORCH_BIGBATCH_FASHION_MNIST", "/usr/share/datasets/fashion-mnist")
FILES = {"train": ("train-images-idx3-ubyte.gz", "train-labels-idx1-ubyte.gz"),
         "test": ("t10k-images-idx3-ubyte.gz", "t10k-labels-idx1-ubyte.gz")}
CLASSES = 10


def missing_files(root=DEFAULT_ROOT):
    """The paths of the four files that `root` lacks (empty when all are there)."""
    names = [name for pair in FILES.values() for name in pair]
    return [os.path.join(root, name) for name in names
            if not os.path.exists(os.path.join(root, name))]


def read_idx(path):
    """An IDX array of unsigned bytes as a uint8 tensor (big-endian header: 0, 0, type 0x08,
    the number of dims; then the sizes as 32-bit integers)."""
    try:
        with gzip.open(path, "rb") as file:
            data = file.read()
    except (OSError, EOFError) as error:  # not gzip, or cut short
        raise ValueError(f"{path} cannot be read: {error}") from error
    if len(data) < 4 or data[:3] != b"\x00\x00\x08":
        raise ValueError(f"{path} is not an IDX file of unsigned bytes")
    dims = data[3]
    sizes = [int.from_bytes(data[4 + 4 * d:8 + 4 * d], "big") for d in range(dims)]
    expected = 4 + 4 * dims + math.prod(sizes)
    if len(data) != expected:
        raise ValueError(f"{path} holds {len(data)} bytes where its header says {expected}: a "
                         "damaged or truncated file")
    return torch.frombuffer(bytearray(data), dtype=torch.uint8, offset=4 + 4 * dims).view(sizes)


@functools.lru_cache(maxsize=4)
def _read_split(split, root):
    """The raw (uint8 images, int64 labels) of a split, decompressed once per process."""
    images_file, labels_file = FILES[split]
    return (read_idx(os.path.join(root, images_file)),
            read_idx(os.path.join(root, labels_file)).long())


@functools.lru_cache(maxsize=4)
def _training_statistics(root):
    """Mean and standard deviation of the training images, in [0, 1] units, from the count of
    each of the 256 pixel values (exact, where float64 copies of the 47 M pixels took 0.75 GB
    in every rank)."""
    counts = torch.bincount(_read_split("train", root)[0].flatten(), minlength=256).double()
    values = torch.arange(256, dtype=torch.float64) / 255
    mean = (counts * values).sum() / counts.sum()
    variance = (counts * (values - mean) ** 2).sum() / counts.sum()
    return mean.item(), variance.sqrt().item()


def load_fashion_mnist(split, root=DEFAULT_ROOT):
    """(images, labels) of "train" (60,000) or "test" (10,000): float32 [N, 1, 28, 28]
    standardized with the training set's mean and standard deviation, and int64 [N]."""
    if split not in FILES:
        raise ValueError(f"split must be 'train' or 'test', got {split!r}")
    missing = missing_files(root)
    if missing:
        raise FileNotFoundError(f"Fashion-MNIST files missing: {', '.join(missing)} (install "
                                "the Debian package dataset-fashion-mnist)")
    mean, std = _training_statistics(root)
    images, labels = _read_split(split, root)
    return images.float().div_(255).sub_(mean).div_(std).unsqueeze(1), labels.clone()
