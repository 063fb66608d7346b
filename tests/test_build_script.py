"""setup.py in an environment that cannot build the package: it stops before building, saying
what to install (pip install --no-build-isolation uses the environment's setuptools as it is).
An environment that can is every install of `make test`."""

import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run_setup_with(tmp_path, setuptools_version, wheel, command="dist_info", env=None):
    """setup.py `command` (dist_info: pip's first step) with a stand-in setuptools of that
    version (no bdist_wheel of its own) and a stand-in wheel package or none; its setup() ends
    the run if the build gets there."""
    fake = tmp_path / "setuptools"
    (fake / "command").mkdir(parents=True)
    (fake / "command" / "__init__.py").write_text("")
    (fake / "__init__.py").write_text(
        f"__version__ = {setuptools_version!r}\n"
        "def find_packages(**kwargs):\n    return []\n"
        "def setup(**kwargs):\n    raise SystemExit('setup() was reached')\n")
    if wheel:
        (tmp_path / "wheel").mkdir()
        (tmp_path / "wheel" / "__init__.py").write_text("")
    hide_wheel = "" if wheel else "sys.modules['wheel'] = None; "  # whatever is installed here
    code = (f"import runpy, sys; sys.path.insert(0, {str(tmp_path)!r}); {hide_wheel}"
            f"sys.argv = ['setup.py', {command!r}]; runpy.run_path('setup.py')")
    return subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True,
                          timeout=120,
                          env={**os.environ, "TORCH_BIGBATCH_CPU_ONLY": "1", **(env or {})})


@pytest.mark.parametrize("version,wheel,named,remedy", [
    ("63.2.0", True, "needs setuptools>=64", "pip install 'setuptools>=64' wheel"),
    ("65.5.0", False, "needs the wheel package (or setuptools>=70.1)", "pip install wheel"),
])
def test_missing_build_tools_are_named_before_the_build(tmp_path, version, wheel, named, remedy):
    result = run_setup_with(tmp_path, version, wheel)
    assert result.returncode != 0
    assert "setup() was reached" not in result.stderr
    assert named in result.stderr and f"setuptools {version}" in result.stderr, result.stderr
    assert remedy in result.stderr, result.stderr



def test_a_build_in_place_needs_no_wheel(tmp_path):
    """`setup.py build_ext --inplace` (make gpu-build's fallback) builds no wheel: not refused."""
    result = run_setup_with(tmp_path, "63.2.0", wheel=False, command="build_ext")
    assert "torch_bigbatch: building needs" not in result.stderr, result.stderr


def test_a_compiler_that_links_its_own_libstdcxx_is_refused(tmp_path):
    """A CXX without a shared libstdc++ (a GPU machine's was one) would build an extension whose
    first failing TORCH_CHECK crashes the process: setup.py names it and a compiler that works."""
    static_gxx = tmp_path / "static-g++"  # answers as such a g++ does, builds nothing
    static_gxx.write_text('#!/bin/sh\ncase "$1" in -print-file-name=*) '
                          'echo "${1#-print-file-name=}";; *) exit 1;; esac\n')
    static_gxx.chmod(0o755)
    result = run_setup_with(tmp_path, "80.0.0", wheel=True, command="build_ext",
                            env={"CXX": str(static_gxx)})
    assert result.returncode != 0 and "setup() was reached" not in result.stderr
    assert f"the C++ compiler {static_gxx} (CXX) has no shared libstdc++" in result.stderr
    assert "for example CXX=g++ CC=gcc" in result.stderr, result.stderr
    # Behind a wrapper, as torch's build runs CXX ("ccache g++"): the same answer.
    wrapped = run_setup_with(tmp_path / "wrapped", "80.0.0", wheel=True, command="build_ext",
                             env={"CXX": f"env {static_gxx}"})
    assert f"the C++ compiler env {static_gxx} (CXX) has no shared libstdc++" in wrapped.stderr, \
        wrapped.stderr
    # This machine's own compiler passes.
    plain = run_setup_with(tmp_path / "plain", "80.0.0", wheel=True, command="build_ext",
                           env={"CXX": "g++"})
    assert "has no shared libstdc++" not in plain.stderr, plain.stderr


def run_setup_code(code, env=None):
    return subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True,
                          timeout=120, env={**os.environ, **(env or {})})


def test_a_build_without_torch_says_to_install_it_and_skip_build_isolation():
    """pip's isolated build has no torch (pyproject.toml asks for none, since it would fetch
    the newest and build against it): a clear stop, not a package that cannot load."""
    result = run_setup_code("import runpy, sys; sys.modules['torch'] = None; "
                            "sys.argv = ['setup.py', 'dist_info']; runpy.run_path('setup.py')")
    assert result.returncode != 0
    assert "no torch to build against" in result.stderr, result.stderr
    assert "pip install --no-build-isolation -e ." in result.stderr, result.stderr


def test_pyproject_leaves_the_installed_torch_alone():
    """No torch among the build requirements (an isolated build would fetch the newest), and
    the dependency admits vendor and nightly builds of 2.11 (2.11.0a0+git...), which a plain
    ">=2.11" counts as older and pip would replace."""
    text = open(os.path.join(ROOT, "pyproject.toml")).read()
    build = text[text.index("[build-system]"):text.index("[project]")]
    assert "torch" not in build.split("requires", 1)[1].split("\n", 1)[0], build
    assert 'dependencies = ["torch>=2.11.0.dev0"]' in text
    from packaging.specifiers import SpecifierSet
    for version in ("2.11.0a0+git1234", "2.11.0.dev20260101", "2.11.0", "2.13.0+cpu"):
        assert SpecifierSet(">=2.11.0.dev0").contains(version, prereleases=True), version
    assert not SpecifierSet(">=2.11.0.dev0").contains("2.10.0", prereleases=True)


def test_a_toolkit_of_another_cuda_major_version_is_named(tmp_path):
    """A CUDA 12 toolkit beside a CUDA 13 torch: torch's build would stop with a bare traceback
    after 'building the CUDA half'; setup.py names both versions and what to set."""
    toolkit = tmp_path / "cuda-12"
    (toolkit / "bin").mkdir(parents=True)
    (toolkit / "include").mkdir()
    (toolkit / "include" / "cuda_runtime.h").write_text("")
    nvcc = toolkit / "bin" / "nvcc"
    nvcc.write_text("#!/bin/sh\necho 'Cuda compilation tools, release 12.4, V12.4.131'\n")
    nvcc.chmod(0o755)
    result = run_setup_code(
        "import runpy, sys, torch; torch.version.cuda = '13.0'; "
        "sys.argv = ['setup.py', 'build_ext']; runpy.run_path('setup.py')",
        env={"CUDA_HOME": str(toolkit), "TORCH_BIGBATCH_CPU_ONLY": "0", "CXX": "g++"})
    assert result.returncode != 0
    assert f"CUDA_HOME={toolkit} holds CUDA 12" in result.stderr, result.stderr
    assert "install CUDA 13.x" in result.stderr and "TORCH_BIGBATCH_CPU_ONLY=1" in result.stderr
    assert "building the CUDA half" not in result.stdout
