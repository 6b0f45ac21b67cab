# The two commands of the README: `make demo` and `make test`. Both install what
# is missing (never replacing a torch that is already there), build the
# extension when its sources changed, and run.
PYTHON ?= python3
PIP := $(PYTHON) -m pip
export PIP_ROOT_USER_ACTION := ignore
export PIP_DISABLE_PIP_VERSION_CHECK := 1
# torch 2.13.0: the CPU wheel on this machine's disk; any torch >= 2.6 already installed is kept.
TORCH_SPEC ?= torch==2.13.0
PYTEST_ARGS ?=

CSRC := $(shell find csrc -name '*.cpp' -o -name '*.h' -o -name '*.cu' -o -name '*.cuh' 2>/dev/null)
# One stamp per interpreter (its sys.prefix), so that switching PYTHON builds again.
BUILD_STAMP := build/.prime-built-$(shell $(PYTHON) -c "import sys, zlib; print('%08x' % zlib.crc32(sys.prefix.encode()))" 2>/dev/null)

.PHONY: all deps build test demo bench clean

all: build

deps:
	@$(PYTHON) -c "import torch, sys; v = tuple(int(p) for p in torch.__version__.split('+')[0].split('.')[:2]); sys.exit(v < (2, 6))" 2>/dev/null \
		|| $(PIP) install -q "$(TORCH_SPEC)"
	@# setuptools >= 64 builds editable installs (PEP 660); before 70.1 it needs wheel for that.
	@$(PYTHON) -c "import importlib.util as u, sys, setuptools; v = tuple(int(p) for p in setuptools.__version__.split('.')[:2]); \
		sys.exit(v < (64, 0) or (v < (70, 1) and u.find_spec('wheel') is None))" 2>/dev/null \
		|| $(PIP) install -q "setuptools>=64" wheel
	@$(PYTHON) -c "import numpy, ninja, pytest, matplotlib" 2>/dev/null || $(PIP) install -q numpy ninja pytest matplotlib
	@$(PYTHON) -c "import sys; sys.exit(sys.version_info < (3, 11))" || $(PYTHON) -c "import tomli" 2>/dev/null || $(PIP) install -q tomli
	@$(PYTHON) -c "import triton" 2>/dev/null || $(PIP) install -q triton || echo "prime: triton not installed; its tests will skip"
	@# prime-tokenize (tokenizers; pyarrow for Parquet) and the metric sinks (tensorboard, wandb): their tests run, not skip.
	@$(PYTHON) -c "import tokenizers, pyarrow, tensorboard, wandb" 2>/dev/null || $(PIP) install -q tokenizers pyarrow tensorboard wandb

# --no-build-isolation: build against the torch installed above; with isolation pip
# would fetch a second torch (several GB) into a throw-away build environment.
$(BUILD_STAMP): setup.py pyproject.toml tools/prime_build_backend.py $(CSRC)
	MAX_JOBS=$${MAX_JOBS:-$$(nproc)} $(PIP) install -q --no-build-isolation -e .
	@cat build/prime-cuda.txt 2>/dev/null || true
	@mkdir -p build && touch $@

# Then the bytecode of prime's modules, once: where PYTHONDONTWRITEBYTECODE is set (the CI machine) every
# process would compile them again, about 0.2 s each (seconds per simulated node, minutes in the tests).
build: deps $(BUILD_STAMP)
	@$(PYTHON) -m compileall -q prime > /dev/null

test: build
	$(PYTHON) -m pytest -q $(PYTEST_ARGS) tests

demo: build
	$(PYTHON) -m prime.demo

bench: build
	$(PYTHON) benchmarks/bench_quantize.py --quick

clean:
	rm -rf build prime/_C*.so *.egg-info
