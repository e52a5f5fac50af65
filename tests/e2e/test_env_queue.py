"""`rollout.env_execution: queue`: a managed RL job whose environments step on an env worker.

A trainer worker that does not consume the `env` queue runs the same RL job twice, envs inline
and envs on a separate, real Celery env worker; both runs report the same rewards, losses and
held-out accuracy, and the env worker's log shows it started and stepped every group of the
queued run (and none of the inline one).
"""

from __future__ import annotations

import re
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from rest_framework.test import APIClient

from jobs.models import JobState
from tests.e2e.test_managed_training import finished, rl_spec, series, submit
from tests.fixtures.workers import env_worker_process

pytestmark = [pytest.mark.timeout(400), pytest.mark.django_db(transaction=True)]


class EnvWorker:
    def __init__(self, log_path: Path) -> None:
        self.log_path = log_path

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def succeeded(self, task: str) -> int:
        """Tasks of this name the worker ran to the end."""
        pattern = rf"Task environments\.tasks\.{task}\[[0-9a-f-]+\] succeeded"
        return len(re.findall(pattern, self.log()))


@pytest.fixture
def env_worker(redis_url: str, clean_control_plane: Any, tmp_path: Path) -> Iterator[EnvWorker]:
    """`celery worker --queues=env`, as the production `worker-env` service runs it."""
    name = f"envq-{uuid.uuid4().hex[:8]}"
    with env_worker_process(redis_url, tmp_path / "env-worker.log", name) as log_path:
        yield EnvWorker(log_path)


def test_it_refuses_an_unknown_env_execution(tiny_base_model: Any, owner_client: APIClient):
    spec = rl_spec("builtin:arith_train", rollout={"env_execution": "threads"})
    response = owner_client.post("/api/v1/jobs", {"spec": spec}, format="json")
    assert response.status_code == 400
    assert [e["field"] for e in response.json()["errors"]] == ["rollout.env_execution"]


def test_it_steps_an_rl_jobs_envs_on_an_env_worker_with_the_inline_results(
    trainer: Any, env_worker: EnvWorker, owner_client: APIClient, addition_dataset: str
) -> None:
    worker = trainer(queues="control,gpu")
    spec = rl_spec(addition_dataset, steps=3, eval_every=3, eval_examples=8, checkpoint_every=0)
    runs = {}
    for execution in ("inline", "queue"):
        job_spec = {**spec, "rollout": {**spec["rollout"], "env_execution": execution}}
        job_id = submit(owner_client, job_spec, execution)
        job = finished(job_id, 180)
        assert job.state == JobState.SUCCEEDED, (job.error_message, worker.log()[-3000:])
        runs[execution] = series(owner_client, job_id)

    # 3 steps of 4 prompts, and 8 held-out prompts at step 0 and step 3 (the math env is single
    # turn: one start and one step per group). Only the queued run sent them.
    groups = 3 * 4 + 2 * 8
    assert env_worker.succeeded("start_group") == groups, env_worker.log()[-3000:]
    assert env_worker.succeeded("step_group") == groups
    assert not re.search(r"Task environments\.tasks\.\w+\[", worker.log())

    inline, queued = runs["inline"], runs["queue"]
    assert any(value > 0 for _, value in inline["reward/mean"])
    for name in ("reward/mean", "accuracy", "sample/tokens", "datums", "loss", "eval/accuracy"):
        assert queued[name] == inline[name], name
