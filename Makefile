# Two entry points for a fresh machine: `make train` (main job) and `make test` (whole suite).
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
EXPERIMENT ?= configs/experiments/shakespeare_cla2.yaml
ARGS ?=

.PHONY: install install-dev install-aot train check test clean

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e .
	touch $@

$(VENV)/.installed-dev: $(VENV)/.installed
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e '.[hf,dev,eval]'
	touch $@

# libtpu for compiling TPU programs ahead of time on this host (scripts/aot_compile.py,
# tests/integration/aot/test_aot.py), kept out of the venv: installed there, every jax process would try to start a TPU
# runtime and hold its lock file.
LIBTPU := .libtpu
$(LIBTPU)/.installed: $(VENV)/.installed
	$(PY) -m pip install -q --no-deps --target $(LIBTPU) "$$($(PY) -c "import importlib.metadata as m; \
	  print(next(r.split(';')[0] for r in m.requires('jax') if r.startswith('libtpu')))")"
	touch $@

# jax's CUDA plugin for compiling GPU programs ahead of time on this host (train.py --compile-only --topology h100:8,
# scripts/aot_compile.py, tests/integration/aot/test_aot.py), of the installed jax's version and kept out of the venv
# as libtpu is: installed there, every jax start would probe CUDA. No NVIDIA libraries are needed to compile (~480 MB).
JAXCUDA := .jaxcuda
$(JAXCUDA)/.installed: $(VENV)/.installed
	v=$$($(PY) -c "import jax; print(jax.__version__)") && \
	  $(PY) -m pip install -q --no-deps --target $(JAXCUDA) "jax-cuda12-plugin==$$v" "jax-cuda12-pjrt==$$v"
	touch $@

# NVIDIA's cuDNN beside the plugin, which loads it from there: jax lowers its cuDNN attention (attention.impl=cudnn)
# only when the library loads, even to compile for a GPU this host does not have (716 MB wheel, 1.1 GB unpacked).
CUDNN := nvidia-cudnn-cu12==9.28.0.42
$(JAXCUDA)/.cudnn: $(JAXCUDA)/.installed
	$(PY) -m pip install -q --no-deps --target $(JAXCUDA) "$(CUDNN)"
	touch $@

# The released vLLM beside the venv, for tests/support/vllm_released_checks.py (driven by
# tests/equivalence/test_vllm_released.py): its wheel without dependencies and without its CUDA kernels (the checks run
# vLLM's own Python on the CPU), the pure-Python packages its import path needs, and the lowest transformers the `hf`
# extra allows (vLLM 0.33's floor, with the huggingface_hub 1.x it needs), so that the remote code is tested there too.
# 231 MB installed (the wheel is 336 MB). vLLM pins torch 2.14.0; the checks run on the venv's torch 2.13.0 (CPU), the
# one this project installs.
VLLM_ENV := .vllm
VLLM_PACKAGES := vllm==0.33.0 transformers==5.16.1 huggingface_hub==1.33.0 httpx==0.28.1 httpcore==1.0.9 \
  apache-tvm-ffi==0.1.11 cachetools==8.0.2 cbor2==6.3.0 compressed-tensors==0.17.0 fastapi==0.136.3 \
  llguidance==1.7.6 loguru==0.7.3 msgspec==0.22.0 openai==3.57.0 oss-harmony==0.0.11 partial-json-parser==0.2.1.1.post7 \
  py-cpuinfo==9.0.0 pybase64==1.5.1 pyzmq==27.3.0 sniffio==1.3.1 starlette==1.10.0 xgrammar==0.2.8
$(VLLM_ENV)/.installed: $(VENV)/.installed-dev Makefile
	rm -rf $(VLLM_ENV)
	$(PY) -m pip install -q --no-deps --no-compile --target $(VLLM_ENV) $(VLLM_PACKAGES)
	find $(VLLM_ENV)/vllm -name '*.so' -delete && rm -f $(VLLM_ENV)/vllm/vllm-rs
	touch $@

install: $(VENV)/.installed
install-dev: $(VENV)/.installed-dev
## libtpu, jax's CUDA plugin and cuDNN beside the venv: compile for TPU slices and GPU clusters here (--compile-only).
install-aot: $(LIBTPU)/.installed $(JAXCUDA)/.installed $(JAXCUDA)/.cudnn

## Train the default experiment on ../shared/data/tinyshakespeare.txt, then print the evaluation summary.
train: install
	$(PY) train.py --config $(EXPERIMENT) $(ARGS)

## The developer loop: tests/unit (no training, no CLI or process started, no accelerator compile), with only the venv.
check: install-dev
	$(PY) -m pytest -n 2 -q --durations=10 tests/unit $(ARGS)

## Run the whole test suite (slow real-corpus runs included).
test: install-dev install-aot $(VLLM_ENV)/.installed
	$(PY) -m pytest -n 2 -q --durations=25 $(ARGS)

clean:
	rm -rf runs .pytest_cache
