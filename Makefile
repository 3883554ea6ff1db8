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
# other tests instead of holding one while the other waits. Two pytest-xdist workers keep both
# cores busy (most tests use one); tests/conftest.py groups the tests so a file's tests share a
# worker and the cluster's tests run last, in one worker. A third worker (-n 3) was 6% faster
# on one 2-core VM but 6% slower on CI's, where a replay test then lost frames to the load.
PYTEST_PARALLEL ?= -n 2 --dist loadgroup --no-loadscope-reorder
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
