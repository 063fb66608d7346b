# The two commands of a fresh machine: `make demo` and `make test`. Each installs what it needs.
PYTHON ?= python3
PIP := $(PYTHON) -m pip
BUILD := build/make
FASHION_MNIST := /usr/share/datasets/fashion-mnist/train-images-idx3-ubyte.gz
APT := $(shell [ "$$(id -u)" = 0 ] || echo sudo) env DEBIAN_FRONTEND=noninteractive apt-get
SOURCES := $(shell find csrc torch_bigbatch -name '*.cpp' -o -name '*.cu' -o -name '*.h' -o -name '*.cuh' -o -name '*.py') setup.py pyproject.toml

.PHONY: install demo demo-cluster test test-cuda-build

# torch 2.13.0 is the CPU wheel on this kind of machine; a GPU machine brings its own torch.
$(BUILD)/installed: $(SOURCES)
	@mkdir -p $(BUILD)
	$(PYTHON) -c "import torch" 2>/dev/null || $(PIP) install torch==2.13.0
	$(PIP) install ninja pytest pytest-timeout matplotlib
	$(PIP) install --no-build-isolation -e .
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

# Two environments: this Python's torch (the CPU wheel here: every test), then torch's CUDA
# build in a venv with the package built there as README says, CUDA half included (the fast
# subset and the tests marked cuda_build: tests/cuda_build_env.py; it skips, saying why, where
# there is no nvcc or the wheels cannot be installed).
test: install
	$(PYTHON) -m pytest -q
	$(MAKE) test-cuda-build

test-cuda-build: $(FASHION_MNIST)
	$(PYTHON) tests/cuda_build_env.py
