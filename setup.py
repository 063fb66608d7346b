"""Builds one extension, torch_bigbatch._C: the C++ sources always, the CUDA sources (*.cu and
the *_cuda.cpp glue) too when the installed torch has CUDA and nvcc is found."""

import glob
import os
import platform

import torch
from setuptools import find_packages, setup
from torch.utils.cpp_extension import CUDA_HOME, BuildExtension, CppExtension, CUDAExtension


CSRC = os.path.join(os.path.dirname(os.path.abspath(__file__)), "csrc")


def sources(pattern):
    return sorted(glob.glob(os.path.join("csrc", "**", pattern), recursive=True))


# ATen's SIMD vectors per capability: the flags a CPU must have, and the compiler's flags.
_AVX512 = ({"avx512f", "avx512bw", "avx512vl", "avx512dq", "fma", "f16c"},
           ["-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq", "-mfma", "-mf16c",
            "-DCPU_CAPABILITY=AVX512", "-DCPU_CAPABILITY_AVX512"])
CAPABILITIES = {  # widest first
    "avx512_bf16": (_AVX512[0] | {"avx512_bf16"}, _AVX512[1] + ["-mavx512bf16"]),
    "avx512": _AVX512,
    "avx2": ({"avx2", "fma", "f16c"},
             ["-mavx2", "-mfma", "-mf16c", "-DCPU_CAPABILITY=AVX2", "-DCPU_CAPABILITY_AVX2"]),
    "default": (set(), []),
}


def cpu_capability_flags():
    """The widest SIMD of the CPU we build on: the package is built from source where it runs
    (like -march=native), and the CPU kernel is memory-bound only with wide vectors (1.3x
    faster with AVX-512 than with AVX2 here; avx512_bf16 adds a one-instruction float-to-bf16
    conversion). TORCH_BIGBATCH_CPU_CAPABILITY=default|avx2|avx512|avx512_bf16 overrides,
    e.g. for a build that must also run on older CPUs."""
    choice = os.environ.get("TORCH_BIGBATCH_CPU_CAPABILITY")
    if choice is None:
        flags = set()
        if platform.machine() in ("x86_64", "AMD64") and os.path.exists("/proc/cpuinfo"):
            with open("/proc/cpuinfo") as cpuinfo:
                for line in cpuinfo:
                    if line.startswith("flags"):
                        flags = set(line.split(":", 1)[1].split())
                        break
        choice = next(name for name, (needed, _) in CAPABILITIES.items() if needed <= flags)
    print(f"torch_bigbatch: CPU kernels built for {choice}")
    return CAPABILITIES[choice][1]


def extension():
    cpp = [s for s in sources("*.cpp") if not s.endswith("_cuda.cpp")]
    # at::parallel_for is OpenMP in torch's builds: the pragma must be compiled in here too.
    args = {"cxx": ["-O3", "-fopenmp", *cpu_capability_flags()]}
    with_cuda = torch.version.cuda is not None and CUDA_HOME is not None
    if os.environ.get("TORCH_BIGBATCH_CPU_ONLY") == "1":
        with_cuda = False
    if with_cuda:
        args["nvcc"] = ["-O3"]
        return CUDAExtension("torch_bigbatch._C", cpp + sources("*_cuda.cpp") + sources("*.cu"),
                             include_dirs=[CSRC], extra_compile_args=args,
                             extra_link_args=["-fopenmp"])
    return CppExtension("torch_bigbatch._C", cpp, include_dirs=[CSRC], extra_compile_args=args,
                        extra_link_args=["-fopenmp"])


setup(
    packages=find_packages(include=["torch_bigbatch", "torch_bigbatch.*"]),
    ext_modules=[extension()],
    cmdclass={"build_ext": BuildExtension},
)
