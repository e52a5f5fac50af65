"""Shared fixtures: accounts (owner, teammate, outsider, API clients) and workers (Valkey, Celery).

Tiers: a test that starts a server or a worker process is marked ``live`` by the fixtures it
uses (and every test under tests/e2e is), so ``make test-fast`` (``-m "not live and not slow"``)
runs the unit and service tests alone, and a new live test cannot slip into the fast tier by
forgetting a marker.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

pytest_plugins = ["tests.fixtures.accounts", "tests.fixtures.workers", "tests.sharding"]

# Fixtures that start a Celery worker, a web server, a browser or a long training process.
LIVE_FIXTURES = {
    "start_worker",
    "celery_worker",
    "live_server",
    "env_worker_process",
    "env_worker",
}
LIVE_DIRECTORIES = {"e2e"}
# Tests that exercise neither the database nor Redis in a way the backend changes: the
# embedded pass runs them, the pass against PostgreSQL and Redis (alongside it) does not.
# Some build or hold shared state under var/ (the client's venv, the verl venvs); the rest
# are about an environment library, a cookbook recipe, the engine's numerics or a browser
# driving pages whose queries and Redis calls the control-plane tests run in both passes.
ONCE_PATHS = (
    "architecture/",
    "deploy/test_gpu_check.py",
    "client/test_isolated_install.py",
    "workers/test_verl_compose.py",
    "workers/test_verl_cpu_platform.py",
    "e2e/test_verl_real.py",
    "e2e/test_data_parallel.py",
    "e2e/test_eval_and_sample.py",
    "e2e/test_geometry_gain.py",
    "e2e/test_init_from_job.py",
    "e2e/test_serve_chaos.py",
    "e2e/test_snapshot_opponent.py",
    "e2e/test_training_loop.py",
    "environments/test_bandit.py",
    "environments/test_datasets.py",
    "environments/test_geometry.py",
    "environments/test_gomoku.py",
    "environments/test_imports.py",
    "environments/test_math_envs.py",
    "environments/test_registry.py",
    "environments/test_renderer_masks.py",
    "environments/test_sandbox_",
    "environments/test_scienceworld.py",
    "environments/test_textarena.py",
    "environments/test_textworld.py",
    "tinker_api/test_cookbook",
    "tinker_api/test_full_policies.py",
    "tinker_api/test_openai_harness.py",
    "tinker_api/test_openai_lm_eval.py",
    "tinker_api/test_openai_vl.py",
    "tinker_api/test_sampling_features.py",
    "tinker_api/test_sdk_images.py",
    "tinker_api/test_weights_out.py",
    "web/test_browser",
    # The service on the embedded defaults whatever the pass (tests.fixtures.served), with
    # Redis servers of their own where they stop one.
    "workers/test_demo.py",
    "workers/test_serve_supervisor.py",
)


@pytest.fixture(autouse=True)
def _no_remembered_usage() -> None:
    """Each test's teams start with no month's usage remembered by this process (the quota
    check reuses it for a moment, and team ids repeat from test to test)."""
    quotas = sys.modules.get("jobs.quotas")
    if quotas is not None:
        quotas.forget_recent_usage()


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    tests_dir = Path(__file__).resolve().parent
    for item in items:
        area = Path(str(item.fspath)).resolve().relative_to(tests_dir).parts[0]
        uses_live_fixture = LIVE_FIXTURES.intersection(getattr(item, "fixturenames", ()))
        if area in LIVE_DIRECTORIES or uses_live_fixture:
            item.add_marker(pytest.mark.live)
        relative = Path(str(item.fspath)).resolve().relative_to(tests_dir).as_posix()
        if relative.startswith(ONCE_PATHS):
            item.add_marker(pytest.mark.once)
