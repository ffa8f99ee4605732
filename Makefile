# Fresh machine: `make demo` or `make test`. Everything is installed into .venv from nothing.
PYTHON ?= python3
VENV   ?= .venv
TORCH  ?= torch==2.13.0
# e.g. TORCH_PIP_ARGS="--index-url https://download.pytorch.org/whl/cpu" for the CPU build from PyTorch's index
TORCH_PIP_ARGS ?=
PY      = $(VENV)/bin/python
PIP     = $(PY) -m pip
STAMP   = $(VENV)/.geomesh-installed

.PHONY: setup browser demo test test-quick lint format bench protos clean

setup: $(STAMP)

# Re-runs only when the dependency list changes; torch goes in first so that nothing pulls a CUDA build.
# Quiet: -q, and no "new pip available" notice. Left as they are: pip's "Location ... is ignored" lines (a pip
# config's find-links / file:// index that lacks a package: the machine's, not this file's) and setuptools'
# "Editable installation" notice (a flat layout of several packages; silencing it would change the install).
$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) install -q --disable-pip-version-check --upgrade pip
	$(PIP) install -q --disable-pip-version-check $(TORCH_PIP_ARGS) "$(TORCH)"
	$(PIP) install -q --disable-pip-version-check -e ".[test]"
	touch $(STAMP)

demo: setup
	$(VENV)/bin/geomesh-peer demo --workdir runs/demo --summary-json runs/demo/summary.json

# Headless Chromium + its driver (status page browser test) and libfaketime (clock-skew tests), Debian packages installed only when
# missing. Without root or a package mirror the install fails, and that test is skipped saying why.
browser:
	@command -v chromium >/dev/null 2>&1 && command -v chromedriver >/dev/null 2>&1 && \
	  test -e /usr/lib/x86_64-linux-gnu/faketime/libfaketime.so.1 || \
	  (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium chromium-driver libfaketime >/dev/null) || \
	  echo "make: could not install chromium + chromium-driver + libfaketime: the browser and clock-skew tests will be skipped"

# `make lint` first (its findings stop here), then the suite in TEST_WORKERS pytest-xdist workers (3 by default;
# 0: one process), the slowest 25 tests listed at the end. Each file's tests run in one worker, and a free worker
# takes the longest file still waiting (tests/conftest.py: pytest_xdist_make_scheduler), so the process swarms of
# tests/e2e start first and the short unit files fill the last gaps. On 2 cores, fresh clone: 10 min 15 s - 13 min 3 s with 3
# workers (session 12, 1,193 tests; 12 min 39 s in session 11 before the e2e peers ran at half speed), ~21 min
# serially. The e2e tier is CPU-bound there: more workers do not help (4 made two namespace tests fail; session 40:
# the cores 97-100 % busy through a whole run with 4). Session 40, 2,024 tests: 10 min 36 s and 11 min 53 s (12 min 14 s before the
# e2e peers evaluated 2 batches instead of 8); a test peer's largest CPU share is verified work's screens.
TEST_WORKERS ?= 3
# PYTHONDONTWRITEBYTECODE is emptied for the suite (set to 1 on some CI machines): with it every peer process of
# the e2e tier compiled the project's modules again (~0.4 s each here) and pytest rewrote every test file's asserts
# in each worker (~7 s a worker).
test: setup browser lint
	PYTHONDONTWRITEBYTECODE= $(VENV)/bin/pytest -q -n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder --durations=25 tests/unit tests/integration tests/e2e

# The first two tiers: tests/unit (no sockets) and tests/integration (in-process gRPC on 127.0.0.1); no
# processes, no browser.
test-quick: setup
	$(VENV)/bin/pytest -q tests/unit tests/integration

# Lint (rules in pyproject.toml's [tool.ruff.lint]: real defects, not style), the format check (ruff's
# formatter, line length 120; `make format` applies it), types of the library (mypy, [tool.mypy]), the
# package layers (lint-imports, [tool.importlinter]) and the layout rules (scripts/check_layout.py: no file
# over 800 lines, no project import inside a function); all five run, and any one's findings fail the target.
LINT_PATHS = geomesh_p2p peer bootstrap tests benchmarks scripts
lint: setup
	r=0; $(VENV)/bin/ruff check $(LINT_PATHS) || r=1; \
	  $(VENV)/bin/ruff format --check $(LINT_PATHS) || r=1; \
	  $(VENV)/bin/mypy geomesh_p2p || r=1; \
	  $(VENV)/bin/lint-imports --no-logo || r=1; \
	  $(PY) scripts/check_layout.py || r=1; \
	  exit $$r

format: setup
	$(VENV)/bin/ruff format $(LINT_PATHS)

bench: setup
	for f in benchmarks/*.py; do echo "== $$f"; $(PY) $$f || exit 1; done

protos: setup
	$(PY) -m geomesh_p2p.wire.generate

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache
