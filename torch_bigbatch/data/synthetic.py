"""Synthetic images whose class can be learned: a fixed random template per class plus noise."""

import torch


def synthetic_images(count, classes=10, channels=1, size=28, noise=1.0, seed=0):
    """(images [count, channels, size, size], labels [count]); the same for the same seed."""
    generator = torch.Generator().manual_seed(seed)
    templates = torch.randn(classes, channels, size, size, generator=generator)
    labels = torch.randint(0, classes, (count,), generator=generator)
    images = templates[labels] + noise * torch.randn(count, channels, size, size,
                                                     generator=generator)
    return images, labels
