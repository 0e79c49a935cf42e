# Two commands do everything on a fresh machine:
#   make demo   — set up, then run real verl (main_ppo, GRPO, CPU) twice: cache miss, then hit
#   make test   — set up, then run the whole test suite (end-to-end runs included)
# Test tiers (conftest.py): test-unit (no verl/Ray/pip, < 2 min), test-integration, test-e2e.
# make lint needs no full setup: ruff + mypy from requirements/lint.txt in their own small venv.
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
PLUGINS := $(sort $(dir $(wildcard plugins/*/pyproject.toml)))
STAMP  := $(VENV)/.skipinject-installed
LINT_VENV  := .venv-lint
LINT_STAMP := $(LINT_VENV)/.installed
PYTEST := $(BIN)/python -m pytest
# Distributions of older set-ups whose roles now ship inside skipinject's own wheel.
OBSOLETE_DISTS := skipinject-rollout skipinject-rollout-tq
BUILD_STAMP := $(VENV)/.build-installed
DIST := dist
# The unit tier by directory (plugins' verl-free tests go in plugins/<name>/tests/unit/; tests/reliability
# keeps its few integration tests by marker).
UNIT_PATHS := tests/unit tests/reliability $(wildcard plugins/*/tests/unit)

.PHONY: setup dist demo test test-unit test-integration test-e2e test-fast test-verl-matrix venv-verl example bench lint clean

setup: $(STAMP)

# torch first, from the pinned CPU wheel (an unpinned torch pulls a multi-GB CUDA build), then
# the exact lock without resolution (verl's own pins conflict with what it really needs on CPU).
$(STAMP): requirements/lock.txt pyproject.toml $(wildcard plugins/*/pyproject.toml)
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q torch==2.13.0
	$(BIN)/python -m pip install -q --no-deps -r requirements/lock.txt
	$(BIN)/python -m pip uninstall -q -y $(OBSOLETE_DISTS) 2>/dev/null || true
	$(BIN)/python -m pip install -q --no-deps --no-build-isolation -e . $(addprefix -e ,$(PLUGINS))
	touch $@

# Release artefacts: an sdist and a wheel of every distribution (skipinject, whose wheel holds the
# built-in roles, and each plugins/*) in dist/, built from the sdists as a release is; no network
# (hatchling is in the lock, build from requirements/build.txt).
$(BUILD_STAMP): requirements/build.txt | $(STAMP)
	$(BIN)/python -m pip install -q --no-deps -r requirements/build.txt
	touch $@

dist: setup $(BUILD_STAMP)
	rm -rf $(DIST)
	$(BIN)/python -m build --no-isolation --outdir $(DIST) .
	for plugin in $(PLUGINS); do $(BIN)/python -m build --no-isolation --outdir $(DIST) $$plugin || exit 1; done

demo: setup
	$(BIN)/python examples/verl_cpu/demo.py

# Two streams side by side, together every test: the end-to-end runs of real verl one at a time
# (a run keeps about one core busy: its Ray actors start one after another, each importing verl),
# and every other test one at a time beside them (its output is printed when both are done). Each
# stream fails on its own; `make test` fails if either does.
PARALLEL := -n 2 --dist loadfile -m "not e2e and not ray"
REST_LOG := .pytest-rest.log
test: setup
	@$(PYTEST) -q -p no:cacheprovider --durations=10 -m "not e2e" > $(REST_LOG) 2>&1 & rest=$$!; \
	trap 'kill $$rest 2>/dev/null' INT TERM; \
	$(PYTEST) -q --durations=20 -m e2e; e2e=$$?; \
	wait $$rest; rest=$$?; \
	echo "== every test but the end-to-end runs (beside them):"; cat $(REST_LOG); \
	echo "== end-to-end runs: exit $$e2e; every other test: exit $$rest"; \
	test $$e2e = 0 && test $$rest = 0

test-unit: setup
	$(PYTEST) -q -m unit $(UNIT_PATHS)

test-integration: setup
	$(PYTEST) -q --durations=10 -m integration

test-e2e: setup
	$(PYTEST) -q --durations=10 -m e2e tests/e2e

# An older verl's environment, .venvs/verl-$(VERL), from requirements/verl-$(VERL).txt (idempotent).
# `make test` builds the ones its verl matrix tests need by itself.
VERL ?= 0.8.0
venv-verl:
	$(PYTHON) tests/verl_matrix/envs.py $(VERL)

# Only the older-verl runs; SKIPINJECT_VERL_MATRIX=all (or a comma list) picks the versions.
test-verl-matrix: setup
	$(BIN)/python -m pytest -q --durations=20 -m verl_matrix

# Everything but the end-to-end runs: the tests that start no Ray cluster on both cores (pytest-xdist;
# a file's tests stay on one worker), then the Ray tests one at a time.
test-fast: setup
	$(PYTEST) -q $(PARALLEL)
	$(PYTEST) -q -m "ray and not e2e"

example: setup
	$(BIN)/python examples/toy/run_example.py

bench: setup
	$(BIN)/python benchmarks/bench_store.py

$(LINT_STAMP): requirements/lint.txt
	test -x $(LINT_VENV)/bin/python || $(PYTHON) -m venv $(LINT_VENV)
	$(LINT_VENV)/bin/python -m pip install -q --no-deps -r requirements/lint.txt
	touch $@

lint: $(LINT_STAMP)
	$(LINT_VENV)/bin/ruff check .
	$(LINT_VENV)/bin/ruff format --check .
	$(LINT_VENV)/bin/mypy

clean:
	rm -rf $(VENV) $(LINT_VENV) .venvs .demo $(DIST) .pytest_cache .ruff_cache .mypy_cache
