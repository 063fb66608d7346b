"""Goyal et al.'s linear scaling rule."""


def linear_scaling(base_lr, batch_size, base_batch_size=256):
    """The learning rate for `batch_size`: base_lr * batch_size / base_batch_size
    (eta = 0.1 * kn / 256 for ResNet-50 in Goyal et al. 2017)."""
    if base_lr < 0:
        raise ValueError(f"base_lr must be non-negative, got {base_lr}")
    for name, value in (("batch_size", batch_size), ("base_batch_size", base_batch_size)):
        if value <= 0:
            raise ValueError(f"{name} must be positive, got {value}")
    return base_lr * batch_size / base_batch_size
