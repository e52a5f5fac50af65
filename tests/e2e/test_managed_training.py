"""Managed training jobs through the REST API, a real Celery worker and a real Valkey.

RL and SFT jobs on the tiny model with the `math` env run to SUCCEEDED with metrics at every
step, checkpoints and a PEFT adapter that downloads and loads; a cancel stops a run within a
step; a SIGKILLed worker's job resumes from its last checkpoint on a fresh worker with no step
lost or repeated.
"""

from __future__ import annotations

import io
import json
import zipfile
from pathlib import Path
from typing import Any

import pytest
from rest_framework.test import APIClient

from jobs.models import Job, JobEvent, JobMetric, JobState
from tests.fixtures.workers import TEST_LEASE_SECONDS, wait_for
from workers.control import reap

pytestmark = [pytest.mark.timeout(300), pytest.mark.django_db(transaction=True)]

FINAL = {JobState.SUCCEEDED, JobState.FAILED, JobState.CANCELLED}


def rl_spec(dataset: str, **overrides: Any) -> dict[str, Any]:
    spec: dict[str, Any] = {
        "method": "rl",
        "env": "math",
        "dataset": dataset,
        "steps": 4,
        "seed": 3,
        "rollout": {"group_size": 4, "prompts_per_step": 4, "max_tokens": 24},
        "lora": {"rank": 8, "alpha": 16},
        "optimizer": {"lr": 3e-4},
        "eval_every": 2,
        "eval_examples": 16,
        "checkpoint_every": 2,
    }
    spec.update(overrides)
    return spec


def submit(client: APIClient, spec: dict[str, Any], name: str = "e2e") -> str:
    response = client.post("/api/v1/jobs", {"name": name, "spec": spec}, format="json")
    assert response.status_code == 201, response.content
    return str(response.json()["id"])


def finished(job_id: str, timeout: float) -> Job:
    wait_for(
        lambda: Job.objects.filter(pk=job_id, state__in=FINAL).exists(), timeout, "the job to end"
    )
    return Job.objects.get(pk=job_id)


def series(client: APIClient, job_id: str) -> dict[str, list[list[float]]]:
    response = client.get(f"/api/v1/jobs/{job_id}/metrics")
    assert response.status_code == 200
    return response.json()["series"]


def steps_of(points: list[list[float]]) -> list[int]:
    return [int(step) for step, _ in points]


def test_it_runs_an_rl_job_to_success_and_hands_back_a_peft_adapter(
    trainer: Any,
    owner_client: APIClient,
    outsider_client: APIClient,
    addition_dataset: str,
    tiny_model_dir: Path,
) -> None:
    worker = trainer()
    job_id = submit(owner_client, rl_spec(addition_dataset))
    job = finished(job_id, 180)
    assert job.state == JobState.SUCCEEDED, (job.error_message, worker.log()[-3000:])

    metrics = series(owner_client, job_id)
    for name in (
        "reward/mean",
        "reward/std",
        "accuracy",
        "loss",
        "entropy",
        "tokens_per_s",
        "step_time_s",
    ):
        assert steps_of(metrics[name]) == [1, 2, 3, 4], name
    assert steps_of(metrics["eval/accuracy"]) == [0, 2, 4]
    # The pre-trained model answers some additions: rewards vary and the loss has a gradient.
    assert any(value > 0 for _, value in metrics["reward/mean"])
    assert any(value > 0 for _, value in metrics["datums"])
    assert all(value > 0 for _, value in metrics["tokens_per_s"])

    checkpoints = owner_client.get(f"/api/v1/jobs/{job_id}/checkpoints").json()
    assert [(c["name"], c["step"]) for c in checkpoints] == [
        ("step-000002", 2),
        ("step-000004", 4),
    ]
    state = owner_client.get(checkpoints[-1]["download"])
    assert state.status_code == 200
    import torch

    saved = torch.load(io.BytesIO(b"".join(state.streaming_content)), weights_only=True)
    assert saved["step"] == 4 and saved["weights"]

    artifacts = {a["name"]: a for a in owner_client.get(f"/api/v1/jobs/{job_id}/artifacts").json()}
    assert {"adapter", "summary.json", "eval/step-000004.jsonl", "metrics.jsonl"} <= set(artifacts)
    lines = b"".join(owner_client.get(artifacts["metrics.jsonl"]["download"]).streaming_content)
    rewards = [
        row["step"] for row in map(json.loads, lines.splitlines()) if row["name"] == "reward/mean"
    ]
    assert rewards == [1, 2, 3, 4]
    assert set(artifacts["adapter"]["files"]) == {
        "adapter_config.json",
        "adapter_model.safetensors",
    }
    download = owner_client.get(artifacts["adapter"]["download"])
    assert download.status_code == 200
    adapter_dir = Path(worker.log_path).parent / "adapter"
    with zipfile.ZipFile(io.BytesIO(b"".join(download.streaming_content))) as zf:
        zf.extractall(adapter_dir)

    from peft import PeftModel

    from training.model import load_base

    base, _ = load_base(str(tiny_model_dir))
    model = PeftModel.from_pretrained(base, str(adapter_dir))
    lora_b = [p for n, p in model.named_parameters() if "lora_B" in n]
    # B starts at zero: a non-zero B is the training the job did.
    assert lora_b and any(float(p.abs().sum()) > 0 for p in lora_b)

    # Another team's caller sees none of it.
    for path in ("checkpoints", "artifacts", "artifacts/adapter", "checkpoints/step-000002"):
        assert outsider_client.get(f"/api/v1/jobs/{job_id}/{path}").status_code == 404
    assert owner_client.get(f"/api/v1/jobs/{job_id}/artifacts/..%2Fsecret").status_code == 404


