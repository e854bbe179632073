# make test: set up .venv, build, run every test (Triton interpreted when there is no GPU) and the nvcc compile check.
# make demo: set up, build, and run the main job on the best device present.
SHELL := /bin/bash
# PYTHON: the interpreter the venv is made from; empty lets tools/setup_venv.sh pick one (a python with torch first).
PYTHON ?=
VENV := .venv
PY := $(VENV)/bin/python
BUILD := $(CURDIR)/build

# Keep compiler and JIT caches inside build/ (torch.compile alone writes ~300 MB under $TMPDIR).
export TMPDIR := $(BUILD)/tmp
export TORCHINDUCTOR_CACHE_DIR := $(BUILD)/inductor
export TRITON_CACHE_DIR := $(BUILD)/triton
export TORCH_EXTENSIONS_DIR := $(BUILD)/torch_extensions
export MAX_JOBS ?= $(shell nproc)
export PYTHONUNBUFFERED := 1
# OpenMP's threads sleep at a barrier instead of spinning: make test runs pytest beside the compile checks on CI's 2
# cores, where a spinning thread burns the core the other thread (or nvcc) needs. Beside one busy core, benchmarks/
# rope.py --quick on CPU (2 threads): 12.6-14.4 s spinning, 9.4 s passive (2026-11-26). Threads stay at 2.
export OMP_WAIT_POLICY ?= PASSIVE

HAS_GPU = $(shell $(PY) -c "import torch; print(int(torch.cuda.is_available()))")
# The Triton twin runs under the interpreter where no GPU is present.
TEST_ENV = $(if $(filter 1,$(HAS_GPU)),,TRITON_INTERPRET=1)
# Where nvidia-smi sees a GPU, a torch that does not is an error (tests/conftest.py stops), not a CPU run.
export ROPEWKV_EXPECT_GPU ?= $(shell nvidia-smi -L >/dev/null 2>&1 && echo 1)

.PHONY: test demo setup build pytest cuda-check static-report parity clean

# The compile checks run beside pytest, their output printed when both are done: pytest leaves a core mostly idle (the
# Triton interpreter is one Python thread), and CI's 2 cores are what bounds its time. CI allows 30 minutes (~27 used
# on 2026-11-26): the slowest tests are listed at the end.
test: build
	@$(CHECKS) >$(BUILD)/checks.log 2>&1 & checks=$$!; \
	$(TEST_ENV) $(PY) -m pytest tests -q --durations=15; tests=$$?; \
	wait $$checks; compile=$$?; cat $(BUILD)/checks.log; \
	echo "make test: pytest exit $$tests, compile checks exit $$compile"; \
	exit $$(( tests || compile ))

demo: build
	$(TEST_ENV) $(PY) -m ropewkv demo

setup:
	@mkdir -p $(TMPDIR)
	tools/setup_venv.sh $(VENV) $(PYTHON)

build: setup
	$(PY) -m pip install -q -e . --no-build-isolation --no-deps
	tools/source_hash.sh >$(BUILD)/source.hash

pytest: build
	$(TEST_ENV) $(PY) -m pytest tests -q

CUDA_CHECK = PYTHON=$(PY) tools/check_cuda_compile.sh
# Every CUDA and Triton kernel compiled for sm_90a and read (tools/static_report): fails on new spills or RoPE hot
# loops without 16-byte accesses. The report lands in build/static-report/ (committed: benchmarks/results/).
STATIC_REPORT = if command -v $${NVCC:-nvcc} >/dev/null; then $(PY) -m tools.static_report --check; \
	else echo "static-report: nvcc not found, static report NOT run"; fi
CHECKS = { $(CUDA_CHECK) && $(STATIC_REPORT); }

cuda-check: setup
	$(CUDA_CHECK)

static-report: build
	@$(STATIC_REPORT)

parity: build
	$(TEST_ENV) $(PY) -m ropewkv parity

clean:
	rm -rf build python/ropewkv/*.so
