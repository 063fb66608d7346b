"""In-memory datasets for runs without ImageNet (Fashion-MNIST from Debian's package, synthetic
images), and seeded augmentation for image folders."""

from .fashion_mnist import load_fashion_mnist, missing_files
from .seeded import SeededSamples
from .synthetic import synthetic_images

__all__ = ["SeededSamples", "load_fashion_mnist", "missing_files", "synthetic_images"]
