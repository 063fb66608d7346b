"""The second test environment of `make test`: the package as a GPU user installs it.

A venv with one of torch's CUDA builds (CUDA 13.0) and its torchvision, and this checkout copied
into it and installed exactly as README says (`pip install --no-build-isolation -e .`): setup.py
builds the whole extension, its CUDA half with nvcc, on a machine that may have no GPU. Then,
in that venv, pytest runs the tests marked cuda_build (the install kept torch, every op has a
CUDA kernel, the ImageNet job on JPEG files, torchvision's ResNet-50) and, with the newest
torch, the fast subset too (the CPU kernels must not change because the CUDA half is linked
beside them). Two torches: the newest reachable here and the oldest the package supports
(what the lent GPU machines hold), so an API of a newer torch breaks the build here first.

Where there is no nvcc, or the wheels cannot be installed, it says why and skips (exit 0); a
build or a test that fails fails it. Usage:
python tests/cuda_build_env.py [--torch VERSION] [pytest arguments]
"""

import os
import shutil
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# torch's CUDA 13.0 builds: their torchvision, and what pytest runs against them.
TORCHES = {
    "2.14.1": ("0.29.1", "not slow or cuda_build"),  # the newest reachable here
    "2.11.0": ("0.26.0", "cuda_build"),  # the oldest supported: the lent GPU machines' torch
}
NEWEST = next(iter(TORCHES))  # what runs without --torch


def say(message):
    print(f"cuda-build environment: {message}", flush=True)


def skip(reason):
    say(f"SKIPPED: {reason}")
    sys.exit(0)


def run(command, **kwargs):
    return subprocess.run(command, text=True, **kwargs)


class Environment:
    """The venv of one torch under build/cuda-env/<torch>, and the checkout's copy beside it."""

    def __init__(self, torch_version):
        self.torch = torch_version
        self.torchvision, self.selection = TORCHES[torch_version]
        home = os.path.join(ROOT, "build", "cuda-env", torch_version)
        self.venv, self.copy = os.path.join(home, "venv"), os.path.join(home, "src")
        self.python = os.path.join(self.venv, "bin", "python")

    def make_venv(self):
        """Kept between runs once it has its torch. With wheel: a Python 3.11 venv's setuptools
        (65.5) builds an editable install only with it (README, and setup.py says so)."""
        check = [self.python, "-c", "import torch, torchvision; assert torch.__version__"
                 f".startswith('{self.torch}+') and torch.version.cuda"]
        if os.path.exists(self.python) and run(check, capture_output=True).returncode == 0:
            return
        shutil.rmtree(self.venv, ignore_errors=True)
        start = time.monotonic()
        run([sys.executable, "-m", "venv", self.venv], check=True)
        packages = [f"torch=={self.torch}", f"torchvision=={self.torchvision}", "wheel", "ninja",
                    "pytest", "pytest-timeout", "matplotlib"]
        pip = run([self.python, "-m", "pip", "install", "--quiet", *packages],
                  capture_output=True)
        if pip.returncode != 0 or run(check, capture_output=True).returncode != 0:
            shutil.rmtree(self.venv, ignore_errors=True)
            skip(f"torch {self.torch}'s CUDA build could not be installed: "
                 f"{(pip.stderr or pip.stdout).strip()[-800:]}")
        say(f"torch {self.torch} (CUDA build) and torchvision {self.torchvision} installed in "
            f"{time.monotonic() - start:.0f} s")

    def copy_checkout(self):
        """This checkout's files (tracked, and new ones git does not ignore): the venv's build
        must not replace the main environment's extension beside the sources."""
        listed = run(["git", "ls-files", "--cached", "--others", "--exclude-standard", "-z"],
                     cwd=ROOT, capture_output=True, check=True).stdout.split("\0")
        shutil.rmtree(self.copy, ignore_errors=True)
        for name in filter(None, listed):
            source = os.path.join(ROOT, name)
            if os.path.isfile(source):  # a file deleted but not yet staged is listed too
                os.makedirs(os.path.dirname(os.path.join(self.copy, name)), exist_ok=True)
                shutil.copy2(source, os.path.join(self.copy, name))

    def build_and_test(self, pytest_arguments):
        self.make_venv()
        self.copy_checkout()
        environment = {**os.environ, "TORCH_BIGBATCH_TEST_ENV": "cuda-build",
                       "TORCH_BIGBATCH_EXPECT_TORCH": self.torch}
        start = time.monotonic()
        build = run([self.python, "-m", "pip", "install", "--no-build-isolation", "-v", "-e",
                     "."], cwd=self.copy, env=environment, capture_output=True)
        if build.returncode != 0:
            print(build.stdout[-6000:], build.stderr[-6000:], sep="\n")
            say(f"FAILED: the package did not build or install against torch {self.torch}'s "
                "CUDA build")
            sys.exit(1)
        notes = dict.fromkeys(line.strip() for line in (build.stdout + build.stderr).splitlines()
                              if line.strip().startswith("torch_bigbatch:"))  # setup.py: twice
        say(f"built and installed against torch {self.torch} in "
            f"{time.monotonic() - start:.0f} s ({'; '.join(notes)})")
        tests = run([self.python, "-m", "pytest", "-q", "-m", self.selection, "-p",
                     "no:cacheprovider", *pytest_arguments], cwd=self.copy, env=environment)
        if tests.returncode != 0:
            say(f"FAILED: pytest -m '{self.selection}' against torch {self.torch} exited with "
                f"{tests.returncode}")
            sys.exit(1)
        say(f"passed: pytest -m '{self.selection}' against torch {self.torch} with the CUDA half")


def main(arguments):
    torch_version = NEWEST
    if arguments[:1] == ["--torch"]:
        torch_version, arguments = arguments[1], arguments[2:]
    if torch_version not in TORCHES:
        raise SystemExit(f"--torch {torch_version}: one of {', '.join(TORCHES)}")
    if shutil.which("nvcc") is None and not os.environ.get("CUDA_HOME"):
        skip("no nvcc on PATH and no CUDA_HOME: the CUDA half cannot be compiled here")
    Environment(torch_version).build_and_test(arguments)


if __name__ == "__main__":
    main(sys.argv[1:])
