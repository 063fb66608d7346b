"""Builds one extension, torch_bigbatch._C: the C++ sources always, the CUDA sources (*.cu and
the *_cuda.cpp glue) too when the installed torch has CUDA and nvcc is found."""

import glob
import os

import torch
from setuptools import find_packages, setup
from torch.utils.cpp_extension import CUDA_HOME, BuildExtension, CppExtension, CUDAExtension


def sources(pattern):
    return sorted(glob.glob(os.path.join("csrc", "**", pattern), recursive=True))


def extension():
    cpp = [s for s in sources("*.cpp") if not s.endswith("_cuda.cpp")]
    # at::parallel_for is OpenMP in torch's builds: the pragma must be compiled in here too.
    args = {"cxx": ["-O3", "-fopenmp"]}
    with_cuda = torch.version.cuda is not None and CUDA_HOME is not None
    if os.environ.get("TORCH_BIGBATCH_CPU_ONLY") == "1":
        with_cuda = False
    if with_cuda:
        args["nvcc"] = ["-O3"]
        return CUDAExtension("torch_bigbatch._C", cpp + sources("*_cuda.cpp") + sources("*.cu"),
                             extra_compile_args=args, extra_link_args=["-fopenmp"])
    return CppExtension("torch_bigbatch._C", cpp, extra_compile_args=args,
                        extra_link_args=["-fopenmp"])


setup(
    packages=find_packages(include=["torch_bigbatch", "torch_bigbatch.*"]),
    ext_modules=[extension()],
    cmdclass={"build_ext": BuildExtension},
)
