"""A managed RL job on the `geometry` env raises the tiny vision-language model's held-out
accuracy, through the REST API and a real Celery worker.

The problems are supplementary angles with the known angle stated in the question as well as
drawn (`training.geometry`, values in the text): models/tiny-vl answers about three in four
of them greedily, and sampling finds a right answer for most of the rest, which GRPO turns
into a better greedy policy in 40 steps (~90 s on one idle core; several times that beside
the other shards of `make test`, hence the wait). bench/geometry_rl.py measures longer runs
and other kinds (docs/benchmarks.md, "Geometry with tiny-vl").
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from rest_framework.test import APIClient

from jobs.models import JobState
from tests.e2e.rows import upload_angle_problems
from tests.e2e.test_managed_training import finished, series, steps_of, submit

pytestmark = [pytest.mark.timeout(960), pytest.mark.django_db(transaction=True)]

STEPS = 40


def test_an_rl_job_on_geometry_raises_the_vision_policys_held_out_accuracy(
    vl_trainer: Any, owner_client: APIClient, tmp_path: Path
) -> None:
    dataset = upload_angle_problems(owner_client, tmp_path, 576)
    worker = vl_trainer()
    spec = {
        "method": "rl",
        "base_model": "tiny-vl",
        "env": "geometry",
        "env_config": {"max_tokens": 16},
        "dataset": dataset,
        "steps": STEPS,
        "seed": 3,
        "rollout": {"group_size": 8, "prompts_per_step": 16, "max_tokens": 16},
        "algorithm": {"advantage": "grpo", "normalize_std": True},
        "lora": {"rank": 8, "alpha": 16},
        "optimizer": {"lr": 1e-3},
        "eval_every": STEPS,
        "eval_examples": 64,
        "checkpoint_every": 0,
    }
    job_id = submit(owner_client, spec, "geometry-gain")
    job = finished(job_id, 900)
    assert job.state == JobState.SUCCEEDED, (job.error_message, worker.log()[-3000:])
    accuracy = series(owner_client, job_id)["eval/accuracy"]
    assert steps_of(accuracy) == [0, STEPS]
    (_, before), (_, after) = accuracy
    # Measured through the API at 40 steps: 0.750 -> 0.891 for this seed (0.859 -> 0.938 and
    # 0.828 -> 0.953 for seeds 1 and 2: a higher start leaves less room); 64 problems, so
    # 0.08 is 5 more right answers.
    assert after >= before + 0.08, accuracy
