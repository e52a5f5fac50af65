"""The checkpoints and artifacts endpoints read a job's workdir as the runner lays it out.

No model or worker here: the workdir is written in the runner's layout (``checkpoints.jsonl``
plus ``<name>/state.pt``, ``adapter/``, ``eval/``, ``summary.json``), including the debris a
killed run leaves (a torn index line, an index line whose state file never landed). A verl
job's workdir holds what verl's trainer writes (``verl/checkpoints/global_step_N/``), indexed
by the verl runner's own registration code.
"""

from __future__ import annotations

import io
import json
import shutil
import zipfile
from pathlib import Path
from typing import Any

import pytest
from rest_framework.test import APIClient

from jobs.models import Job, JobMetric, JobState

pytestmark = pytest.mark.django_db


@pytest.fixture
def job(team: Any, owner: Any, data_dir: Path) -> Job:
    job = Job.objects.create(
        team=team,
        created_by=owner,
        name="done",
        spec={"method": "rl", "env": "bandit"},
        spec_version=1,
        state=JobState.SUCCEEDED,
    )
    root = data_dir / "jobs" / str(job.pk)
    ckpts = root / "checkpoints"
    for name in ("step-000002", "step-000004"):
        (ckpts / name).mkdir(parents=True)
        (ckpts / name / "state.pt").write_bytes(name.encode())
    lines = [
        {"name": "step-000002", "step": 2, "path": "x", "created": 1.0, "extra": {"step": 2}},
        {"name": "step-000004", "step": 4, "path": "x", "created": 2.0, "extra": {"step": 4}},
        # Saved by a killed attempt before its state file was written: not listed.
        {"name": "step-000006", "step": 6, "path": "x", "created": 3.0, "extra": {"step": 6}},
        # A requeued attempt saved step 4 again: listed once, the later record wins.
        {"name": "step-000004", "step": 4, "path": "x", "created": 4.0, "extra": {"attempt": 2}},
    ]
    body = "".join(json.dumps(line) + "\n" for line in lines) + '{"name": "step-0000'
    (ckpts / "checkpoints.jsonl").write_text(body)
    (root / "adapter").mkdir()
    (root / "adapter" / "adapter_config.json").write_text('{"r": 8}')
    (root / "adapter" / "adapter_model.safetensors").write_bytes(b"weights")
    (root / "eval").mkdir()
    (root / "eval" / "step-000004.jsonl").write_text('{"reward": 1.0}\n')
    (root / "summary.json").write_text('{"step": 4}')
    (data_dir / "jobs" / "secret.txt").write_text("not yours")
    JobMetric.objects.create(job=job, step=1, name="reward/mean", value=0.25)
    JobMetric.objects.create(job=job, step=2, name="reward/mean", value=0.5)
    return job


def body_of(response: Any) -> bytes:
    return b"".join(response.streaming_content)


def test_it_lists_complete_checkpoints_and_serves_their_state(
    job: Job, owner_client: APIClient
) -> None:
    response = owner_client.get(f"/api/v1/jobs/{job.pk}/checkpoints")
    assert response.status_code == 200
    listed = response.json()
    assert [(c["name"], c["step"], c["attempt"]) for c in listed] == [
        ("step-000002", 2, None),
        ("step-000004", 4, 2),
    ]
    assert {(c["kind"], c["format"], c["size_bytes"]) for c in listed} == {("native", "pt", 11)}
    assert listed[1]["download"].endswith(f"/api/v1/jobs/{job.pk}/checkpoints/step-000004")
    state = owner_client.get(listed[1]["download"])
    assert state.status_code == 200 and body_of(state) == b"step-000004"
    assert owner_client.get(f"/api/v1/jobs/{job.pk}/checkpoints/step-000006").status_code == 404


def test_it_serves_the_adapter_as_a_zip_and_the_metrics_as_jsonl(
    job: Job, owner_client: APIClient
) -> None:
    listed = {a["name"]: a for a in owner_client.get(f"/api/v1/jobs/{job.pk}/artifacts").json()}
    assert set(listed) == {"adapter", "summary.json", "eval/step-000004.jsonl", "metrics.jsonl"}
    with zipfile.ZipFile(
        io.BytesIO(body_of(owner_client.get(listed["adapter"]["download"])))
    ) as zf:
        assert sorted(zf.namelist()) == ["adapter_config.json", "adapter_model.safetensors"]
        assert zf.read("adapter_model.safetensors") == b"weights"
    lines = body_of(owner_client.get(listed["metrics.jsonl"]["download"])).splitlines()
    assert [json.loads(line) for line in lines] == [
        {"step": 1, "name": "reward/mean", "value": 0.25},
        {"step": 2, "name": "reward/mean", "value": 0.5},
    ]
    eval_file = owner_client.get(f"/api/v1/jobs/{job.pk}/artifacts/eval/step-000004.jsonl")
    assert body_of(eval_file) == b'{"reward": 1.0}\n'


def test_each_download_has_the_content_type_the_schema_documents(
    job: Job, owner_client: APIClient
) -> None:
    schema = json.loads(
        owner_client.get("/api/schema/", HTTP_ACCEPT="application/vnd.oai.openapi+json").content
    )

    def documented(path: str) -> set[str]:
        return set(schema["paths"][path]["get"]["responses"]["200"]["content"])

    base = f"/api/v1/jobs/{job.pk}"
    expected = {
        "adapter": "application/zip",
        "summary.json": "application/json",
        "eval/step-000004.jsonl": "application/jsonl",
        "metrics.jsonl": "application/jsonl",
    }
    for name, content_type in expected.items():
        got = owner_client.get(f"{base}/artifacts/{name}")["Content-Type"].split(";")[0]
        assert got == content_type, name
        assert got in documented("/api/v1/jobs/{id}/artifacts/{name}"), name
    state = owner_client.get(f"{base}/checkpoints/step-000004")["Content-Type"]
    assert state == "application/octet-stream"
    assert state in documented("/api/v1/jobs/{id}/checkpoints/{name}")


