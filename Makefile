# The two commands of a fresh machine: `make demo` and `make test`. Each installs what it needs.
PYTHON ?= python3
PIP := $(PYTHON) -m pip
BUILD := build/make
FASHION_MNIST := /usr/share/datasets/fashion-mnist/train-images-idx3-ubyte.gz
APT := $(shell [ "$$(id -u)" = 0 ] || echo sudo) env DEBIAN_FRONTEND=noninteractive apt-get
# What the build compiles (an editable install reads the Python files where they are).
SOURCES := $(shell find csrc -name '*.cpp' -o -name '*.cu' -o -name '*.h' -o -name '*.cuh') \
  setup.py pyproject.toml
# The interpreter and the torch the package was built for: another of either rebuilds it.
TORCH_OF_PYTHON = $(PYTHON) -c "import sys, importlib.metadata as m; \
  print(sys.executable, m.version('torch'))" 2>/dev/null || echo none

.PHONY: install demo demo-cluster test test-cuda-build gpu-data gpu-build test-gpu bench-gpu FORCE

# Rewritten only when the interpreter or its torch changed since the last build.
$(BUILD)/torch-of-python: FORCE
	@mkdir -p $(BUILD)
	@($(TORCH_OF_PYTHON)) | cmp -s - $@ || ($(TORCH_OF_PYTHON)) > $@

# torch 2.13.0 is the CPU wheel on this kind of machine; a GPU machine brings its own torch
# (asked of pip's records, not by importing it: a torch that fails to import is not replaced).
$(BUILD)/installed: $(SOURCES) $(BUILD)/torch-of-python
	$(PYTHON) -c "import importlib.metadata as m; m.version('torch')" 2>/dev/null \
	  || $(PIP) install torch==2.13.0
	$(PIP) install 'setuptools>=64' wheel ninja pytest pytest-timeout matplotlib
	$(PIP) install --no-build-isolation -e .
	@($(TORCH_OF_PYTHON)) > $(BUILD)/torch-of-python
	@touch $@

# The real data of the demo and the tests: Debian's Fashion-MNIST (no download at run time).
$(FASHION_MNIST):
	$(APT) install -y dataset-fashion-mnist || ($(APT) update && $(APT) install -y dataset-fashion-mnist)

install: $(BUILD)/installed $(FASHION_MNIST)

DEMO_JOB := examples/train_resnet50.py --recipe goyal2017 --dataset fashion-mnist --epochs 5 \
  --batch-per-rank 64

# The main job: goyal2017 (5 epochs) on Fashion-MNIST, 4 CPU processes under one torchrun, DDP
# over the torus backend (on one machine a 4x1 torus: one row); prints the test accuracy.
demo: install
	OMP_NUM_THREADS=1 $(PYTHON) -m torch.distributed.run --nproc-per-node 4 $(DEMO_JOB) \
	  --output runs/demo

# The same job on two emulated machines of two processes (network namespaces: root, iproute2):
# a 2x2 torus whose rows are the machines.
demo-cluster: install
	OMP_NUM_THREADS=1 $(PYTHON) benchmarks/emulated_cluster.py --nodes 2 --nproc-per-node 2 \
	  $(DEMO_JOB) --output runs/demo-cluster

# This Python's torch (the CPU wheel here: every test), then torch's CUDA builds in venvs with
# the package built there as README says, CUDA half included: the newest torch reachable (the
# fast subset and the tests marked cuda_build) and the oldest supported, the lent GPU machines'
# (the tests marked cuda_build): tests/cuda_build_env.py; it skips, saying why, where there is
# no nvcc or the wheels cannot be installed.
test: install
	$(PYTHON) -m pytest -q
	$(MAKE) test-cuda-build

test-cuda-build: $(FASHION_MNIST)
	$(PYTHON) tests/cuda_build_env.py --torch 2.14.1
	$(PYTHON) tests/cuda_build_env.py --torch 2.11.0

