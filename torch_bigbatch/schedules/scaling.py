"""Goyal et al.'s linear scaling rule."""

import math

from .._checks import is_int


def linear_scaling(base_lr, batch_size, base_batch_size=256):
    """The learning rate for `batch_size`: base_lr * batch_size / base_batch_size
    (eta = 0.1 * kn / 256 for ResNet-50 in Goyal et al. 2017)."""
    if not (0 <= base_lr < math.inf):
        raise ValueError(f"base_lr must be finite and non-negative, got {base_lr}")
    for name, value in (("batch_size", batch_size), ("base_batch_size", base_batch_size)):
        if not (is_int(value) and value > 0):
            raise ValueError(f"{name} must be a positive int, got {value!r}")
    return base_lr * batch_size / base_batch_size
