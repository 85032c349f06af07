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

.PHONY: setup demo demo-embedded test setup-pythons test-pythons test-fallback test-asan lint fmt bench bench-report clean

# Interpreters besides the venv's 3.11 that the suite must pass on (python3.X on PATH or
# installed by pyenv: tools/setup/find_python.sh).
PYTHONS := 3.12 3.13
# The tests of the C extensions and their callers, for the AddressSanitizer run.
NATIVE_TESTS := tests/native tests/dstl/test_records.py tests/dstl/test_durable.py \
	tests/dstl/test_encoder.py tests/backends/test_heapstate.py \
	tests/backends/test_changelog_fastpath.py tests/backends/test_column_store.py
# What `make test` runs on $(PYTHONS): the layers where interpreter versions differ (the C
# extensions and everything that calls them), about a minute each. The coordinator and the
# tools above them are plain Python over these; `make test-pythons` runs them too.
PYTHONS_TESTS := tests/native tests/dstl tests/backends tests/materializer \
	tests/test_import_direction.py

setup:
	bash tools/setup/bootstrap.sh test

# The main job on Spark (local[2]); the same job on the embedded runtime: demo-embedded.
# The demo needs no PostgreSQL and no test tools (bootstrap.sh demo).
demo:
	bash tools/setup/bootstrap.sh demo
	$(PY) -m tools.spark.demo

demo-embedded:
	bash tools/setup/bootstrap.sh demo
	$(PY) -m tools.demo

