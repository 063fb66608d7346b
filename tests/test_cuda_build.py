"""The package as a GPU user installs it, checked on a machine without a GPU: in the CUDA-build
environment of `make test` (tests/cuda_build_env.py: a venv with torch's CUDA build, the
package installed there as README says), the install kept that torch, the CUDA half is linked
in, every op has a CUDA kernel with the dispatcher, and the torus serves CUDA tensors."""

import datetime
import json
import os
import subprocess
import sys

import pytest
import torch
import torch.distributed as dist

import torch_bigbatch as bb

pytestmark = pytest.mark.cuda_build


def test_the_install_kept_the_users_torch():
    installed = json.loads(subprocess.run(
        [sys.executable, "-m", "pip", "list", "--format", "json"], capture_output=True,
        text=True, check=True).stdout)
    versions = {package["name"].lower(): package["version"] for package in installed}
    assert versions["torch"] == os.environ["TORCH_BIGBATCH_EXPECT_TORCH"]
    assert "torch-bigbatch" in versions
    assert torch.version.cuda is not None, "the environment's torch is a CUDA build"


def test_the_cuda_half_is_linked_in():
    assert bb._C.WITH_CUDA


def test_every_op_has_a_cuda_kernel():
    ops = sorted(name for name in torch._C._dispatch_get_registrations_for_dispatch_key("CPU")
                 if name.startswith("torch_bigbatch::"))
    assert ops == ["torch_bigbatch::local_batch_norm", "torch_bigbatch::local_batch_norm_backward",
                   "torch_bigbatch::sgd_step_"]
    missing = [op for op in ops if not torch._C._dispatch_has_kernel_for_dispatch_key(op, "CUDA")]
    assert not missing, f"no CUDA kernel for {missing}"


def test_the_torus_serves_cuda_tensors(tmp_path):
    assert "cuda" in dist.Backend.backend_capability["torus"]
    store = dist.FileStore(str(tmp_path / "store"), 1)
    dist.init_process_group("torus", store=store, rank=0, world_size=1,
                            timeout=datetime.timedelta(seconds=30))
    try:
        group = dist.distributed_c10d._get_default_group()
        cpu_backend = group._get_backend(torch.device("cpu"))
        assert isinstance(cpu_backend, bb._C.TorusBackend)
        assert group._get_backend(torch.device("cuda")) is cpu_backend
    finally:
        dist.destroy_process_group()


def test_an_sgd_step_is_torchs_in_this_torch():
    """The step's two ways to its kernel, direct (an eager step) and through the op (under a
    dispatch mode), against torch.optim.SGD in this environment's torch."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class PassThrough(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            return func(*args, **(kwargs or {}))

    for mode in (None, PassThrough()):
        weight = torch.nn.Parameter(torch.arange(4.0))
        expected = torch.nn.Parameter(torch.arange(4.0))
        ours = bb.optim.SGD([weight], lr=0.1, momentum=0.9, weight_decay=0.01)
        theirs = torch.optim.SGD([expected], lr=0.1, momentum=0.9, weight_decay=0.01)
        for _ in range(3):
            weight.grad, expected.grad = torch.ones(4), torch.ones(4)
            if mode is None:
                ours.step()
            else:
                with mode:
                    ours.step()
            theirs.step()
        torch.testing.assert_close(weight.detach(), expected.detach(), rtol=1e-6, atol=1e-7)
