# Two commands do everything on a fresh machine:
#   make demo   — set up, then run real verl (main_ppo, GRPO, CPU) twice: cache miss, then hit
#   make test   — set up, then run the whole test suite (end-to-end runs included)
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
PLUGINS := $(sort $(dir $(wildcard plugins/*/pyproject.toml)))
STAMP  := $(VENV)/.skipinject-installed

.PHONY: setup demo test test-fast test-verl-matrix venv-verl example bench lint clean

setup: $(STAMP)

# torch first, from the pinned CPU wheel (an unpinned torch pulls a multi-GB CUDA build), then
# the exact lock without resolution (verl's own pins conflict with what it really needs on CPU).
$(STAMP): requirements/lock.txt pyproject.toml $(wildcard plugins/*/pyproject.toml)
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q torch==2.13.0
	$(BIN)/python -m pip install -q --no-deps -r requirements/lock.txt
	$(BIN)/python -m pip install -q --no-deps --no-build-isolation -e . $(addprefix -e ,$(PLUGINS))
	touch $@

demo: setup
	$(BIN)/python examples/verl_cpu/demo.py

test: setup
	$(BIN)/python -m pytest -q --durations=20

# An older verl's environment, .venvs/verl-$(VERL), from requirements/verl-$(VERL).txt (idempotent).
# `make test` builds the ones its verl matrix tests need by itself.
VERL ?= 0.8.0
venv-verl:
	$(PYTHON) tests/verl_matrix/envs.py $(VERL)

# Only the older-verl runs; SKIPINJECT_VERL_MATRIX=all (or a comma list) picks the versions.
test-verl-matrix: setup
	$(BIN)/python -m pytest -q --durations=20 -m verl_matrix

test-fast: setup
	$(BIN)/python -m pytest -q -m "not e2e"

example: setup
	$(BIN)/python examples/toy/run_example.py

bench: setup
	$(BIN)/python benchmarks/bench_store.py

lint: setup
	$(BIN)/ruff check . && $(BIN)/ruff format --check .

clean:
	rm -rf $(VENV) .venvs .demo .pytest_cache .ruff_cache
