# Fresh machine: `make quickstart` (the main job: a small GRPO run on CPU) and `make test` (lint and the test suite) set up .venv on first use.
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.megarl-installed
# with the development tools and the tests' references (scripts/setup.sh --test)
TEST_STAMP := $(VENV)/.megarl-test-installed

.PHONY: setup demo quickstart learn learn-gsm learn-calculator test test-unit test-distributed test-e2e lint format bench

$(STAMP): pyproject.toml scripts/setup.sh
	bash scripts/setup.sh

$(TEST_STAMP): pyproject.toml scripts/setup.sh
	bash scripts/setup.sh --test

setup: $(STAMP)

demo: $(STAMP)
	$(VENV)/bin/megarl demo --model tiny-qwen2 --nproc 4 --tp 2 --pp 2

lint: $(TEST_STAMP)
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/ruff check .
	$(VENV)/bin/mypy

# Both tiers on two workers. Unit tests are single-threaded and independent. The multi-process
# tiers give each rank one thread and spend most of a launch importing and starting up on one
# core, so two at a time keep both cores busy; tests that share a module fixture (one launch
# checked by several tests) or a Ray cluster carry an xdist_group mark and run on one worker.
test: lint
	$(PY) -m pytest -q -m unit -n 2 --durations=5
	$(PY) -m pytest -q -m "not unit" -n 2 --dist loadgroup --durations=15

test-unit: $(TEST_STAMP)
	$(PY) -m pytest -q -m unit -n 2

test-distributed: $(TEST_STAMP)
	$(PY) -m pytest -q -m distributed -n 2 --dist loadgroup

test-e2e: $(TEST_STAMP)
	$(PY) -m pytest -q -m e2e -n 2 --dist loadgroup

format: $(TEST_STAMP)
	$(VENV)/bin/ruff format .
	$(VENV)/bin/ruff check --fix .

bench: $(TEST_STAMP)
	$(PY) -m bench.train_step

quickstart: $(STAMP)
	$(PY) -m megarl.quickstart --out outputs/quickstart
	$(VENV)/bin/megarl train configs/quickstart_cpu.yaml --nproc-per-node 1

learn: $(STAMP)
	$(PY) -m megarl.quickstart --recipe arithmetic --out outputs/learn_arithmetic
	$(VENV)/bin/megarl train configs/smollm2_arithmetic_cpu.yaml --nproc-per-node 1

learn-gsm: $(STAMP)
	$(PY) -m megarl.quickstart --recipe gsm --out outputs/learn_gsm
	$(VENV)/bin/megarl train configs/smollm2_gsm_cpu.yaml --nproc-per-node 1

learn-calculator: $(STAMP)
	$(PY) -m megarl.quickstart --recipe calculator --out outputs/learn_calculator
	$(VENV)/bin/megarl train configs/smollm2_calculator_cpu.yaml --nproc-per-node 1
