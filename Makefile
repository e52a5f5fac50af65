# OpenTinker: `make demo` starts the whole service on embedded defaults and runs a demo job;
# `make test` runs the test suite (embedded defaults, then PostgreSQL + Redis when they answer).
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(VENV)/bin/pip
STAMP := $(VENV)/.installed
PG_URL ?= postgres://postgres@127.0.0.1:5432/test
REDIS_SERVER_URL ?= redis://127.0.0.1:6379/0

.PHONY: java demo serve test test-fast test-embedded test-engine test-services test-verl test-verl-multinode test-lane-a test-lane-b install model datasets bench lint clean verl-env

demo: install
	$(PY) manage.py demo

serve: install
	$(PY) manage.py serve

install: $(STAMP)

# torch is pinned and installed first so that pip takes the CPU build from local disk.
$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	$(PIP) install -q torch==2.13.0
	$(PIP) install -q -e '.[test,envs]'
	$(PIP) install -q --no-deps tinker-cookbook==0.6.1
	touch $(STAMP)

# verl's own venv (docs/verl.md): pinned, stamped with a hash of its pins, so a rerun with
# unchanged pins does nothing. The path follows OPENTINKER_VERL_VENV when that is set.
verl-env:
	bash scripts/build_verl_env.sh

# Java 17 for the scienceworld environment (a Debian package; needs root or sudo).
java:
	bash scripts/install_java.sh

model: install
	$(PY) scripts/build_tiny_model.py

datasets: install
	$(PY) scripts/build_datasets.py

# Two lanes side by side: lane A the embedded pass less the engine's tests, lane B the pass
# against PostgreSQL + Redis and then the engine's tests (which touch neither); the real
# verl jobs (minutes each; on the embedded defaults) are split between the lanes so that
# both take about as long. Their live tests spend much of their time waiting on worker
# subprocesses that train on one thread, so two lanes fill two cores. Each run has its own
# data directory (dataset files are named by row id, which the databases reuse). The verl
# venv is built first (a no-op when its pins are unchanged); where it cannot be built the
# verl tests skip, as the browser tests do without Chromium. The verl job across two nodes (a
# Ray cluster of two nodes on this host, two vLLM servers, ~8 min, ~10 GiB) is not part of
# `make test` (it would take CI past its time budget): `make test-verl-multinode` runs it.
VERL_LANE_A := gomoku or vllm or sft
VERL_ALONE := two_nodes
test: install
	bash scripts/install_browser.sh || echo "Chromium not installed: the browser tests will be skipped"
	bash scripts/install_java.sh || echo "Java not installed: the scienceworld tests will be skipped"
	$(MAKE) verl-env || echo "the verl venv could not be built: the verl tests will be skipped"
	$(MAKE) -j2 --output-sync=target test-lane-a test-lane-b

test-verl-multinode: install verl-env
	$(MAKE) --no-print-directory test-verl VERL_K="$(VERL_ALONE)" VERL_DATA=test-verl-alone

# pytest on the embedded defaults, in the data directory var/$(1).
embedded_pytest = env -u DATABASE_URL -u REDIS_URL OPENTINKER_DATA_DIR=$(CURDIR)/var/$(1) \
	$(PY) -m pytest -q --durations=15

# EMBEDDED_ARGS: more pytest arguments (lane A leaves the engine's tests to lane B).
EMBEDDED_ARGS ?=
test-embedded:
	$(call embedded_pytest,test-embedded) -m "not verl" $(EMBEDDED_ARGS)

# The engine's tests (tests/training): no database or Redis, on the embedded defaults.
test-engine:
	$(call embedded_pytest,test-engine) -m "not verl" tests/training

# verl's real trainer (tests marked `verl`), on the embedded defaults; VERL_K picks some.
# The lanes run theirs at the same time, each in its own data directory (and SQLite file).
VERL_K ?=
VERL_DATA ?= test-verl
test-verl:
	$(call embedded_pytest,$(VERL_DATA)) -m verl $(if $(VERL_K),-k "$(VERL_K)")

# Each lane runs both of its parts even when the first fails, and fails if either did.
test-lane-a:
	@$(MAKE) --no-print-directory test-embedded EMBEDDED_ARGS=--ignore=tests/training; first=$$?; \
		$(MAKE) --no-print-directory test-verl VERL_K="$(VERL_LANE_A)" VERL_DATA=test-verl-a; second=$$?; \
		test $$first -eq 0 -a $$second -eq 0

test-lane-b:
	@$(MAKE) --no-print-directory test-services; first=$$?; \
		$(MAKE) --no-print-directory test-engine; second=$$?; \
		$(MAKE) --no-print-directory test-verl VERL_K="not ($(VERL_LANE_A) or $(VERL_ALONE))" VERL_DATA=test-verl-b; third=$$?; \
		test $$first -eq 0 -a $$second -eq 0 -a $$third -eq 0

# Unit and service tests: no Celery worker, web server, browser or training run is started
# (tests/conftest.py marks those `live`). The database and the embedded Valkey are real.
test-fast: install
	env -u DATABASE_URL -u REDIS_URL $(PY) -m pytest -q -m "not live and not slow and not gpu and not verl"

# The same suite against real PostgreSQL and Redis, when this machine has them. The engine's
# tests (tests/training) touch neither and ran once already.
test-services:
	@if $(PY) scripts/services_up.py "$(PG_URL)" "$(REDIS_SERVER_URL)"; then \
		DATABASE_URL="$(PG_URL)" REDIS_URL="$(REDIS_SERVER_URL)" \
		OPENTINKER_DATA_DIR=$(CURDIR)/var/test-services \
		$(PY) -m pytest -q --durations=15 --ignore=tests/training -m "not once"; \
	else \
		echo "PostgreSQL or Redis not reachable: skipped the run against real services"; \
	fi

bench: install
	$(PY) bench/control_plane.py
	$(PY) bench/engine.py

# ruff (rules in pyproject.toml), mypy on the library and the client (mypy.ini), and the
# architecture contracts (import-linter, pyproject.toml).
lint: install
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/mypy --config-file mypy.ini training client/opentinker
	PYTHONPATH=client $(VENV)/bin/lint-imports --no-cache

clean:
	rm -rf $(VENV) var
