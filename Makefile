# Two commands on a fresh machine: `make demo` and `make test`.
# torch is installed only if it cannot be imported: a GPU user's CUDA torch is kept,
# and a CPU-only machine never pulls multi-GB CUDA wheels (TORCH_SPEC is pinned).
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
TORCH_SPEC ?= torch==2.13.0
NPROC ?= 2
PYTEST_ARGS ?=

# `make lint`: ruff (pyflakes, import order, bugbear; configured in pyproject.toml). CI runs it before the tests.
.PHONY: setup lint demo test test-slow test-gpu test-slurm bench gpu-wheels clean

$(PY):
	@echo "setup 1/3: creating $(VENV) with $$($(PYTHON) --version 2>&1)"
	@$(PYTHON) -m venv $(VENV)
	@$(PY) -m pip install -q --upgrade pip

$(VENV)/.installed: $(PY) pyproject.toml
	@$(PY) -c "import torch" 2>/dev/null && echo "setup 2/3: keeping the torch already in $(VENV)" || \
		{ echo "setup 2/3: installing $(TORCH_SPEC) (the CPU build on a machine without CUDA; ~1 minute)"; \
		  $(PY) -m pip install -q "$(TORCH_SPEC)"; }
	@echo "setup 3/3: installing dptrain (editable) and its test tools"
	@$(PY) -m pip install -q -e ".[test]"
	@touch $@

setup: $(VENV)/.installed

lint: setup
	$(VENV)/bin/ruff check .

demo: setup
	$(VENV)/bin/dptrain demo --nproc $(NPROC)

# A deprecation warning fails the CPU suite: it is fixed where it arises (dptrain/inductor.py explains
# the one torch-internal case). Not for test-gpu: the GPU image's own packages are not ours to fix.
test: setup
	$(PY) -m pytest -q -m "not gpu and not slow" -W error::DeprecationWarning $(PYTEST_ARGS)

# Not in CI: checks that take minutes on 2 cores (every zoo model compiled, tests/unit/test_compiled.py).
test-slow: setup
	$(PY) -m pytest -q -m "slow and not gpu" $(PYTEST_ARGS)

test-gpu: setup
	$(PY) -m pytest -q -m gpu $(PYTEST_ARGS)

# Not in CI (not part of `test`): as root, installs Debian's slurm-wlm and munge, starts a
# one-node SLURM cluster on this machine and runs launch/slurm.sbatch on it: accuracy, stop on
# SIGTERM, requeue on SIGUSR1, the time limit and preemption (~6 minutes on 2 cores).
test-slurm: setup
	launch/test-slurm.sh

bench: setup
	$(PY) -m benchmarks.throughput.throughput

# The wheels benchmarks/gpu/gpu_session.sh installs on a lent GPU machine, which has no network and whose
# image lacks them: lmdb (the data stage and tests/gpu/test_data_gpu.py) and pytest-timeout, for the
# image's Python (GPU_PYTHON, 3.12). Carry .whl/ with the device call (carry: [".whl"]).
GPU_PYTHON ?= 3.12
gpu-wheels:
	$(PYTHON) -m pip download -q --no-deps --only-binary=:all: --python-version $(GPU_PYTHON) --implementation cp \
		--platform manylinux2014_x86_64 -d .whl lmdb pytest-timeout
	@ls .whl

clean:
	rm -rf runs .pytest_cache
