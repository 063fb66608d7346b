import pytest
import torch

import torch_bigbatch  # noqa: F401  (registers the ops)

CUDA = pytest.mark.cuda
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

# One test body for both devices: CPU always runs, CUDA is marked and skipped without a GPU.
DEVICES = ["cpu", pytest.param("cuda", marks=[CUDA, needs_cuda])]


def assert_relative_close(actual, expected, tolerance, what=""):
    """max |actual - expected| <= tolerance * max |expected| (relative to the tensor's scale)."""
    scale = expected.abs().max().clamp_min(1e-30)
    error = ((actual.double() - expected.double()).abs().max() / scale).item()
    assert error <= tolerance, f"{what}: relative error {error:.3g} > {tolerance:.1g}"
