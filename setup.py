"""Builds one extension, torch_bigbatch._C: the C++ sources always, and the CUDA half (*.cu and
their ATen glue, *_cuda_glue.cpp) whenever the installed torch is a CUDA build, with or without
a GPU. A CUDA torch with no CUDA toolkit stops the build with a message saying what to set,
rather than building a package whose ops have no CUDA kernels; TORCH_BIGBATCH_CPU_ONLY=1 asks
for the CPU half alone."""

import glob
import importlib.util
import os
import platform
import re
import shlex
import shutil
import subprocess
import sys
from collections import Counter

import setuptools
from setuptools import find_packages, setup

_NO_TORCH = ("torch_bigbatch builds against the torch installed in this environment: install "
             "torch first, then build with `pip install --no-build-isolation -e .`")
try:
    import torch
except ImportError:
    raise SystemExit(f"torch_bigbatch: no torch to build against ({_NO_TORCH})") from None
if "pip-build-env-" in torch.__file__:  # pip's isolated build: a torch other than the user's
    raise SystemExit(f"torch_bigbatch: this build would use {torch.__file__}, a torch pip "
                     f"installed for the build alone, not the one the package runs with "
                     f"({_NO_TORCH})")

CSRC = os.path.join(os.path.dirname(os.path.abspath(__file__)), "csrc")
# The GPUs we target (A100, H100), and PTX that newer ones compile at load time. Used when the
# user set no TORCH_CUDA_ARCH_LIST and no GPU is visible: torch finds no arch on its own then.
DEFAULT_CUDA_ARCHS = "8.0;9.0+PTX"


def check_build_tools():
    """`pip install --no-build-isolation` builds with this environment's setuptools, not with
    what pyproject.toml asks for: an editable install needs setuptools >= 64 and a bdist_wheel
    command (setuptools' own from 70.1, the wheel package's before; a Python 3.11 venv beside
    torch 2.11 has setuptools 65.5 and no wheel). Say what to install, instead of setuptools'
    "invalid command 'bdist_wheel'". `setup.py build_ext --inplace` needs neither."""
    if not {"dist_info", "bdist_wheel", "editable_wheel"} & set(sys.argv):  # pip's commands
        return
    version = tuple(int(part) for part in re.findall(r"\d+", setuptools.__version__)[:2])
    bdist_wheel = (importlib.util.find_spec("setuptools.command.bdist_wheel")
                   or importlib.util.find_spec("wheel"))
    if version < (64, 0):
        missing, remedy = "setuptools>=64", "pip install 'setuptools>=64' wheel"
    elif bdist_wheel is None:
        missing, remedy = "the wheel package (or setuptools>=70.1)", "pip install wheel"
    else:
        return
    raise SystemExit(f"torch_bigbatch: building needs {missing} in this environment, which has "
                     f"setuptools {setuptools.__version__}: {remedy}, then install again")


def links_shared_libstdcxx(compiler):
    """Whether `compiler` (a command line, as torch's build takes CXX: "ccache g++" too) links
    libstdc++ as the shared library (False: its own copy, or libc++); None where it cannot say
    (no such compiler, or one that does not answer: the build itself then says what it can)."""
    try:
        answer = subprocess.run([*shlex.split(compiler), "-print-file-name=libstdc++.so"],
                                capture_output=True, text=True, timeout=60)
    except (OSError, ValueError, subprocess.SubprocessError):
        return None
    if answer.returncode != 0 or not answer.stdout.strip():
        return None
    return os.path.isabs(answer.stdout.strip())  # a compiler without one echoes the bare name


def check_cxx_runtime():
    """torch throws C++ exceptions (a failing TORCH_CHECK) through this package's frames and
    catches them in its own: both must use the process's one shared libstdc++. An extension
    linked with its own copy crashes (SIGSEGV) at the first such error: seen on a GPU machine
    whose CXX was a g++ without libstdc++.so, where torch's own load_inline crashed too. The
    compiler is the one torch's build uses, CXX or c++."""
    if platform.system() != "Linux":
        return
    compiler = os.environ.get("CXX", "c++")
    if links_shared_libstdcxx(compiler) is not False:
        return
    others = [name for name in ("g++", "c++", "/usr/bin/g++")
              if shutil.which(name) and links_shared_libstdcxx(name)]
    # CC too: torch's build hands it to nvcc as its host compiler (-ccbin)
    c_compiler = "gcc" if shutil.which("gcc") else others[0] if others else None
    remedy = (f"for example CXX={others[0]} CC={c_compiler}" if others
              else "install one (the distribution's g++)")
    raise SystemExit(f"torch_bigbatch: the C++ compiler {compiler} (CXX) has no shared libstdc++: "
                     "it would link its own copy into the extension, and torch's C++ errors would "
                     f"then crash the process instead of raising; build with one that has: "
                     f"{remedy}")


def sources(pattern):
    return sorted(glob.glob(os.path.join("csrc", "**", pattern), recursive=True))


def check_object_names(files):
    """setuptools puts each source's object at <stem>.o: two sources of one stem (foo.cpp beside
    foo.cu) compile to one object, and ninja refuses the build with a less helpful message."""
    stems = Counter(os.path.splitext(name)[0] for name in files)
    clashes = sorted(name for name in files if stems[os.path.splitext(name)[0]] > 1)
    if clashes:
        raise SystemExit(f"torch_bigbatch: these sources would compile to one object file: "
                         f"{', '.join(clashes)}; rename one of each pair")


