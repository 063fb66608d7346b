"""The second test environment of `make test`: the package as a GPU user installs it.

A venv with torch's CUDA build (TORCH_PIN, CUDA 13.0) and torchvision, and this checkout copied
into it and installed exactly as README says (`pip install --no-build-isolation -e .`): setup.py
builds the whole extension, its CUDA half with nvcc, on a machine that may have no GPU. Then,
in that venv, pytest runs the fast subset (the CPU kernels must not change because the CUDA
half is linked beside them) and the tests marked cuda_build (the install kept torch, every op
has a CUDA kernel, the ImageNet job on JPEG files, torchvision's ResNet-50).

Where there is no nvcc, or the wheels cannot be installed, it says why and skips (exit 0); a
build or a test that fails fails it. Usage: python tests/cuda_build_env.py [pytest arguments]
"""

import os
import shutil
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
HOME = os.path.join(ROOT, "build", "cuda-env")
VENV, COPY = os.path.join(HOME, "venv"), os.path.join(HOME, "src")
PYTHON = os.path.join(VENV, "bin", "python")
TORCH_PIN = "2.14.1"
PACKAGES = [f"torch=={TORCH_PIN}", "torchvision==0.29.1", "ninja", "pytest", "pytest-timeout",
            "matplotlib"]
SELECTION = "not slow or cuda_build"


def say(message):
    print(f"cuda-build environment: {message}", flush=True)


def skip(reason):
    say(f"SKIPPED: {reason}")
    sys.exit(0)


def run(command, **kwargs):
    return subprocess.run(command, text=True, **kwargs)


def make_venv():
    """The venv with TORCH_PIN, kept between runs once it has it."""
    check = [PYTHON, "-c", f"import torch, torchvision; assert torch.__version__.startswith("
             f"'{TORCH_PIN}+') and torch.version.cuda"]
    if os.path.exists(PYTHON) and run(check, capture_output=True).returncode == 0:
        return
    shutil.rmtree(VENV, ignore_errors=True)
    start = time.monotonic()
    run([sys.executable, "-m", "venv", VENV], check=True)
    pip = run([PYTHON, "-m", "pip", "install", "--quiet", *PACKAGES], capture_output=True)
    if pip.returncode != 0 or run(check, capture_output=True).returncode != 0:
        shutil.rmtree(VENV, ignore_errors=True)
        skip(f"torch {TORCH_PIN}'s CUDA build could not be installed: "
             f"{(pip.stderr or pip.stdout).strip()[-800:]}")
    say(f"torch {TORCH_PIN} (CUDA build) and torchvision installed in "
        f"{time.monotonic() - start:.0f} s")


def copy_checkout():
    """This checkout's files (tracked, and new ones git does not ignore) into COPY: the venv's
    build must not replace the main environment's extension beside the sources."""
    listed = run(["git", "ls-files", "--cached", "--others", "--exclude-standard", "-z"],
                 cwd=ROOT, capture_output=True, check=True).stdout.split("\0")
    shutil.rmtree(COPY, ignore_errors=True)
    for name in filter(None, listed):
        source = os.path.join(ROOT, name)
        if os.path.isfile(source):  # a file deleted but not yet staged is listed too
            os.makedirs(os.path.dirname(os.path.join(COPY, name)), exist_ok=True)
            shutil.copy2(source, os.path.join(COPY, name))


def main(pytest_arguments):
    if shutil.which("nvcc") is None and not os.environ.get("CUDA_HOME"):
        skip("no nvcc on PATH and no CUDA_HOME: the CUDA half cannot be compiled here")
    make_venv()
    copy_checkout()
    environment = {**os.environ, "TORCH_BIGBATCH_TEST_ENV": "cuda-build",
                   "TORCH_BIGBATCH_EXPECT_TORCH": TORCH_PIN}
    start = time.monotonic()
    build = run([PYTHON, "-m", "pip", "install", "--no-build-isolation", "-v", "-e", "."],
                cwd=COPY, env=environment, capture_output=True)
    if build.returncode != 0:
        print(build.stdout[-6000:], build.stderr[-6000:], sep="\n")
        say("FAILED: the package did not build or install against torch's CUDA build")
        sys.exit(1)
    notes = dict.fromkeys(line.strip() for line in (build.stdout + build.stderr).splitlines()
                          if line.strip().startswith("torch_bigbatch:"))  # setup.py runs twice
    say(f"built and installed in {time.monotonic() - start:.0f} s ({'; '.join(notes)})")
    tests = run([PYTHON, "-m", "pytest", "-q", "-m", SELECTION, "-p", "no:cacheprovider",
                 *pytest_arguments], cwd=COPY, env=environment)
    if tests.returncode != 0:
        say(f"FAILED: pytest -m '{SELECTION}' exited with {tests.returncode}")
        sys.exit(1)
    say(f"passed: pytest -m '{SELECTION}' against torch {TORCH_PIN} with the CUDA half")


if __name__ == "__main__":
    main(sys.argv[1:])
