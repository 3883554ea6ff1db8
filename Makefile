# adcloud developer commands. `make demo` runs the main job, `make test` the whole test suite;
# both install what is missing first (scripts/install.sh is fast when nothing is).

VENV   := .venv
PYTHON := $(VENV)/bin/python
# Extra pytest options, e.g. `make test PYTEST_ARGS='-m "not cluster" -x'`.
PYTEST_ARGS ?=

.PHONY: install demo test lint bench

install:
	bash scripts/install.sh

demo: install
	$(VENV)/bin/adcloud demo

# Lint first (ruff, formatting, mypy --strict: ~1 min), then pytest, which exits non-zero on
# failures and with 5 when no test was collected: any of them fails `make`. Two pytest-xdist
# workers keep both cores busy (most tests use one); tests/conftest.py groups the tests so a
# file's tests share a worker and the cluster's tests run last, in one worker.
PYTEST_PARALLEL ?= -n 2 --dist loadgroup --no-loadscope-reorder
test: install lint
	$(PYTHON) -m pytest -q $(PYTEST_PARALLEL) --durations=15 $(PYTEST_ARGS)

lint: install
	$(VENV)/bin/ruff check adcloud tests benchmarks
	$(VENV)/bin/ruff format --check adcloud tests benchmarks
	$(VENV)/bin/mypy

bench: install
	@if [ -f benchmarks/run_all.py ]; then \
		$(PYTHON) benchmarks/run_all.py; \
	else \
		echo "no benchmarks/run_all.py yet: nothing to run"; \
	fi