# On a lent GPU machine (the device tool's: its torch, CUDA and nvcc, 16 cores, no network):
# `make test-gpu GPU_OUT=$$OUT` builds the package against that torch, then runs the fast subset
# and every CUDA test, logs and JUnit XML in GPU_OUT; `make bench-gpu GPU_OUT=$$OUT` the GPU
# benchmarks, their CSVs and tables there. Both stop at once, saying so, where no GPU is
# visible. `make gpu-data` first, here: a copy of Fashion-MNIST in .gpu-data/ (not in git) for
# the run's `carry`, found there through TORCH_BIGBATCH_FASHION_MNIST. Where that machine's pip
# or setuptools cannot make the editable install, gpu-build builds in place (PYTHONPATH finds it).
# A machine's calls are short (10 minutes each, 15 in all): gpu-build builds once per source
# and torch (a stamp in build/, which a warm machine keeps between calls), each test has 200 s,
# the tests 480 s in all (a fresh machine's build takes about 66 s of the call's 600), and each
# benchmark a limit of its own (benchmarks/gpu_benchmarks.sh).
GPU_OUT ?= runs/gpu
# What test-gpu selects; GPU_MARKS=cuda runs the CUDA tests alone, where device time is short.
GPU_MARKS ?= cuda or not slow
# The steps of bench-gpu (benchmarks/gpu_benchmarks.sh names them); empty: all, in its order.
GPU_BENCH ?=
GPU_DATA := .gpu-data/fashion-mnist
GPU_STAMP := build/gpu-build.stamp

gpu-data: $(FASHION_MNIST)
	@mkdir -p $(GPU_DATA)
	cp /usr/share/datasets/fashion-mnist/*.gz $(GPU_DATA)/

# The lent machines set CXX to a g++ that links its own libstdc++ (setup.py refuses it: torch's
# C++ errors crash such a build): their distribution's g++ builds the package, and its gcc is
# nvcc's host compiler (torch's build passes CC to nvcc as -ccbin).
GPU_CXX ?= g++
GPU_CC ?= gcc
# The tests and benchmarks compile too (torch.compile's C++): with the same compilers.
GPU_ENV := TORCH_BIGBATCH_FASHION_MNIST=$(CURDIR)/$(GPU_DATA) PYTHONUNBUFFERED=1 \
  PYTHONPATH=$(CURDIR) CXX=$(GPU_CXX) CC=$(GPU_CC)
gpu-build: export CXX = $(GPU_CXX)
gpu-build: export CC = $(GPU_CC)
gpu-build:
	@$(PYTHON) -c "import sys, torch; sys.exit(0 if torch.cuda.is_available() else \
	  'no GPU: this target needs a visible CUDA device (torch ' + torch.__version__ + ')')"
	@mkdir -p $(GPU_OUT) build
	@stamp=$$(cat setup.py $$(find csrc -type f | sort) | sha1sum | cut -c1-16)-$$($(PYTHON) \
	  -c "import torch; print(torch.__version__)"); \
	if [ "$$(cat $(GPU_STAMP) 2>/dev/null)" = "$$stamp" ]; then \
	  echo "gpu-build: built already (sources and torch as at the last build)"; exit 0; fi; \
	rm -f $(GPU_STAMP); \
	$(PIP) install --no-build-isolation --no-deps --no-index -e . > $(GPU_OUT)/build.log 2>&1 \
	  || (tail -20 $(GPU_OUT)/build.log; \
	      echo "gpu-build: pip could not install it; building in place"; \
	      $(PYTHON) setup.py build_ext --inplace > $(GPU_OUT)/build_inplace.log 2>&1 \
	      || (tail -50 $(GPU_OUT)/build_inplace.log; exit 1)) \
	  && echo "$$stamp" > $(GPU_STAMP)

# With pytest-xdist (the GPU machines have it) in 4 workers: a test that crashes its process
# then fails alone instead of ending the run.
test-gpu: gpu-build
	$(GPU_ENV) timeout -k 10 480 $(PYTHON) -m pytest -m "$(GPU_MARKS)" -rfEs -p no:cacheprovider \
	  --tb=short --timeout 200 $$($(PYTHON) -c "import xdist" 2>/dev/null && echo "-n 4") \
	  --junitxml=$(GPU_OUT)/junit.xml > $(GPU_OUT)/test.log 2>&1; status=$$?; \
	  tail -40 $(GPU_OUT)/test.log; exit $$status

bench-gpu: gpu-build
	$(GPU_ENV) PYTHON=$(PYTHON) bash benchmarks/gpu_benchmarks.sh $(GPU_OUT) $(GPU_BENCH)
