"""SFT, then RL on the adapter SFT trained (`init.from_job`), through the REST API with a real
Celery worker.

The RL job starts from exactly the SFT job's weights: its step-0 evaluation plays the same
greedy transcripts as an eval job of the SFT job's adapter on the same held-out rows, and
from a checkpoint of the SFT job the same as an eval job of that checkpoint.
"""

from __future__ import annotations

from typing import Any

import pytest
from rest_framework.test import APIClient

from jobs.models import JobEvent, JobState
from tests.e2e.test_eval_and_sample import download_lines, submit_eval
from tests.e2e.test_managed_training import finished, rl_spec, series, submit

pytestmark = [pytest.mark.timeout(480), pytest.mark.django_db(transaction=True)]


def test_an_rl_job_starts_from_the_weights_of_the_sft_job_it_names(
    trainer: Any, owner_client: APIClient, outsider_client: APIClient, addition_dataset: str
) -> None:
    worker = trainer()
    lora = {"rank": 8, "alpha": 16}
    sft = submit(
        owner_client,
        {
            "method": "sft",
            "env": "math",
            "dataset": addition_dataset,
            "steps": 2,
            "batch_size": 16,
            "seed": 3,
            "lora": lora,
            "optimizer": {"lr": 2e-2},
            "checkpoint_every": 1,
        },
    )
    assert finished(sft, 180).state == JobState.SUCCEEDED, worker.log()[-3000:]

    held_out = {"eval_examples": 8, "rollout": {"max_tokens": 12}}
    from_final = submit(
        owner_client,
        rl_spec(addition_dataset, steps=1, eval_every=1, init={"from_job": sft}, **held_out),
    )
    from_ckpt = submit(
        owner_client,
        rl_spec(
            addition_dataset,
            steps=1,
            eval_every=1,
            init={"from_job": sft, "checkpoint": "step-000001"},
            **held_out,
        ),
    )
    evaluation = {"method": "rl", "env": "math", "dataset": addition_dataset, "seed": 3}
    of_final = submit_eval(owner_client, {**evaluation, **held_out, "eval": {"from_job": sft}})
    of_ckpt = submit_eval(
        owner_client,
        {**evaluation, **held_out, "eval": {"from_job": sft, "checkpoint": "step-000001"}},
    )
    for job_id in (from_final, from_ckpt, of_final, of_ckpt):
        job = finished(job_id, 240)
        assert job.state == JobState.SUCCEEDED, (job.error_message, worker.log()[-3000:])

    for trained, evaluated, source in ((from_final, of_final, ""), (from_ckpt, of_ckpt, " (")):
        messages = JobEvent.objects.filter(job_id=trained).values_list("message", flat=True)
        assert any(m.startswith(f"starts from the weights of job {sft}{source}") for m in messages)
        before = download_lines(owner_client, trained, "eval/step-000000.jsonl")
        assert [t["turns"] for t in before] == [
            t["turns"] for t in download_lines(owner_client, evaluated, "eval/transcripts.jsonl")
        ]
        assert [s for s, _ in series(owner_client, trained)["eval/accuracy"]] == [0, 1]
    # The two starting points differ: the checkpoint is one SFT step behind the adapter.
    assert download_lines(owner_client, of_final, "eval/transcripts.jsonl") != download_lines(
        owner_client, of_ckpt, "eval/transcripts.jsonl"
    )

    # Another team cannot start from this team's job.
    response = outsider_client.post(
        "/api/v1/jobs",
        {"name": "x", "spec": rl_spec(addition_dataset, init={"from_job": sft})},
        format="json",
    )
    assert response.status_code == 400
    assert {e["field"] for e in response.json()["errors"]} >= {"init.from_job"}
