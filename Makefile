# `make` alone prints `make help`: targets, runners, variables.
#
# Two runners. `docker`: the image built from tritonProject.Dockerfile (NVIDIA's PyTorch
# container: torch, Triton and Transformer Engine built together). `local`: the current Python
# if it has what the tests import, otherwise .venv, made from requirements.txt on first use.
# Without RUNNER, Docker is chosen only when the image exists and a CUDA GPU answers: the image
# exists to run TE and the kernels on a GPU, and without one both runners would run the same
# interpreter tests.

IMAGE       ?= triton-rotary
PYTHON      ?= python3
VENV        ?= .venv
TEST_ARGS   ?=
BENCH_ARGS  ?=
# The container runs as the caller, so what it writes into the mounted checkout belongs to the
# caller, not root. That user has no home in the image: HOME, USER (getpass, which torch's
# caches use, fails for a uid without a passwd entry) and the caches are set to writable places.
DOCKER_USER ?= $(shell id -u):$(shell id -g)
DOCKER_RUN   = docker run --rm --gpus all --ipc=host --ulimit memlock=-1 --ulimit stack=67108864 \
               --user $(DOCKER_USER) -e USER=$(shell id -un) -e HOME=/tmp/home \
               -e XDG_CACHE_HOME=/tmp/cache -e TRITON_CACHE_DIR=/tmp/cache/triton \
               -e TORCHINDUCTOR_CACHE_DIR=/tmp/cache/inductor -e ROPE_TEST_MATRIX \
               -v "$(CURDIR)":/workspace/triton-rotary -w /workspace/triton-rotary

GPU_FOUND   := $(shell nvidia-smi -L >/dev/null 2>&1 && echo yes)
ifdef RUNNER
  RUNNER_WHY := RUNNER=$(RUNNER) given
else
  IMAGE_FOUND := $(shell docker image inspect $(IMAGE) >/dev/null 2>&1 && echo yes)
  ifeq ($(GPU_FOUND)$(IMAGE_FOUND),yesyes)
    RUNNER     := docker
    RUNNER_WHY := image $(IMAGE) exists and nvidia-smi lists a GPU; RUNNER=local runs here instead
  else
    RUNNER     := local
    RUNNER_WHY := $(if $(GPU_FOUND),no image $(IMAGE): make build makes it,no CUDA GPU: nvidia-smi -L failed)
  endif
endif
ifeq ($(filter $(RUNNER),docker local),)
  $(error RUNNER must be docker or local, not '$(RUNNER)')
endif

PYTEST       = -m pytest -q -rfEs pytest_benchmark_cuda_triton_comparison.py
# Odd shapes under compute-sanitizer's memcheck; without PyTorch's caching allocator every
# tensor is its own allocation, so an out-of-bounds access cannot land in a neighbour.
SANITIZE     = PYTORCH_NO_CUDA_MEMORY_CACHING=1 compute-sanitizer --tool memcheck --error-exitcode 1 \
               --target-processes all
SANITIZE_CMD = -m pytest -q -rfEs -p no:cacheprovider pytest_benchmark_cuda_triton_comparison.py -m sanitize
BENCH_CMD    = pytest_benchmark_cuda_triton_comparison.py

NEED_DOCKER = command -v docker >/dev/null 2>&1 || { echo "$@: no docker command here; install Docker, or use the local runner (RUNNER=local)" >&2; exit 1; }; \
              docker info >/dev/null 2>&1 || { echo "$@: the Docker engine does not answer (docker info failed): start it (e.g. sudo systemctl start docker) or get access to its socket; RUNNER=local needs no Docker" >&2; exit 1; }
NEED_IMAGE  = $(NEED_DOCKER); docker image inspect $(IMAGE) >/dev/null 2>&1 || { echo "$@: no image $(IMAGE); make build makes it" >&2; exit 1; }

.DEFAULT_GOAL := help
.PHONY: help build run test test-full lint bench sanitize local-python

help:
	@echo "Targets:"
	@echo "  make test        the tests. On a GPU: TE's own test shapes and matrices. Without one: Triton's"
	@echo "                   interpreter on CPU, scaled shapes, TE's matrices reduced to the cases that"
	@echo "                   cover each code path (ROPE_TEST_MATRIX=quick), spread over all cores"
	@echo "  make test-full   the same with TE's whole matrices (ROPE_TEST_MATRIX=full); slow without a GPU"
	@echo "  make sanitize    the -m sanitize tests under compute-sanitizer memcheck (CUDA GPU)"
	@echo "  make lint        ruff check with pyproject.toml's configuration (CI runs it)"
	@echo "  make bench       benchmarks into artifacts/ (CUDA GPU)"
	@echo "  make build       the Docker image $(IMAGE) from tritonProject.Dockerfile"
	@echo "  make run         a shell in that image, this checkout mounted"
	@echo "Runners (test, test-full, sanitize, bench):"
	@echo "  docker           in the image, as your user, this checkout mounted"
	@echo "  local            the current $(PYTHON) if it has what the tests import, else $(VENV)"
	@echo "                   (made from requirements.txt on first use; VENV_ONLY=1: always $(VENV))"
	@echo "  Without RUNNER: docker when the image exists and nvidia-smi lists a GPU, else local."
	@echo "  Here now: $(RUNNER) ($(RUNNER_WHY))"
	@echo "Variables:"
	@echo "  RUNNER=docker|local   TEST_ARGS='pytest args'   BENCH_ARGS='--sweeps ... --dtypes ...'"
	@echo "  IMAGE=$(IMAGE)   PYTHON=$(PYTHON)   VENV=$(VENV)   DOCKER_USER=uid:gid"
	@echo "  ROPE_TEST_MATRIX=quick|full (environment; default full on a GPU, quick without)"

