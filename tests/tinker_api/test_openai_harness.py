"""An evaluation harness (``inspect-ai``, its ``openai-api`` provider) scores a trained job's
policy through ``/v1/chat/completions`` and gets the job's own final held-out accuracy.

A real RL job on the tiny model and the ``math`` env runs on a real Celery worker and
evaluates itself greedily on its held-out rows (``workers.runners.evaluation``). The harness
then asks the live server, model ``job:<id>``, with the same messages (the env's first
observation of each held-out row), greedy, the same token limit, and grades with the env's
own rule (``MathEpisode.step``, i.e. ``environments.grading``). The harness runs as its
users run it (``inspect eval`` on ``harness_task.py``, in a process of its own); nothing in
the task is downloaded: its dataset is built in memory from the job's rows. The same holds
for a vision-language job (tiny-vl on ``geometry``), whose held-out prompts carry images.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("inspect_ai")

from tests.e2e.rows import addition_rows
from tests.fixtures.workers import wait_for
from tests.tinker_api.conftest import sdk_worker_env

pytestmark = [
    pytest.mark.slow,
    pytest.mark.timeout(300),
]

STEPS = 2
ROOT = Path(__file__).resolve().parents[2]
HARNESS_TASK = Path(__file__).with_name("harness_task.py")


def held_out_prompts(spec_json: dict[str, Any]) -> list[dict[str, Any]]:
    """The job's held-out rows as its evaluation plays them: the env's first observation
    (messages), the token limit the rollout applies, and the row itself for grading."""
    from environments.registry import build_group
    from jobs.spec import JobSpec
    from workers.runners.evaluation import EVAL_SEED_OFFSET
    from workers.runners.inputs import dataset_rows

    spec = JobSpec.model_validate(spec_json)
    eval_rows = dataset_rows(spec)[1] or []
    prompts = []
    for i, row in enumerate(eval_rows[: spec.eval_examples]):
        group = {
            "env": spec.env,
            "config": dict(spec.env_config),
            "row": row,
            "seed": EVAL_SEED_OFFSET + i,
            "group_size": 1,
        }
        episode = build_group(group).make_episodes()[0]
        messages, stop = episode.initial_observation()
        prompts.append(
            {
                "messages": messages,
                "max_tokens": min(spec.rollout.max_tokens, stop.max_tokens),
                "stop": list(stop.stop),
                "group": group,
            }
        )
    return prompts


@pytest.fixture
def worker(
    start_worker: Callable[..., Any],
    tinker_data_dir: Path,
    clean_tinker_keys: None,
    monkeypatch: pytest.MonkeyPatch,
) -> Any:
    """A Celery worker with room for the job and the model worker that serves its policy,
    on the test's data directory."""
    sdk_worker_env(monkeypatch)
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    return start_worker(slots=2)


def uploaded(owner_client: Any, rows: list[dict[str, Any]], name: str, env: str) -> str:
    """The id of a JSONL dataset of ``rows`` uploaded for ``env``."""
    from django.core.files.uploadedfile import SimpleUploadedFile

    body = b"".join(json.dumps(r).encode() + b"\n" for r in rows)
    upload = owner_client.post(
        "/api/v1/datasets",
        {
            "file": SimpleUploadedFile(f"{name}.jsonl", body, content_type="application/jsonl"),
            "name": name,
            "env": env,
        },
        format="multipart",
    )
    assert upload.status_code == 201, upload.content
    return str(upload.json()["id"])


def trained(owner_client: Any, spec: dict[str, Any], worker: Any) -> tuple[Any, float]:
    """The job of ``spec``, run to its end on ``worker``, and its final held-out accuracy."""
    from jobs.models import Job, JobState

    submitted = owner_client.post("/api/v1/jobs", {"name": "held", "spec": spec}, format="json")
    assert submitted.status_code == 201, submitted.content
    job_id = str(submitted.json()["id"])
    final = {JobState.SUCCEEDED, JobState.FAILED, JobState.CANCELLED}
    wait_for(lambda: Job.objects.filter(pk=job_id, state__in=final).exists(), 150, "the job")
    job = Job.objects.get(pk=job_id)
    assert job.state == JobState.SUCCEEDED, (job.error_message, worker.log()[-3000:])
    series = owner_client.get(f"/api/v1/jobs/{job_id}/metrics").json()["series"]
    step, accuracy = series["eval/accuracy"][-1]
    assert int(step) == spec["steps"]
    return job, float(accuracy)


