# Entry points: `make demo` and `make test` (see README.md). Every target that runs Python
# first runs tools/setup/bootstrap.sh, which is idempotent and takes ~0.1 s when nothing changed.
SHELL := /bin/bash
.SHELLFLAGS := -eu -o pipefail -c
.DEFAULT_GOAL := test

VENV := .venv
PY   := $(VENV)/bin/python
RUFF := $(VENV)/bin/ruff
MYPY := $(VENV)/bin/mypy

export SPARK_LOCAL_IP := 127.0.0.1
export PYTHONHASHSEED := 0

.PHONY: setup demo demo-embedded test lint fmt bench clean

setup:
	bash tools/setup/bootstrap.sh

# The main job on Spark (local[2]); the same job on the embedded runtime: demo-embedded.
demo: setup
	$(PY) -m tools.demo_spark

demo-embedded: setup
	$(PY) -m tools.demo

# Lint and the whole pytest suite (every marker). All steps run; any failure fails the target.
test: setup
	@failed=""; \
	echo "+ ruff check ."; $(RUFF) check . || failed="$$failed ruff-check"; \
	echo "+ ruff format --check ."; $(RUFF) format --check . || failed="$$failed ruff-format"; \
	echo "+ mypy"; $(MYPY) || failed="$$failed mypy"; \
	echo "+ pytest -q"; $(PY) -m pytest -q || failed="$$failed pytest"; \
	if [[ -n "$$failed" ]]; then echo "make test: FAILED:$$failed" >&2; exit 1; fi; \
	echo "make test: all passed"

lint: setup
	$(RUFF) check .
	$(RUFF) format --check .
	$(MYPY)

fmt: setup
	$(RUFF) check --fix .
	$(RUFF) format .

bench: setup
	mkdir -p bench-results
	$(PY) -m tools.bench run all --quick --json bench-results/latest.json

clean:
	rm -rf build dist *.egg-info .pytest_cache .mypy_cache .ruff_cache .hypothesis bench-results demo-data
	find . -path ./.venv -prune -o -type d -name __pycache__ -prune -exec rm -rf {} +
