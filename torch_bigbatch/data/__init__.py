"""In-memory datasets for runs without ImageNet: Fashion-MNIST (Debian's package) and
synthetic images."""

from .fashion_mnist import load_fashion_mnist, missing_files
from .synthetic import synthetic_images

__all__ = ["load_fashion_mnist", "missing_files", "synthetic_images"]
