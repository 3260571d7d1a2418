# Two entry points for a fresh machine: `make train` (main job) and `make test` (whole suite).
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
EXPERIMENT ?= configs/experiments/shakespeare_cla2.yaml
ARGS ?=

.PHONY: install install-dev install-aot train test clean

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e .
	touch $@

$(VENV)/.installed-dev: $(VENV)/.installed
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e '.[hf,dev,eval]'
	touch $@

# libtpu for compiling TPU programs ahead of time on this host (scripts/aot_compile.py, tests/test_aot.py), kept out
# of the venv: installed there, every jax process would try to start a TPU runtime and hold its lock file.
LIBTPU := .libtpu
$(LIBTPU)/.installed: $(VENV)/.installed
	$(PY) -m pip install -q --no-deps --target $(LIBTPU) "$$($(PY) -c "import importlib.metadata as m; \
	  print(next(r.split(';')[0] for r in m.requires('jax') if r.startswith('libtpu')))")"
	touch $@

# jax's CUDA plugin for compiling GPU programs ahead of time on this host (train.py --compile-only --topology h100:8,
# scripts/aot_compile.py, tests/test_aot.py), of the installed jax's version and kept out of the venv as libtpu is:
# installed there, every jax start would probe CUDA. No NVIDIA libraries are needed to compile (~480 MB).
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

install: $(VENV)/.installed
install-dev: $(VENV)/.installed-dev
## libtpu, jax's CUDA plugin and cuDNN beside the venv: compile for TPU slices and GPU clusters here (--compile-only).
install-aot: $(LIBTPU)/.installed $(JAXCUDA)/.installed $(JAXCUDA)/.cudnn

## Train the default experiment on ../shared/data/tinyshakespeare.txt, then print the evaluation summary.
train: install
	$(PY) train.py --config $(EXPERIMENT) $(ARGS)

## Run the whole test suite (slow real-corpus runs included).
test: install-dev install-aot
	$(PY) -m pytest -n 2 -q --durations=25 $(ARGS)

clean:
	rm -rf runs .pytest_cache