build:
	@$(NEED_DOCKER)
	docker build -f tritonProject.Dockerfile -t $(IMAGE) .

run:
	@$(NEED_IMAGE)
	$(DOCKER_RUN) -it $(IMAGE) bash

# Prints the interpreter to use locally, making or completing .venv only when the current one
# lacks what the tests import (VENV_ONLY=1: always .venv, as CI does). What pip prints goes to
# stderr, so that the first run shows what it downloads.
TEST_IMPORTS = torch, triton, numpy, pytest, xdist, hypothesis, transformers
local-python:
	@if [ -z "$(VENV_ONLY)" ] && $(PYTHON) -c "import $(TEST_IMPORTS)" >/dev/null 2>&1; then \
	  echo $(PYTHON); \
	else \
	  if ! $(VENV)/bin/python -c "import $(TEST_IMPORTS)" >/dev/null 2>&1; then \
	    echo "making $(VENV) from requirements.txt (first run only): PyPI's Linux torch is the CUDA" \
	         "build whether or not there is a GPU, so pip downloads about 3 GB (torch and its nvidia-*" \
	         "wheels) and $(VENV) takes about 5 GB" >&2; \
	    $(PYTHON) -m venv $(VENV) >&2 && \
	    $(VENV)/bin/python -m pip install --progress-bar on --upgrade pip >&2 && \
	    $(VENV)/bin/python -m pip install --progress-bar on -r requirements.txt >&2 || exit 1; \
	  fi; \
	  echo $(VENV)/bin/python; \
	fi

test-full: export ROPE_TEST_MATRIX = full

lint:
	@PY=$$($(MAKE) -s --no-print-directory local-python RUNNER=local) && \
	{ $$PY -m ruff --version >/dev/null 2>&1 || \
	  { echo "make lint: no ruff for $$PY (pip install ruff; requirements.txt lists it)" >&2; exit 1; }; } && \
	$$PY -m ruff check .

ifeq ($(RUNNER),docker)
test test-full:
	@$(NEED_IMAGE); echo "runner: docker, image $(IMAGE) ($(RUNNER_WHY))"
	$(DOCKER_RUN) $(IMAGE) python $(PYTEST) $(TEST_ARGS)
sanitize:
	@$(NEED_IMAGE); echo "runner: docker, image $(IMAGE) ($(RUNNER_WHY))"
	$(DOCKER_RUN) $(IMAGE) env $(SANITIZE) python $(SANITIZE_CMD)
bench:
	@$(NEED_IMAGE); echo "runner: docker, image $(IMAGE) ($(RUNNER_WHY))"
	$(DOCKER_RUN) $(IMAGE) python $(BENCH_CMD) $(BENCH_ARGS)
else
# Without a GPU the interpreter is CPU-bound: the tests are spread over the cores (pytest-xdist).
test test-full:
	@PY=$$($(MAKE) -s --no-print-directory local-python RUNNER=local) && \
	echo "runner: local, $$PY ($(RUNNER_WHY))" && \
	$$PY -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)" && \
	PARALLEL=$$(if [ -z "$(GPU_FOUND)" ] && $$PY -c "import xdist" 2>/dev/null; then echo "-n auto"; fi) && \
	START=$$(date +%s) && { $$PY $(PYTEST) $$PARALLEL $(TEST_ARGS); rc=$$?; \
	echo "make $@: the tests took $$(( $$(date +%s) - START )) s (the one-time install not included)"; \
	exit $$rc; }
sanitize:
	@[ -n "$(GPU_FOUND)" ] || { echo "make sanitize needs a CUDA GPU and compute-sanitizer" >&2; exit 1; }
	@PY=$$($(MAKE) -s --no-print-directory local-python RUNNER=local) && \
	echo "runner: local, $$PY ($(RUNNER_WHY))" && $(SANITIZE) $$PY $(SANITIZE_CMD)
bench:
	@[ -n "$(GPU_FOUND)" ] || { echo "make bench needs a CUDA GPU (the Triton interpreter is for correctness, not timing)" >&2; exit 1; }
	@PY=$$($(MAKE) -s --no-print-directory local-python RUNNER=local) && \
	echo "runner: local, $$PY ($(RUNNER_WHY))" && $$PY $(BENCH_CMD) $(BENCH_ARGS)
endif