def harness_on_held_out(
    url: str, key: str, job: Any, data_dir: Path, tmp_path: Path, worker: Any
) -> float:
    """inspect-ai on the job's held-out prompts through ``/v1`` (model ``job:<id>``, greedy,
    the evaluation's token limit): its accuracy, once its completions are checked against
    what the job's own last evaluation wrote."""
    prompts = held_out_prompts(job.spec)
    assert len(prompts) == job.spec["eval_examples"]
    step = job.spec["steps"]
    transcript_path = data_dir / "jobs" / str(job.pk) / "eval" / f"step-{step:06d}.jsonl"
    transcripts = [json.loads(line) for line in transcript_path.read_text().splitlines()]
    # The harness is handed what the job's evaluation rendered, prompt for prompt.
    assert [t["turns"][0]["observation"] for t in transcripts] == [p["messages"] for p in prompts]
    limits = {p["max_tokens"] for p in prompts}
    assert len(limits) == 1 and not any(p["stop"] for p in prompts)

    prompts_file = tmp_path / "held-out.json"
    prompts_file.write_text(json.dumps(prompts), encoding="utf-8")
    log_dir = tmp_path / "inspect-logs"
    # The harness as its users run it, in a process of its own: its CLI, its OpenAI-compatible
    # provider, the server's URL and an otk_ key.
    command = [
        str(Path(sys.executable).with_name("inspect")),
        *("eval", f"{HARNESS_TASK}@held_out", "-T", f"prompts={prompts_file}"),
        *("--model", f"openai-api/opentinker/job:{job.pk}"),
        *("--model-base-url", url + "/v1", "-M", f"api_key={key}"),
        *("--temperature", "0", "--max-tokens", str(limits.pop())),
        *("--max-connections", "16", "--log-dir", str(log_dir), "--log-format", "json"),
        *("--display", "none", "--log-level", "warning"),
    ]
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    started = time.monotonic()
    ran = subprocess.run(
        command, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=180
    )
    elapsed = time.monotonic() - started
    assert ran.returncode == 0, (ran.stdout[-3000:], ran.stderr[-3000:])
    (log_file,) = log_dir.glob("*.json")
    log = json.loads(log_file.read_text(encoding="utf-8"))
    assert log["status"] == "success", (log.get("error"), worker.log()[-3000:])
    samples = sorted(log["samples"], key=lambda s: s["id"])
    assert [s.get("error") for s in samples] == [None] * len(prompts)
    completions = [s["output"]["choices"][0]["message"]["content"] for s in samples]
    # Greedy through the endpoint writes what the job's greedy evaluation wrote.
    assert completions == [t["turns"][0]["action"] for t in transcripts]
    assert log["results"]["total_samples"] == len(prompts)
    accuracy = float(log["results"]["scores"][0]["metrics"]["accuracy"]["value"])
    print(f"harness accuracy {accuracy} over {len(prompts)} prompts ({elapsed:.1f}s)")
    return accuracy


def test_it_scores_a_trained_job_through_the_endpoint_as_the_job_scored_itself(
    live_server: Any,
    tiny_base_model: Any,
    owner_client: Any,
    owner_key: tuple[Any, str],
    worker: Any,
    tinker_data_dir: Path,
    tmp_path: Path,
) -> None:

    from training.model import DEFAULT_BASE_MODEL

    if not (Path(DEFAULT_BASE_MODEL) / "config.json").is_file():
        pytest.skip(f"no model at {DEFAULT_BASE_MODEL}: run `make model`")
    tiny_base_model.path = str(Path(DEFAULT_BASE_MODEL).resolve())
    tiny_base_model.save(update_fields=["path"])

    spec = {
        "method": "rl",
        "env": "math",
        "dataset": uploaded(owner_client, addition_rows(400), "add2", "math"),
        "base_model": tiny_base_model.name,
        "steps": STEPS,
        "seed": 3,
        "rollout": {"group_size": 4, "prompts_per_step": 4, "max_tokens": 24},
        "lora": {"rank": 8, "alpha": 16},
        "optimizer": {"lr": 3e-4},
        "eval_every": STEPS,
        "eval_examples": 16,
    }
    job, job_accuracy = trained(owner_client, spec, worker)
    # Some answers right and some wrong, or equal scores would say little about the grading.
    assert 0.0 < job_accuracy < 1.0, job_accuracy

    harness_accuracy = harness_on_held_out(
        live_server.url, owner_key[1], job, tinker_data_dir, tmp_path, worker
    )
    assert harness_accuracy == job_accuracy, (harness_accuracy, job_accuracy)


def test_it_scores_a_vision_language_jobs_policy_on_its_diagrams_through_the_endpoint(
    live_server: Any,
    owner_client: Any,
    owner_key: tuple[Any, str],
    worker: Any,
    tinker_data_dir: Path,
    tmp_path: Path,
) -> None:
    """The same on ``geometry`` with tiny-vl: each held-out prompt carries its diagram, which
    the harness sends as an ``image_url`` part (a data URI). Supplementary angles whose values
    the question states, which tiny-vl answers about three times in four before training
    (docs/benchmarks.md), so that right and wrong answers are both graded."""

    from jobs.models import BaseModel
    from training import geometry
    from training.model import TINY_VL_MODEL

    if not (Path(TINY_VL_MODEL) / "config.json").is_file():
        pytest.skip("no models/tiny-vl: run scripts/build_tiny_vl_model.py")
    BaseModel.objects.update_or_create(
        name="tiny-vl", defaults={"path": TINY_VL_MODEL, "max_lora_rank": 64, "max_context": 1024}
    )
    rows = geometry.dataset_rows(
        range(3_000_000, 3_000_040), ["supplementary"], values_in_text=True
    )
    spec = {
        "method": "rl",
        "env": "geometry",
        "env_config": {"max_tokens": 16},
        "dataset": uploaded(owner_client, rows, "supplementary", "geometry"),
        "base_model": "tiny-vl",
        "steps": STEPS,
        "seed": 2,
        "rollout": {"group_size": 4, "prompts_per_step": 4, "max_tokens": 16},
        "lora": {"rank": 8, "alpha": 16},
        "optimizer": {"lr": 1e-3},
        "eval_every": STEPS,
        "eval_examples": 8,
        "checkpoint_every": 0,
    }
    job, job_accuracy = trained(owner_client, spec, worker)
    assert 0.0 < job_accuracy < 1.0, job_accuracy
    shown = [p["messages"][-1]["content"] for p in held_out_prompts(job.spec)]
    assert all(any(part["type"] == "image" for part in c) for c in shown)
    harness_accuracy = harness_on_held_out(
        live_server.url, owner_key[1], job, tinker_data_dir, tmp_path, worker
    )
    assert harness_accuracy == job_accuracy, (harness_accuracy, job_accuracy)