def toolkit_of_nvcc(nvcc):
    """The toolkit folder of an nvcc found on PATH. It may be a link or a wrapper script outside
    the toolkit (then torch's guess, the folder above it, has no CUDA headers): nvcc itself says
    where it lives."""
    try:
        dry_run = subprocess.run([nvcc, "--dryrun", "-E", "-x", "cu", os.devnull],
                                 capture_output=True, text=True, timeout=60)
        found = re.search(r"^#\$ TOP=(.+)$", dry_run.stdout + dry_run.stderr, re.MULTILINE)
    except (OSError, subprocess.SubprocessError):
        found = None
    top = found.group(1).strip() if found else os.path.dirname(os.path.dirname(nvcc))
    return os.path.realpath(top)


def is_toolkit(folder):
    return (os.path.isfile(os.path.join(folder, "bin", "nvcc"))
            and os.path.isfile(os.path.join(folder, "include", "cuda_runtime.h")))


def nvcc_major(folder):
    """The CUDA major version of the nvcc in `folder`, or None where it does not say."""
    try:
        answer = subprocess.run([os.path.join(folder, "bin", "nvcc"), "--version"],
                                capture_output=True, text=True, timeout=60)
        found = re.search(r"release (\d+)\.", answer.stdout)
    except (OSError, subprocess.SubprocessError):
        found = None
    return found.group(1) if found else None


def cuda_toolkit():
    """The CUDA toolkit to build the CUDA half with: one of torch's CUDA major version (torch's
    build refuses another with a bare traceback); stops the build with what to set when there
    is none."""
    wanted = torch.version.cuda.split(".")[0]
    remedy = (f"install CUDA {wanted}.x (torch {torch.__version__} is a CUDA {torch.version.cuda} "
              "build) and set CUDA_HOME to its folder, or set TORCH_BIGBATCH_CPU_ONLY=1 to build "
              "without the CUDA kernels")
    for variable in ("CUDA_HOME", "CUDA_PATH"):
        folder = os.environ.get(variable)
        if folder:
            if not is_toolkit(folder):
                raise SystemExit(f"torch_bigbatch: {variable}={folder} is not a CUDA toolkit (no "
                                 "bin/nvcc or include/cuda_runtime.h in it): set it to the "
                                 "toolkit's folder, for example /usr/local/cuda")
            found = nvcc_major(folder)
            if found not in (wanted, None):
                raise SystemExit(f"torch_bigbatch: {variable}={folder} holds CUDA {found}: "
                                 f"{remedy}")
            return folder
    nvcc = shutil.which("nvcc")
    candidates = [toolkit_of_nvcc(nvcc)] if nvcc else []
    candidates.append("/usr/local/cuda")
    seen = []
    for folder in candidates:
        if is_toolkit(folder):
            found = nvcc_major(folder)
            if found in (wanted, None):
                return folder
            seen.append(f"{folder} holds CUDA {found}")
        else:
            seen.append(f"{folder} is not a toolkit")
    raise SystemExit(f"torch_bigbatch: no CUDA {wanted} toolkit found ({'; '.join(seen)}): "
                     f"{remedy}")


def with_cuda():
    if os.environ.get("TORCH_BIGBATCH_CPU_ONLY") == "1":
        print("torch_bigbatch: TORCH_BIGBATCH_CPU_ONLY=1: building the CPU half only")
        return False
    if torch.version.cuda is None:
        print(f"torch_bigbatch: torch {torch.__version__} has no CUDA: building the CPU half")
        return False
    # Before torch.utils.cpp_extension is imported: it reads CUDA_HOME once, at import.
    os.environ["CUDA_HOME"] = cuda_toolkit()
    if not os.environ.get("TORCH_CUDA_ARCH_LIST") and torch.cuda.device_count() == 0:
        os.environ["TORCH_CUDA_ARCH_LIST"] = DEFAULT_CUDA_ARCHS
    print(f"torch_bigbatch: building the CUDA half with {os.environ['CUDA_HOME']} for "
          f"{os.environ.get('TORCH_CUDA_ARCH_LIST') or 'the visible GPUs'}")
    return True


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


def extension(cuda):
    from torch.utils.cpp_extension import CppExtension, CUDAExtension  # after with_cuda()
    cpp = [s for s in sources("*.cpp") if not s.endswith("_cuda_glue.cpp")]
    # at::parallel_for is OpenMP in torch's builds: the pragma must be compiled in here too.
    args = {"cxx": ["-O3", "-fopenmp", *cpu_capability_flags()]}
    files = cpp + (sources("*_cuda_glue.cpp") + sources("*.cu") if cuda else [])
    check_object_names(files)
    if not cuda:
        return CppExtension("torch_bigbatch._C", files, include_dirs=[CSRC],
                            extra_compile_args=args, extra_link_args=["-fopenmp"])
    args["cxx"].append("-DTORCH_BIGBATCH_WITH_CUDA")  # torch_bigbatch._C.WITH_CUDA
    args["nvcc"] = ["-O3"]
    return CUDAExtension("torch_bigbatch._C", files, include_dirs=[CSRC],
                         extra_compile_args=args, extra_link_args=["-fopenmp"])


check_build_tools()
check_cxx_runtime()
CUDA = with_cuda()
from torch.utils.cpp_extension import BuildExtension  # noqa: E402  (reads CUDA_HOME)

setup(
    packages=find_packages(include=["torch_bigbatch", "torch_bigbatch.*"]),
    ext_modules=[extension(CUDA)],
    cmdclass={"build_ext": BuildExtension},
)
