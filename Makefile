# Relax: `make run` sets up and runs the main workflow; `make test` sets up and runs the tests.
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.relax-setup

export RAY_AUTH_MODE := disabled
export HF_HUB_OFFLINE := 1
export TRANSFORMERS_OFFLINE := 1

.PHONY: setup run check-readme test test-fast test-gpu bench lint format docs clean

setup: $(STAMP)

# infra/setup.sh installs torch first, pinned (a bare torch requirement pulls a multi-GB CUDA build).
$(STAMP): pyproject.toml infra/setup.sh
	PYTHON=$(PYTHON) VENV=$(VENV) infra/setup.sh
	touch $(STAMP)

# a fresh ./.relax (first run, or deleted by hand): Flyte's local cache may still name paths
# under the old one, so cached tasks run again
run: setup
	$(BIN)/pyflyte run $$([ -d .relax ] || echo --overwrite-cache) workflows/omni_rl.py omni_rl

# after `make run`: does README.md's accuracy table still print what the run printed?
check-readme: setup
	$(BIN)/python -m relax.services.report.accuracy README.md .relax/runs/omni-cpu/report/accuracy.json

# every test but the gpu ones, as two pytest sessions side by side (infra/run_tests.py)
test: setup
	$(BIN)/python infra/run_tests.py $(PYTEST_ARGS)

# the quick lane while editing: neither the slow tests (make test runs them) nor the GPU ones
test-fast: setup
	$(BIN)/pytest -m "not slow and not gpu" $(PYTEST_ARGS)

test-gpu: setup
	$(BIN)/pytest -m gpu $(PYTEST_ARGS)

bench: setup
	$(BIN)/python benchmarks/run_all.py $(BENCH_ARGS)  # BENCH_ARGS=--quick: short variants; --update-docs: publish results

lint: setup
	$(BIN)/ruff check .

format: setup
	$(BIN)/ruff format . && $(BIN)/ruff check --fix .

docs: setup
	$(BIN)/relax config docs > docs/configuration.md

clean:
	rm -rf .relax .pytest_cache build *.egg-info