def test_it_runs_an_sft_job_whose_loss_falls(
    trainer: Any, owner_client: APIClient, addition_dataset: str
) -> None:
    worker = trainer()
    spec = {
        "method": "sft",
        "env": "math",
        "dataset": addition_dataset,
        "steps": 8,
        "batch_size": 16,
        "lora": {"rank": 8, "alpha": 16},
        "optimizer": {"lr": 2e-3},
        "checkpoint_every": 0,
    }
    job_id = submit(owner_client, spec, "sft")
    job = finished(job_id, 120)
    assert job.state == JobState.SUCCEEDED, (job.error_message, worker.log()[-3000:])
    loss = series(owner_client, job_id)["loss"]
    assert steps_of(loss) == list(range(1, 9))
    first = sum(v for _, v in loss[:2]) / 2
    last = sum(v for _, v in loss[-2:]) / 2
    assert last < 0.8 * first, loss
    checkpoints = owner_client.get(f"/api/v1/jobs/{job_id}/checkpoints").json()
    assert [c["step"] for c in checkpoints] == [8]  # checkpoint_every 0: the final one only


def test_it_refuses_a_lora_rank_above_the_base_models_limit(
    tiny_base_model: Any, owner_client: APIClient
) -> None:
    response = owner_client.post(
        "/api/v1/jobs",
        {"spec": rl_spec("builtin:arith_train", lora={"rank": 128})},
        format="json",
    )
    assert response.status_code == 400
    assert [e["field"] for e in response.json()["errors"]] == ["lora.rank"]
    assert "max_lora_rank (64)" in response.json()["errors"][0]["reason"]


def test_it_stops_a_cancelled_job_within_a_step(
    trainer: Any, owner_client: APIClient, addition_dataset: str
) -> None:
    trainer()
    job_id = submit(owner_client, rl_spec(addition_dataset, steps=500, eval_every=0))
    wait_for(
        lambda: JobMetric.objects.filter(job_id=job_id, name="loss", step__gte=2).exists(),
        60,
        "step 2",
    )
    response = owner_client.post(f"/api/v1/jobs/{job_id}/cancel")
    assert response.status_code == 200
    job = finished(job_id, 20)
    assert job.state == JobState.CANCELLED
    steps = JobMetric.objects.filter(job_id=job_id, name="loss").count()
    assert 2 <= steps < 500
    # The last checkpoint stays downloadable.
    assert [c["step"] for c in owner_client.get(f"/api/v1/jobs/{job_id}/checkpoints").json()]


def test_it_resumes_a_killed_workers_job_from_its_last_checkpoint(
    trainer: Any, owner_client: APIClient, addition_dataset: str
) -> None:
    first = trainer()
    job_id = submit(owner_client, rl_spec(addition_dataset, steps=6, eval_every=0))
    wait_for(
        lambda: JobMetric.objects.filter(job_id=job_id, name="loss", step__gte=3).exists(),
        60,
        "step 3",
    )
    first.kill()
    wait_for(lambda: job_id in reap()["requeued"], TEST_LEASE_SECONDS + 10, "the reaper to requeue")
    assert Job.objects.get(pk=job_id).attempt == 2

    trainer()
    job = finished(job_id, 120)
    assert job.state == JobState.SUCCEEDED and job.attempt == 2, job.error_message
    # Every step exactly once, whichever attempt wrote it.
    loss = series(owner_client, job_id)["loss"]
    assert steps_of(loss) == [1, 2, 3, 4, 5, 6]
    resumed = list(
        JobEvent.objects.filter(job_id=job_id, message__startswith="resumed from").values_list(
            "data", flat=True
        )
    )
    assert len(resumed) == 1 and resumed[0]["step"] in (2, 4)
    assert resumed[0]["cursor"] == resumed[0]["step"] * 4  # 4 prompts per step
    names = [c["name"] for c in owner_client.get(f"/api/v1/jobs/{job_id}/checkpoints").json()]
    assert names == ["step-000002", "step-000004", "step-000006"]
