"""What a GPU machine should tell first where `make test-gpu` crashed there (issue 22).

On the lent H200 (torch 2.11.0+cu130, Python 3.12) the package built and its CUDA kernels
passed their tests, but three things ended in SIGSEGV: a failing TORCH_CHECK in a CPU op of
ours (torch_bigbatch::local_batch_norm with group_size 1; the TypeError of an int64 input was
raised cleanly in the same call path), the torus's first allreduce of a CUDA tensor (one rank
over NCCL, four over Gloo's CUDA engine), and DDP's parameter check over the torus. All of this
passes here with torch 2.11.0 (CPU and CUDA builds), so the difference is that machine's
toolchain. This probe writes what decides between the causes, each probe in its own process so
that one crash does not end the others:
- the toolchain: compilers, Python's compile flags, the CPU's vector flags, what _C links;
- whether a minimal extension of torch's own kind (one op, one TORCH_CHECK) crashes there too,
  built with torch's default flags: then the machine, not our build, breaks C++ exceptions;
- the native stack (cuda-gdb, the innermost frames) of each crash;
- the same crashes with the package rebuilt without its AVX-512 flags
  (TORCH_BIGBATCH_CPU_CAPABILITY=default), in a copy of the checkout.

Usage, from the checkout's root, after the package is built: python tests/gpu_probe.py OUT_DIR
"""

import os
import shutil
import subprocess
import sys
import tempfile
import textwrap

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# The crashes, as Python programs. Each prints what it got; a crash shows as a signal.
BN_THROW = """
import torch, torch_bigbatch
try:
    torch.ops.torch_bigbatch.local_batch_norm(torch.randn(4, 4), None, None, 1, 1e-5)
except RuntimeError as error:
    print("raised:", str(error).splitlines()[0])
"""
TORUS = """
import os, sys, torch, torch.distributed as dist, torch_bigbatch
os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT="29631")
dist.init_process_group("torus", rank=0, world_size=1)
tensor = torch.arange(10.0, device=DEVICE)
dist.all_reduce(tensor)
print("allreduced:", tensor.tolist())
dist.destroy_process_group()
"""
TORUS_CPU, TORUS_CUDA = (f"DEVICE = {device!r}\n" + TORUS for device in ("cpu", "cuda"))
INLINE_OP = """
import torch
from torch.utils.cpp_extension import load_inline
load_inline("probe_check", cpp_sources=[r'''
#include <torch/library.h>
void fail_below_two(int64_t n) { TORCH_CHECK(n >= 2, "n must be at least 2, got ", n); }
TORCH_LIBRARY(probe_check, m) { m.def("fail_below_two(int n) -> ()", &fail_below_two); }
'''], is_python_module=False, build_directory=BUILD, verbose=False)
try:
    torch.ops.probe_check.fail_below_two(1)
except RuntimeError as error:
    print("raised:", str(error).splitlines()[0])
"""
FACTS = [
    "which c++ g++ gcc nvcc; c++ --version | head -1", "nvcc --version | tail -2",
    "ldd --version | head -1",
    "python3 -c 'import sysconfig; print(sysconfig.get_config_var(\"CFLAGS\"))'",
    "grep -m1 -o 'avx512[a-z_0-9]*' /proc/cpuinfo | sort -u | tr '\\n' ' '",
    "grep -m1 'model name' /proc/cpuinfo",
    "python3 -c 'import torch; print(torch.__config__.show())' | head -12",
    "ldd torch_bigbatch/_C*.so | grep -v torch/lib",
    "env | grep -iE 'torch|nccl|cuda|gloo|ld_|python|path|flags|cxx|^cc=' | sort",
    "python3 -c 'import torch.utils.cpp_extension as e; print(e.include_paths(), e.CUDA_HOME)'",
]


def run(log, title, command, cwd=ROOT, env=None, timeout=180):
    log.write(f"\n===== {title}\n$ {command if isinstance(command, str) else ' '.join(command)}\n")
    log.flush()
    try:
        result = subprocess.run(command, shell=isinstance(command, str), cwd=cwd, env=env,
                                capture_output=True, text=True, timeout=timeout)
        log.write(result.stdout[-6000:] + result.stderr[-4000:])
        log.write(f"[exit status {result.returncode}]\n")
    except subprocess.TimeoutExpired:
        log.write(f"[timed out after {timeout} s]\n")
    log.flush()


def native_stack(log, title, program, cwd=ROOT):
    """The program under cuda-gdb: where it stops, the innermost frames and instructions."""
    if shutil.which("cuda-gdb") is None:
        log.write(f"\n===== {title}: no cuda-gdb here\n")
        return
    run(log, title, ["cuda-gdb", "-q", "-batch", "-ex", "set pagination off", "-ex", "run",
                     "-ex", "bt 25", "-ex", "info registers rip rsp", "-ex", "x/6i $pc",
                     "--args", sys.executable, "-c", program], cwd=cwd)


def main():
    out = sys.argv[1] if len(sys.argv) > 1 else "."
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, "probe.log"), "w") as log:
        for command in FACTS:
            run(log, "fact", command)
        with tempfile.TemporaryDirectory() as build:
            inline = f"BUILD = {build!r}\n" + INLINE_OP
            run(log, "a minimal op of torch's kind, TORCH_CHECK failing", [sys.executable, "-c",
                                                                              inline])
        run(log, "the torus, one rank, a CPU tensor", [sys.executable, "-X", "faulthandler", "-c",
                                                       TORUS_CPU])
        for title, program in (("our op's TORCH_CHECK failing", BN_THROW),
                               ("the torus, one rank, a CUDA tensor", TORUS_CUDA)):
            run(log, title, [sys.executable, "-X", "faulthandler", "-c", program])
            native_stack(log, title + ", under cuda-gdb", program)
            # C++ stack traces on: torch then walks every exception's stack with its own
            # unwinder (torch::CapturedTraceback), not libgcc's.
            for show in ("0", "1"):
                run(log, f"{title}, TORCH_SHOW_CPP_STACKTRACES={show}",
                    [sys.executable, "-X", "faulthandler", "-c", program],
                    env={**os.environ, "TORCH_SHOW_CPP_STACKTRACES": show})
        # The package without AVX-512 flags, built in a copy (the checkout's build stays).
        with tempfile.TemporaryDirectory() as copy:
            shutil.copytree(ROOT, copy, dirs_exist_ok=True,
                            ignore=shutil.ignore_patterns("build", "*.so", ".git", ".gpu-data"))
            env = {**os.environ, "TORCH_BIGBATCH_CPU_CAPABILITY": "default", "PYTHONPATH": copy}
            run(log, "build without AVX-512 flags", textwrap.dedent(f"""\
                {sys.executable} setup.py build_ext --inplace > build.log 2>&1; status=$?
                grep -m1 -o "c++ -MMD.*local_bn_op.cpp.*" build.log | cut -c1-4000
                tail -3 build.log | cut -c1-500; exit $status"""), cwd=copy, env=env, timeout=300)
            for title, program in (("our op's TORCH_CHECK, no AVX-512 flags", BN_THROW),
                                   ("the torus, CUDA tensor, no AVX-512 flags", TORUS_CUDA)):
                run(log, title, [sys.executable, "-X", "faulthandler", "-c", program], cwd=copy,
                    env=env)
    print(open(os.path.join(out, "probe.log")).read())


if __name__ == "__main__":
    main()
