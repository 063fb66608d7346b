import os

import pytest
import torch

import torch_bigbatch  # noqa: F401  (registers the ops)

# Every process a test starts (torchrun's workers, spawned ranks) prints its Python threads'
# stacks if it crashes (SIGABRT, SIGSEGV): CI saw a training job's rank abort once with nothing
# but "terminate called without an active exception".
os.environ.setdefault("PYTHONFAULTHANDLER", "1")

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def process_environment(**variables):
    """The environment of a process a test starts: this checkout's torch_bigbatch first on the
    path (a script under benchmarks/ or examples/ would otherwise import whichever copy is
    installed), one thread per process, and `variables`."""
    path = os.pathsep.join(filter(None, [ROOT, os.environ.get("PYTHONPATH")]))
    return {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": path, **variables}


CUDA = pytest.mark.cuda
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

# One test body for both devices: CPU always runs, CUDA is marked and skipped without a GPU.
DEVICES = ["cpu", pytest.param("cuda", marks=[CUDA, needs_cuda])]


def assert_relative_close(actual, expected, tolerance, what=""):
    """max |actual - expected| <= tolerance * max |expected| (relative to the tensor's scale)."""
    scale = expected.abs().max().clamp_min(1e-30)
    error = ((actual.double() - expected.double()).abs().max() / scale).item()
    assert error <= tolerance, f"{what}: relative error {error:.3g} > {tolerance:.1g}"


# The tests of the CUDA-build environment (tests/cuda_build_env.py sets this): there they must
# run, anywhere else they are skipped with the reason. Those also marked cuda need a GPU, and
# run wherever one is (a GPU machine has torch's CUDA build and torchvision).
IN_CUDA_BUILD_ENV = os.environ.get("TORCH_BIGBATCH_TEST_ENV") == "cuda-build"


def pytest_collection_modifyitems(config, items):
    if IN_CUDA_BUILD_ENV:
        return
    skip = pytest.mark.skip(reason="runs in the CUDA-build environment of `make test` (torch's "
                            "CUDA build with torchvision: tests/cuda_build_env.py)")
    for item in items:
        if "cuda_build" in item.keywords and not ("cuda" in item.keywords
                                                   and torch.cuda.is_available()):
            item.add_marker(skip)