# Lint, the whole pytest suite (every marker), then the layers below the coordinator on the
# other interpreters (test-pythons with PYTHONS_TESTS). All steps run; any failure fails
# the target, and the failed tests of every interpreter are listed again last (pytest's
# logs are in build/test-logs/), so the tail of a CI log names them. CI runs this on 2
# cores: keep it well under 20 minutes. Two lanes side by side, each about a core's worth
# of work:
# - the 3.11 suite but for SLOW_TESTS, whose Spark tests use ~1.7 cores;
# - SLOW_TESTS (the crash tests and the soak: chains of worker processes on about one
#   core), then the other interpreters' tests, one interpreter at a time. Their venvs are
#   made in the background from the start (setup-pythons, ~2 min of pip each, output in
#   build/test-logs/setup-pythons.txt); a lock makes the lane wait for that. This lane's
#   output is shown after the other's.
# One after the other, the 3.11 suite took 14 min 11 s, then 1.5 min for the interpreters
# side by side (fresh-clone CI 18 min 45 s). Slow tests beside the rest: 15 min 21 s and
# 17 min 5 s, the rest's lane 2-2.5 min longer than the slow tests. These two lanes:
# 15 min 35 s (12 min 35 s, and 9 min 16 s + 2 min 21 s + 1 min 58 s). pytest-xdist with 2
# workers was no faster than one process (14 min 53 s): it ran two Spark sessions at
# once; the interpreters' tests beside the whole suite slowed it (17 min 34 s).
SLOW_TESTS := slow and not spark
test: setup
	@failed=""; \
	mkdir -p build/test-logs; rm -f build/test-logs/*.log build/test-logs/*.txt; \
	flock build/test-logs/pythons.lock $(MAKE) --no-print-directory setup-pythons \
		>build/test-logs/setup-pythons.txt 2>&1 & pythons=$$!; \
	echo "+ ruff check ."; $(RUFF) check . || failed="$$failed ruff-check"; \
	echo "+ ruff format --check ."; $(RUFF) format --check . || failed="$$failed ruff-format"; \
	echo "+ mypy"; $(MYPY) || failed="$$failed mypy"; \
	{ $(PY) -m pytest -q -p no:cacheprovider -m "$(SLOW_TESTS)" \
		>build/test-logs/pytest-3.11-slow.log 2>&1 || echo pytest-slow >>build/test-logs/lane-failed.txt; \
	  for v in $(PYTHONS); do \
		flock build/test-logs/pythons.lock $(MAKE) --no-print-directory test-pythons PYTHONS=$$v \
			TESTS="$(PYTHONS_TESTS)" >build/test-logs/test-python$$v.txt 2>&1 \
			|| echo "test-pythons-$$v" >>build/test-logs/lane-failed.txt; \
	  done; } & lane=$$!; \
	echo "+ pytest -q -m 'not ($(SLOW_TESTS))'; beside it -m '$(SLOW_TESTS)', then $(PYTHONS)"; \
	$(PY) -m pytest -q -m "not ($(SLOW_TESTS))" 2>&1 | tee build/test-logs/pytest-3.11.log \
		|| failed="$$failed pytest"; \
	echo "+ [beside it] pytest -q -m '$(SLOW_TESTS)'"; \
	wait $$lane || true; \
	cat build/test-logs/pytest-3.11-slow.log; cat build/test-logs/test-python*.txt 2>/dev/null || true; \
	lane_failed="$$(paste -sd' ' build/test-logs/lane-failed.txt 2>/dev/null || true)"; \
	[[ -z "$$lane_failed" ]] || failed="$$failed $$lane_failed"; \
	wait $$pythons || echo "setup-pythons failed in the background (build/test-logs/setup-pythons.txt); test-pythons tried again"; \
	if [[ -n "$$failed" ]]; then \
		echo "make test: FAILED:$$failed" >&2; \
		grep -hE '^(FAILED|ERROR) ' build/test-logs/*.log >&2 || true; \
		exit 1; \
	fi; \
	echo "make test: all passed"

# The venvs .venv-3.12, .venv-3.13 of $(PYTHONS), made like .venv (same constraints; the C
# extensions built for each interpreter, next to the 3.11 ones); one after the other, as
# each editable install rewrites the tree's egg-info.
setup-pythons:
	@failed=""; \
	for v in $(PYTHONS); do \
		py="$$(bash tools/setup/find_python.sh $$v)" || { failed="$$failed $$v-missing"; continue; }; \
		BOOTSTRAP_VENV=.venv-$$v PYTHON="$$py" bash tools/setup/bootstrap.sh || failed="$$failed $$v-setup"; \
	done; \
	if [[ -n "$$failed" ]]; then echo "make setup-pythons: FAILED:$$failed" >&2; exit 1; fi

# The non-Spark suite (or TESTS=paths) on each of $(PYTHONS) (setup-pythons first), the
# interpreters side by side (each runs its tests on one core; their output is shown once
# both are done). The slow end-to-end tests (soak, corruption matrix) run once, on 3.11:
# they exercise the same Python code, and the native code they reach is covered here by
# its own tests.
test-pythons:
	@failed=""; ready=""; pids=""; \
	mkdir -p build/test-logs; \
	for v in $(PYTHONS); do \
		py="$$(bash tools/setup/find_python.sh $$v)" || { failed="$$failed $$v-missing"; continue; }; \
		BOOTSTRAP_VENV=.venv-$$v PYTHON="$$py" bash tools/setup/bootstrap.sh || { failed="$$failed $$v-setup"; continue; }; \
		ready="$$ready $$v"; \
	done; \
	for v in $$ready; do \
		.venv-$$v/bin/python -m pytest -q -p no:cacheprovider -m "not spark and not slow" $(TESTS) \
			>build/test-logs/pytest-$$v.log 2>&1 & pids="$$pids $$!"; \
	done; \
	set -- $$pids; \
	for v in $$ready; do \
		echo "+ [python$$v] pytest -q -m 'not spark and not slow' $(TESTS)"; \
		wait "$$1" || failed="$$failed $$v"; shift; \
		cat build/test-logs/pytest-$$v.log; \
	done; \
	if [[ -n "$$failed" ]]; then echo "make test-pythons: FAILED:$$failed" >&2; exit 1; fi

# The whole suite with the pure-Python twins of the C extensions forced (~2.5 min). Not
# part of `test`, whose native tests run both implementations side by side already.
test-fallback: setup
	CHANGELOG_STATE_PURE_PYTHON=1 $(PY) -m pytest -q

# The native tests and a long fuzz run with the C extensions built under AddressSanitizer,
# in a copy of the tree (build/asan; see tools/setup/build_asan.py). CPython itself is not
# sanitized: libasan is preloaded, and Python objects go through its malloc.
test-asan: setup
	$(PY) tools/setup/build_asan.py build/asan
	cd build/asan && \
	export LD_PRELOAD="$$(gcc -print-file-name=libasan.so)" ASAN_OPTIONS=detect_leaks=0 \
		PYTHONMALLOC=malloc && \
	$(abspath $(PY)) -m pytest -q -p no:cacheprovider $(NATIVE_TESTS) && \
	$(abspath $(PY)) -X faulthandler -m tests.native.fuzz 2000

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

# docs/bench/ (Markdown tables, PNG plots) and the README's headline block from the newest
# result of each benchmark in bench-results/*.json (`make bench`, or any `run --json` there).
bench-report: setup
	$(PY) -m tools.bench report bench-results/*.json

clean:
	rm -rf build dist *.egg-info .pytest_cache .mypy_cache .ruff_cache .hypothesis bench-results demo-data
	find . -path './.venv*' -prune -o -type d -name __pycache__ -prune -exec rm -rf {} +
