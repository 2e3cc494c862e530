# make build | run | test | bench | sanitize
#
# With a Docker engine, test and bench run inside the image built from tritonProject.Dockerfile
# (NVIDIA's PyTorch container: torch, triton and Transformer Engine). Without one, or with
# RUNNER=local, they run in the current Python if it has torch, triton and pytest, otherwise
# in .venv, created from requirements.txt on first use. Without a CUDA GPU the tests select
# Triton's interpreter by themselves.

IMAGE      ?= triton-rotary
PYTHON     ?= python3
VENV       ?= .venv
TEST_ARGS  ?=
BENCH_ARGS ?=
DOCKER_RUN  = docker run --rm --gpus all --ipc=host --ulimit memlock=-1 --ulimit stack=67108864 \
              -v "$(CURDIR)":/workspace/triton-rotary -w /workspace/triton-rotary
RUNNER     ?= $(shell docker info >/dev/null 2>&1 && echo docker || echo local)

TEST_CMD   = -m pytest -q pytest_benchmark_cuda_triton_comparison.py $(TEST_ARGS)
# Odd shapes under compute-sanitizer's memcheck; without PyTorch's caching allocator every
# tensor is its own allocation, so an out-of-bounds access cannot land in a neighbour.
SANITIZE   = PYTORCH_NO_CUDA_MEMORY_CACHING=1 compute-sanitizer --tool memcheck --error-exitcode 1 \
             --target-processes all
SANITIZE_CMD = -m pytest -q -p no:cacheprovider pytest_benchmark_cuda_triton_comparison.py -k sanitize
BENCH_CMD  = pytest_benchmark_cuda_triton_comparison.py

.PHONY: build run test bench sanitize local-python

build:
	docker build -f tritonProject.Dockerfile -t $(IMAGE) .

run:
	$(DOCKER_RUN) -it $(IMAGE) bash

# Prints the interpreter to use locally, creating .venv only when the current one lacks packages.
local-python:
	@if $(PYTHON) -c "import torch, triton, pytest" >/dev/null 2>&1; then \
	  echo $(PYTHON); \
	else \
	  if ! $(VENV)/bin/python -c "import torch, triton, pytest" >/dev/null 2>&1; then \
	    $(PYTHON) -m venv $(VENV) >&2 && \
	    $(VENV)/bin/python -m pip install -q --upgrade pip >&2 && \
	    $(VENV)/bin/python -m pip install -q -r requirements.txt >&2 || exit 1; \
	  fi; \
	  echo $(VENV)/bin/python; \
	fi

ifeq ($(RUNNER),docker)
sanitize:
	$(DOCKER_RUN) $(IMAGE) env $(SANITIZE) python $(SANITIZE_CMD)
test:
	$(DOCKER_RUN) $(IMAGE) python $(TEST_CMD)
bench:
	$(DOCKER_RUN) $(IMAGE) python $(BENCH_CMD) $(BENCH_ARGS)
else
# Without a GPU the interpreter is CPU-bound: spread the tests over the cores (pytest-xdist).
test:
	@PY=$$($(MAKE) -s local-python RUNNER=local) && \
	PARALLEL=$$(if ! nvidia-smi -L >/dev/null 2>&1 && $$PY -c "import xdist" 2>/dev/null; then echo "-n auto"; fi) && \
	$$PY $(TEST_CMD) $$PARALLEL
sanitize:
	@nvidia-smi -L >/dev/null 2>&1 || { echo "make sanitize needs a CUDA GPU and compute-sanitizer" >&2; exit 1; }
	@PY=$$($(MAKE) -s local-python RUNNER=local) && $(SANITIZE) $$PY $(SANITIZE_CMD)
bench:
	@nvidia-smi -L >/dev/null 2>&1 || { echo "make bench needs a CUDA GPU (the Triton interpreter is for correctness, not timing)" >&2; exit 1; }
	@PY=$$($(MAKE) -s local-python RUNNER=local) && $$PY $(BENCH_CMD) $(BENCH_ARGS)
endif
