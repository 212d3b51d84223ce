# Two commands for a fresh machine: `make demo` and `make test`.
# Both create (or reuse) .venv and install everything fedge needs into it.
PYTHON ?= python3.11
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.fedge-installed
export FLWR_TELEMETRY_ENABLED := 0

.PHONY: demo test test-fast lint bench setup browser

setup: $(STAMP)

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV) || python3 -m venv $(VENV)
	# torch first, pinned: the CPU build that lies on this machine's disk (an
	# unpinned torch would pull a multi-GB CUDA build).
	$(PY) -m pip install --quiet torch==2.13.0
	$(PY) -m pip install --quiet -e '.[all,dev]'
	touch $(STAMP)

demo: $(STAMP)
	$(VENV)/bin/fedge simulate

# The dashboard's browser tests drive Debian's Chromium through its chromedriver.
browser:
	@if [ -x /usr/bin/chromium ] && [ -x /usr/bin/chromedriver ]; then :; \
	elif command -v apt-get >/dev/null 2>&1; then \
		DEBIAN_FRONTEND=noninteractive apt-get install -y -q chromium chromium-driver >/dev/null 2>&1 || \
		{ apt-get update -q >/dev/null 2>&1 && DEBIAN_FRONTEND=noninteractive apt-get install -y -q chromium chromium-driver >/dev/null 2>&1; } || \
		echo "WARNING: could not install chromium + chromium-driver: the dashboard's browser tests will be SKIPPED"; \
	else echo "WARNING: no apt-get: the dashboard's browser tests will be SKIPPED"; fi

test: $(STAMP) browser
	$(PY) -m pytest -q

test-fast: $(STAMP)
	$(PY) -m pytest -q -m "not slow"

lint: $(STAMP)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/mypy core server clients edge strategies simulation cli task tasks

bench: $(STAMP)
	$(PY) bench/sim_vs_flower.py
