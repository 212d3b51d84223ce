# Two commands for a fresh machine: `make demo` and `make test`.
# Both create (or reuse) .venv and install everything fedge needs into it.
PYTHON ?= python3.11
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.fedge-installed
export FLWR_TELEMETRY_ENABLED := 0

.PHONY: demo test test-fast lint bench setup

setup: $(STAMP)

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV) || python3 -m venv $(VENV)
	# torch first, pinned: the CPU build that lies on this machine's disk (an
	# unpinned torch would pull a multi-GB CUDA build).
	$(PY) -m pip install --quiet torch==2.13.0
	$(PY) -m pip install --quiet -e '.[dev]'
	touch $(STAMP)

demo: $(STAMP)
	$(VENV)/bin/fedge simulate

test: $(STAMP)
	$(PY) -m pytest -q

test-fast: $(STAMP)
	$(PY) -m pytest -q -m "not slow"

lint: $(STAMP)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/mypy fedge server clients edge strategies simulation cli

bench: $(STAMP)
	$(PY) bench/sim_vs_flower.py
