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
	# fedge's own bytecode, once: an editable install leaves none, and where PYTHONDONTWRITEBYTECODE is set
	# every process (a device's ClientApp runs in a new one per message) would compile fedge again
	$(PY) -m compileall -q core server clients edge strategies simulation cli task web >/dev/null
	touch $(STAMP)

demo: $(STAMP)
	$(VENV)/bin/fedge simulate

# The browser tests drive Debian's Chromium through its chromedriver: the dashboard's, and
# the training step in onnxruntime-web (pinned, installed with npm into a git-ignored folder).
ORTWEB_VERSION ?= 1.31.1
ORTWEB_DIR ?= .cache/ortweb
ORTWEB_DIST := $(ORTWEB_DIR)/node_modules/onnxruntime-web/dist
export FEDGE_ORTWEB_DIR := $(ORTWEB_DIR)

browser:
	@if [ -x /usr/bin/chromium ] && [ -x /usr/bin/chromedriver ]; then :; \
	elif command -v apt-get >/dev/null 2>&1; then \
		DEBIAN_FRONTEND=noninteractive apt-get install -y -q chromium chromium-driver >/dev/null 2>&1 || \
		{ apt-get update -q >/dev/null 2>&1 && DEBIAN_FRONTEND=noninteractive apt-get install -y -q chromium chromium-driver >/dev/null 2>&1; } || \
		echo "WARNING: could not install chromium + chromium-driver: the browser tests (dashboard, training) will be SKIPPED"; \
	else echo "WARNING: no apt-get: the browser tests (dashboard, training) will be SKIPPED"; fi
	@if grep -qs '"version": "$(ORTWEB_VERSION)"' $(ORTWEB_DIR)/node_modules/onnxruntime-web/package.json && \
		[ -f $(ORTWEB_DIST)/ort.wasm.min.js ] && [ -f $(ORTWEB_DIST)/ort-wasm-simd-threaded.wasm ]; then :; \
	elif command -v npm >/dev/null 2>&1 && mkdir -p $(ORTWEB_DIR) && \
		npm install --prefix $(ORTWEB_DIR) onnxruntime-web@$(ORTWEB_VERSION) --save-exact --no-audit --no-fund --silent >/dev/null 2>&1; then :; \
	else echo "WARNING: could not install onnxruntime-web@$(ORTWEB_VERSION) with npm into $(ORTWEB_DIR): the browser training test will be SKIPPED"; fi

# The suite runs on TEST_WORKERS pytest-xdist processes (its deployment tests partly wait on
# processes and sockets, so more workers than cores pay): tests are handed out one by one, and
# files that share state outside their tmp_path stay on one worker in named groups (tests/conftest.py). TEST_WORKERS=0,
# or no xdist in the venv, runs it in this one process. The 25 slowest tests are printed.
TEST_WORKERS ?= 4
test: $(STAMP) browser
	$(PY) -m pytest -q --durations=25 $$(test "$(TEST_WORKERS)" != 0 && $(PY) -c 'import xdist' 2>/dev/null && \
		echo "-n $(TEST_WORKERS) --dist loadgroup --no-loadscope-reorder")

test-fast: $(STAMP)
	$(PY) -m pytest -q -m "not slow"

lint: $(STAMP)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/mypy core server clients edge strategies simulation cli task web

bench: $(STAMP)
	$(PY) bench/sim_vs_flower.py
