# Two entry points for a fresh machine: `make train` (main job) and `make test` (whole suite).
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
EXPERIMENT ?= configs/experiments/shakespeare_cla2.yaml
ARGS ?=

.PHONY: install install-dev train test clean

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e .
	touch $@

$(VENV)/.installed-dev: $(VENV)/.installed
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e '.[hf,dev,tpu]'
	touch $@

install: $(VENV)/.installed
install-dev: $(VENV)/.installed-dev

## Train the default experiment on ../shared/data/tinyshakespeare.txt, then print the evaluation summary.
train: install
	$(PY) train.py --config $(EXPERIMENT) $(ARGS)

## Run the whole test suite (slow real-corpus runs included).
test: install-dev
	$(PY) -m pytest -n 2 -q $(ARGS)

clean:
	rm -rf runs .pytest_cache
