# adcloud developer commands. `make demo` runs the main job, `make test` the whole test suite;
# both install what is missing first (scripts/install.sh is fast when nothing is).

VENV   := .venv
PYTHON := $(VENV)/bin/python
# Extra pytest options, e.g. `make test PYTEST_ARGS='-m "not cluster" -x'`.
PYTEST_ARGS ?=

.PHONY: install demo test lint ruff bench

install:
	bash scripts/install.sh

demo: install
	$(VENV)/bin/adcloud demo

# Ruff first (seconds), then pytest, which exits non-zero on failures and with 5 when no test
# was collected: any of them fails `make`. mypy --strict (~1.5 min of one core from a cold
# cache) runs inside pytest, as tests/test_typing.py, so it shares the two cores with the
# other tests instead of holding one while the other waits. Three pytest-xdist workers on two
# cores: most tests use one core, and many spend part of their time waiting (for a JVM, a ROS
# node, a timeout they test); a third worker fills those gaps (26.2 min of pytest instead of
# 27.9 on a 2-core VM, same tests passing). tests/conftest.py groups the tests so a file's
# tests share a worker and the cluster's tests run last, in one worker.
PYTEST_PARALLEL ?= -n 3 --dist loadgroup --no-loadscope-reorder
test: install ruff
	$(PYTHON) -m pytest -q $(PYTEST_PARALLEL) --durations=15 $(PYTEST_ARGS)

# ruff, formatting and mypy --strict
lint: ruff
	$(VENV)/bin/mypy

ruff: install
	$(VENV)/bin/ruff check adcloud tests benchmarks
	$(VENV)/bin/ruff format --check adcloud tests benchmarks

bench: install
	@if [ -f benchmarks/run_all.py ]; then \
		$(PYTHON) benchmarks/run_all.py; \
	else \
		echo "no benchmarks/run_all.py yet: nothing to run"; \
	fi