@pytest.mark.parametrize(
    "path",
    [
        "artifacts/..%2Fsecret.txt",
        "artifacts/eval/..",
        "artifacts/checkpoints",
        "checkpoints/checkpoints.jsonl",
        "checkpoints/..",
    ],
)
def test_it_serves_nothing_outside_what_it_lists(
    job: Job, owner_client: APIClient, path: str
) -> None:
    assert owner_client.get(f"/api/v1/jobs/{job.pk}/{path}").status_code == 404


def test_it_hides_another_teams_job(
    job: Job, outsider_client: APIClient, teammate_client: APIClient
) -> None:
    for path in ("checkpoints", "artifacts", "artifacts/adapter", "checkpoints/step-000002"):
        assert outsider_client.get(f"/api/v1/jobs/{job.pk}/{path}").status_code == 404
        assert teammate_client.get(f"/api/v1/jobs/{job.pk}/{path}").status_code == 200


def write_verl_checkpoint(checkpoint_dir: Path, step: int, world_size: int = 2) -> None:
    """What verl's PPO trainer saves for an FSDP LoRA actor at `step` (no critic)."""
    step_dir = checkpoint_dir / f"global_step_{step}"
    actor = step_dir / "actor"
    (actor / "huggingface").mkdir(parents=True)
    (actor / "lora_adapter").mkdir()
    for rank in range(world_size):
        for part in ("model", "optim", "extra_state"):
            name = f"{part}_world_size_{world_size}_rank_{rank}.pt"
            (actor / name).write_bytes(f"{part}-{rank}-{step}".encode())
    (actor / "fsdp_config.json").write_text(
        json.dumps({"FSDP_version": 1, "world_size": world_size})
    )
    (actor / "huggingface" / "config.json").write_text('{"model_type": "qwen2"}')
    (actor / "huggingface" / "tokenizer_config.json").write_text("{}")
    (actor / "lora_adapter" / "adapter_config.json").write_text('{"r": 8}')
    (actor / "lora_adapter" / "adapter_model.safetensors").write_bytes(b"lora-%d" % step)
    (step_dir / "data.pt").write_bytes(b"dataloader-%d" % step)
    # Written last, once the save is complete.
    (checkpoint_dir / "latest_checkpointed_iteration.txt").write_text(str(step))


def test_it_lists_and_serves_the_checkpoints_verl_writes(
    team: Any, owner: Any, data_dir: Path, owner_client: APIClient, outsider_client: APIClient
) -> None:
    from jobs import artifacts
    from workers.runners import verl_process
    from workers.runners.base import JobContext

    job = Job.objects.create(
        team=team,
        created_by=owner,
        name="verl",
        spec={"method": "rl", "env": "math", "runner": "verl"},
        spec_version=1,
        state=JobState.RUNNING,
        attempt=1,
    )
    root = data_dir / "jobs" / str(job.pk)
    ctx = JobContext(job_id=str(job.pk), attempt=1, spec=job.spec, devices=["cuda:0"], workdir=root)
    # Where verl.prepare points trainer.default_local_dir.
    checkpoint_dir = root / "verl" / "checkpoints"
    for step in (2, 4, 6):
        write_verl_checkpoint(checkpoint_dir, step)
        for saved in verl_process.saved_steps(checkpoint_dir):
            if saved == step:
                verl_process.register_checkpoint(ctx, checkpoint_dir, step)
    # verl rotated the oldest away (max_actor_ckpt_to_keep), and a link inside a checkpoint
    # points outside the workdir: neither is served.
    shutil.rmtree(checkpoint_dir / "global_step_2")
    (data_dir / "secret.txt").write_text("not yours")
    (checkpoint_dir / "global_step_4" / "actor" / "leak.txt").symlink_to(data_dir / "secret.txt")

    listed = owner_client.get(f"/api/v1/jobs/{job.pk}/checkpoints").json()
    assert [(c["name"], c["kind"], c["format"], c["step"]) for c in listed] == [
        ("global_step_4", "verl", "zip", 4),
        ("global_step_6", "verl", "zip", 6),
    ]
    step_dir = checkpoint_dir / "global_step_4"
    files = sorted(p for p in step_dir.rglob("*") if p.is_file() and not p.is_symlink())
    assert listed[0]["size_bytes"] == sum(p.stat().st_size for p in files) > 0
    assert listed[0]["created"] > 0 and listed[0]["attempt"] == 1

    download = owner_client.get(listed[0]["download"])
    assert download.status_code == 200 and download["Content-Type"] == "application/zip"
    with zipfile.ZipFile(io.BytesIO(body_of(download))) as zf:
        names = sorted(zf.namelist())
        assert names == sorted(str(p.relative_to(step_dir)) for p in files)
        assert "actor/model_world_size_2_rank_1.pt" in names and "data.pt" in names
        assert zf.read("actor/lora_adapter/adapter_model.safetensors") == b"lora-4"
    for name in ("global_step_2", "global_step_4%2F..", "global_step_x"):
        assert owner_client.get(f"/api/v1/jobs/{job.pk}/checkpoints/{name}").status_code == 404
    assert outsider_client.get(listed[0]["download"]).status_code == 404
    # Eval jobs load native state files; a verl checkpoint is not one.
    assert artifacts.checkpoint_file(job.pk, "global_step_4") is None
