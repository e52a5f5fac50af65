"""Eval jobs and the sample endpoint, through the REST API with a real Celery worker.

An eval job runs a snapshot through the env with training switched off, on the same prompts
with the same renderer and env code as the training run's own evaluation: evaluating a
finished job's final adapter reproduces that job's last evaluation transcript for transcript,
and evaluating the base model reproduces its step-0 evaluation. The sample endpoint is answered
by the model worker of the tiny base model (started by the same Celery worker once the jobs
are done), not by the web process.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from rest_framework.test import APIClient

from jobs.models import JobKind, JobState
from tests.e2e.test_managed_training import finished, rl_spec, series, submit
from tests.tinker_api.conftest import clean_tinker_keys, sdk_worker_env  # noqa: F401

pytestmark = [pytest.mark.timeout(300), pytest.mark.django_db(transaction=True)]


def submit_eval(client: APIClient, spec: dict[str, Any]) -> str:
    response = client.post(
        "/api/v1/jobs", {"name": "eval", "kind": JobKind.EVAL, "spec": spec}, format="json"
    )
    assert response.status_code == 201, response.content
    return str(response.json()["id"])


def download_lines(client: APIClient, job_id: str, name: str) -> list[dict[str, Any]]:
    response = client.get(f"/api/v1/jobs/{job_id}/artifacts/{name}")
    assert response.status_code == 200, name
    return [json.loads(line) for line in b"".join(response.streaming_content).splitlines()]


def test_it_evaluates_snapshots_and_samples_from_a_finished_jobs_adapter(
    trainer: Any,
    owner_client: APIClient,
    outsider_client: APIClient,
    addition_dataset: str,
    tiny_model_dir: Path,
    clean_tinker_keys: None,  # noqa: F811
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    sdk_worker_env(monkeypatch)
    worker = trainer()
    train_spec = rl_spec(
        addition_dataset, steps=2, eval_every=2, eval_examples=8, checkpoint_every=1
    )
    train_id = submit(owner_client, train_spec)
    assert finished(train_id, 180).state == JobState.SUCCEEDED, worker.log()[-3000:]
    trained = series(owner_client, train_id)

    # Same dataset, seed, prompt count and rollout length: the same held-out prompts.
    same = {k: train_spec[k] for k in ("method", "env", "dataset", "seed", "eval_examples")}
    same["rollout"] = {"max_tokens": train_spec["rollout"]["max_tokens"]}
    final_id = submit_eval(owner_client, {**same, "eval": {"from_job": train_id}})
    ckpt_id = submit_eval(
        owner_client, {**same, "eval": {"from_job": train_id, "checkpoint": "step-000001"}}
    )
    base_id = submit_eval(owner_client, {**same, "eval": {}})
    for job_id in (final_id, ckpt_id, base_id):
        job = finished(job_id, 120)
        assert job.state == JobState.SUCCEEDED, (job.error_message, worker.log()[-3000:])

    for eval_id, step in ((final_id, 2), (base_id, 0)):
        got = series(owner_client, eval_id)
        for name in ("eval/accuracy", "eval/reward", "eval/episodes"):
            assert got[name] == [[0, dict(trained[name])[step]]], (name, step)
        transcripts = download_lines(owner_client, eval_id, "eval/transcripts.jsonl")
        assert len(transcripts) == 8
        assert transcripts == download_lines(owner_client, train_id, f"eval/step-{step:06d}.jsonl")
    assert series(owner_client, ckpt_id)["eval/episodes"] == [[0, 8.0]]
    names = {a["name"] for a in owner_client.get(f"/api/v1/jobs/{ckpt_id}/artifacts").json()}
    assert {"eval/transcripts.jsonl", "summary.json", "metrics.jsonl"} <= names
    assert "adapter" not in names

    # Sampling from the trained adapter, on the model worker.
    url = f"/api/v1/jobs/{train_id}/sample"
    question = download_lines(owner_client, train_id, "eval/step-000002.jsonl")[0]
    messages = question["turns"][0]["observation"]
    body = {"messages": messages, "max_tokens": 24, "temperature": 0.0, "n": 2, "seed": 1}
    response = owner_client.post(url, body, format="json")
    assert response.status_code == 200, response.content
    samples = response.json()["samples"]
    assert len(samples) == 2 and samples[0]["tokens"]
    # Greedy decoding of the eval prompt is what the final evaluation recorded.
    assert samples[0]["text"] == samples[1]["text"] == question["turns"][0]["action"]
    seeded = {"prompt": "12+34=", "max_tokens": 8, "temperature": 1.0, "n": 3, "seed": 7}
    first = owner_client.post(url, seeded, format="json").json()["samples"]
    assert first == owner_client.post(url, seeded, format="json").json()["samples"]
    assert all(len(s["tokens"]) <= 8 for s in first)

    for bad, field in (
        ({"prompt": "x", "n": 9}, "n"),
        ({"prompt": "x", "max_tokens": 257}, "max_tokens"),
        ({"prompt": "x", "temperature": -1}, "temperature"),
        ({"prompt": "x", "messages": messages}, "non_field_errors"),
        ({}, "non_field_errors"),
        ({"messages": [{"role": "robot", "content": "x"}]}, "messages"),
        ({"prompt": "1" * 5000, "max_tokens": 256}, "prompt"),
    ):
        response = owner_client.post(url, bad, format="json")
        assert response.status_code == 400, (bad, response.content)
        assert field in response.json(), (bad, response.json())
    # An eval job trains no adapter: nothing to sample from.
    assert (
        owner_client.post(
            f"/api/v1/jobs/{base_id}/sample", {"prompt": "x"}, format="json"
        ).status_code
        == 409
    )
    assert outsider_client.post(url, {"prompt": "x"}, format="json").status_code == 404


def test_it_evaluates_and_samples_a_full_fine_tuning_jobs_model(
    trainer: Any,
    owner_client: APIClient,
    addition_dataset: str,
    tiny_model_dir: Path,
    clean_tinker_keys: None,  # noqa: F811
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A job that trained every weight exports a model, not an adapter: an eval job loads it
    as a full policy and reproduces the job's last evaluation, and the model worker serves it
    (loaded beside the base model) with the same greedy answers."""
    sdk_worker_env(monkeypatch)
    worker = trainer()
    train_spec = rl_spec(addition_dataset, steps=2, eval_every=2, eval_examples=8)
    del train_spec["lora"]
    train_spec |= {"full_finetune": True, "optimizer": {"lr": 1e-4}}
    train_id = submit(owner_client, train_spec)
    assert finished(train_id, 240).state == JobState.SUCCEEDED, worker.log()[-3000:]
    trained = series(owner_client, train_id)
    names = {a["name"] for a in owner_client.get(f"/api/v1/jobs/{train_id}/artifacts").json()}
    assert "model" in names and "adapter" not in names

    same = {k: train_spec[k] for k in ("method", "env", "dataset", "seed", "eval_examples")}
    same["rollout"] = {"max_tokens": train_spec["rollout"]["max_tokens"]}
    eval_id = submit_eval(owner_client, {**same, "eval": {"from_job": train_id}})
    job = finished(eval_id, 120)
    assert job.state == JobState.SUCCEEDED, (job.error_message, worker.log()[-3000:])
    got = series(owner_client, eval_id)
    for name in ("eval/accuracy", "eval/reward", "eval/episodes"):
        assert got[name] == [[0, dict(trained[name])[2]]], name
    transcripts = download_lines(owner_client, train_id, "eval/step-000002.jsonl")
    assert download_lines(owner_client, eval_id, "eval/transcripts.jsonl") == transcripts
    # The trained model answers unlike the base (step 0): the base alone could not pass.
    before = download_lines(owner_client, train_id, "eval/step-000000.jsonl")
    actions = [t["turns"][0]["action"] for t in transcripts]
    assert actions != [t["turns"][0]["action"] for t in before]

    body = {"max_tokens": 24, "temperature": 0.0, "n": 1}
    for question in transcripts[:3]:
        response = owner_client.post(
            f"/api/v1/jobs/{train_id}/sample",
            {**body, "messages": question["turns"][0]["observation"]},
            format="json",
        )
        assert response.status_code == 200, response.content
        assert response.json()["samples"][0]["text"] == question["turns"][0]["action"]
