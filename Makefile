# OpenTinker: `make demo` starts the whole service on embedded defaults and runs a demo job;
# `make test` runs the test suite (embedded defaults, then PostgreSQL + Redis when they answer).
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(VENV)/bin/pip
STAMP := $(VENV)/.installed
PG_URL ?= postgres://postgres@127.0.0.1:5432/test
REDIS_SERVER ?= redis://127.0.0.1:6379
REDIS_SERVER_URL ?= $(REDIS_SERVER)/0

.PHONY: java demo serve test test-fast test-embedded test-engine test-services test-verl test-verl-multinode install model datasets bench lint clean verl-env gpu-bundle

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

# The service's packages for a lent GPU machine's bare Python 3.12 (scripts/gpu_check.sh).
gpu-bundle: install
	$(PY) scripts/gpu_bundle.py

# Java 17 for the scienceworld environment (a Debian package; needs root or sudo).
java:
	bash scripts/install_java.sh

model: install
	$(PY) scripts/build_tiny_model.py

datasets: install
	$(PY) scripts/build_datasets.py

# The suite as parallel parts (tests/sharding.py): the real verl jobs in two shards (a verl
# job takes ~6 GiB, so no more than two at once), the pass against PostgreSQL + Redis in
# SERVICES_SHARDS shards, the embedded pass in EMBEDDED_SHARDS shards by test file, and the engine's tests, started in
# that order (the longest first) on TEST_SLOTS slots. Most of a live test's time is spent
# waiting on worker subprocesses, servers and polls, so one pytest process keeps two cores
# only partly busy: four slots fill them. Each part has its own data directory, SQLite file
# and embedded Valkey (dataset files are named by row id, which the databases reuse); the
# shards are balanced by tests/durations.json, which each part's recorded durations refresh
# (`make test-durations`). The verl venv and the browser are installed first (no-ops when
# present); without them those tests skip. The verl job across two nodes (a Ray cluster of
# two nodes on this host, two vLLM servers, ~8 min, ~10 GiB) is not part of `make test` (it
# would take CI past its time budget): `make test-verl-multinode` runs it.
VERL_ALONE := two_nodes
TEST_SLOTS ?= 4
EMBEDDED_SHARDS ?= 6
VERL_SHARDS := 2
EMBEDDED_PARTS := $(addprefix test-embedded-,$(shell seq 1 $(EMBEDDED_SHARDS)))
VERL_PARTS := $(addprefix test-verl-,$(shell seq 1 $(VERL_SHARDS)))
SERVICES_SHARDS ?= 2
SERVICES_PARTS := $(addprefix test-services-,$(shell seq 1 $(SERVICES_SHARDS)))
TEST_PARTS := $(VERL_PARTS) $(SERVICES_PARTS) $(EMBEDDED_PARTS) test-engine
.PHONY: $(TEST_PARTS) test-durations

test: install
	bash scripts/install_browser.sh || echo "Chromium not installed: the browser tests will be skipped"
	bash scripts/install_java.sh || echo "Java not installed: the scienceworld tests will be skipped"
	$(MAKE) verl-env || echo "the verl venv could not be built: the verl tests will be skipped"
	rm -rf var/durations
	$(MAKE) -k -j$(TEST_SLOTS) --output-sync=target --no-print-directory $(TEST_PARTS)

test-verl-multinode: install verl-env
	$(MAKE) --no-print-directory test-verl VERL_K="$(VERL_ALONE)" VERL_DATA=test-verl-alone

# pytest on the embedded defaults, in the data directory var/$(1), recording its durations.
embedded_pytest = env -u DATABASE_URL -u REDIS_URL OPENTINKER_DATA_DIR=$(CURDIR)/var/$(1) \
	OPENTINKER_TEST_DURATIONS_OUT=$(CURDIR)/var/durations/$(1).json \
	$(PY) -m pytest -q --durations=15

# The embedded pass in one process (the engine's tests included).
test-embedded:
	$(call embedded_pytest,test-embedded) -m "not verl"

$(EMBEDDED_PARTS): test-embedded-%:
	OPENTINKER_TEST_SHARD=$*/$(EMBEDDED_SHARDS) \
		$(call embedded_pytest,test-embedded-$*) -m "not verl" --ignore=tests/training

# The engine's tests (tests/training): no database or Redis, on the embedded defaults.
test-engine:
	$(call embedded_pytest,test-engine) -m "not verl" tests/training

# verl's real trainer (tests marked `verl`), on the embedded defaults; VERL_K picks some.
VERL_K ?= not $(VERL_ALONE)
VERL_DATA ?= test-verl
test-verl:
	$(call embedded_pytest,$(VERL_DATA)) -m verl -k "$(VERL_K)"

$(VERL_PARTS): test-verl-%:
	OPENTINKER_TEST_SHARD=$*/$(VERL_SHARDS) OPENTINKER_TEST_SHARD_UNIT=test \
		$(call embedded_pytest,test-verl-$*) -m verl -k "not $(VERL_ALONE)"

# tests/durations.json from what the last `make test`'s shards recorded.
test-durations:
	$(PY) scripts/test_durations.py var/durations/test-embedded-*.json var/durations/test-verl-*.json

# Unit and service tests: no Celery worker, web server, browser or training run is started
# (tests/conftest.py marks those `live`). The database and the embedded Valkey are real.
test-fast: install
	env -u DATABASE_URL -u REDIS_URL $(PY) -m pytest -q -m "not live and not slow and not gpu and not verl"

# The same suite against real PostgreSQL and Redis, when this machine has them. The engine's
# tests (tests/training) touch neither: test-engine runs them once. `make test` runs it in
# SERVICES_SHARDS shards (the longest part otherwise); each has its own test database
# (test_opentinker_<i>), Redis database (<i>) and data directory, since the tests clean their
# Redis keys by prefix and would clear each other's.
services_up = $(PY) scripts/services_up.py "$(PG_URL)" "$(REDIS_SERVER_URL)"
services_pytest = DATABASE_URL="$(PG_URL)" OPENTINKER_DATA_DIR=$(CURDIR)/var/$(1) \
	$(PY) -m pytest -q --durations=15 --ignore=tests/training -m "not once"

test-services:
	@if $(services_up); then \
		REDIS_URL="$(REDIS_SERVER_URL)" $(call services_pytest,test-services); \
	else \
		echo "PostgreSQL or Redis not reachable: skipped the run against real services"; \
	fi

$(SERVICES_PARTS): test-services-%:
	@if $(services_up); then \
		REDIS_URL="$(REDIS_SERVER)/$*" OPENTINKER_TEST_DB_NAME=test_opentinker_$* \
		OPENTINKER_TEST_SHARD=$*/$(SERVICES_SHARDS) $(call services_pytest,test-services-$*); \
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
