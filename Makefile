# The two commands of the README: `make demo` and `make test`. Each builds .venv if missing.
PY ?= python3
VENV := .venv
VPY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: demo test test-fast lint bench clean
# Test processes (pytest-xdist), whole files to a process: a file's module fixtures run once. CI
# has 2 cores and the suite is mostly one busy core (compiles, solver): 2 processes ~1.5x faster.
# A crashed worker is not replaced: xdist 3.8's loadfile scheduling then hangs for good
# (pytest-xdist#784); the run ends with that test failed and named instead.
TEST_WORKERS ?= 2
PYTEST := $(VPY) -m pytest -q -n $(TEST_WORKERS) --dist loadfile --max-worker-restart=0

$(STAMP): pyproject.toml
	test -x $(VPY) || $(PY) -m venv $(VENV)
	$(VPY) -m pip install -q --upgrade pip
	# Pin the dev environment to the CPU wheel of the torch we test (an unpinned torch pulls CUDA).
	$(VPY) -m pip install -q torch==2.13.0
	$(VPY) -m pip install -q -e '.[test]'
	touch $(STAMP)

demo: $(STAMP)
	$(VPY) benchmarks/demo.py

test: $(STAMP)
	$(PYTEST)

# ruff (style and likely bugs, all code) and mypy (types of the plain-data core): pyproject.toml.
lint: $(STAMP)
	$(VPY) -m ruff check .
	$(VPY) -m mypy

test-fast: $(STAMP)
	$(PYTEST) -m "not inductor"

clean:
	rm -rf $(VENV) build *.egg-info
