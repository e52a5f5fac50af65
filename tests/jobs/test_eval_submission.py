"""submit_job: base-model limits on every path, and what an eval job may name."""

from __future__ import annotations

import uuid
from pathlib import Path
from typing import Any

import pytest

from jobs import services
from jobs.artifacts import workdir
from jobs.models import Job, JobKind, JobState
from jobs.spec import SpecError

MATH = {"method": "rl", "env": "math", "dataset": "builtin:arith_train"}


def fields_of(**kwargs: Any) -> list[str]:
    with pytest.raises(SpecError) as exc:
        services.submit_job(**kwargs)
    assert all(e["reason"] for e in exc.value.errors)
    return [e["field"] for e in exc.value.errors]


@pytest.fixture
def trained(team: Any, owner: Any, tiny_base_model: Any, data_dir: Path) -> Job:
    """A submitted LoRA training job whose workdir holds a checkpoint but no adapter yet."""
    job = services.submit_job(team=team, user=owner, spec={**MATH, "steps": 4}, name="t")
    ckpt = workdir(job.pk) / "checkpoints"
    (ckpt / "step-000002").mkdir(parents=True)
    (ckpt / "step-000002" / "state.pt").write_bytes(b"x")
    (ckpt / "checkpoints.jsonl").write_text('{"name": "step-000002", "step": 2}\n')
    return job


def test_it_enforces_the_base_models_limits_outside_the_api(
    team: Any, owner: Any, tiny_base_model: Any
) -> None:
    # Submitted directly (as the admin, the web form or a script would): no view involved.
    spec = {**MATH, "lora": {"rank": 128}, "rollout": {"max_tokens": 4096}}
    assert fields_of(team=team, user=owner, spec=spec, name="x") == [
        "lora.rank",
        "rollout.max_tokens",
    ]
    assert not Job.objects.exists()
    tiny_base_model.max_lora_rank = 256
    tiny_base_model.max_context = 8192
    tiny_base_model.save()
    assert services.submit_job(team=team, user=owner, spec=spec, name="x").state == JobState.QUEUED


def test_it_requires_the_eval_section_exactly_for_eval_jobs(
    team: Any, owner: Any, tiny_base_model: Any
) -> None:
    assert fields_of(team=team, user=owner, spec=MATH, name="e", kind=JobKind.EVAL) == ["eval"]
    spec = {**MATH, "eval": {}}
    assert fields_of(team=team, user=owner, spec=spec, name="e") == ["eval"]
    job = services.submit_job(team=team, user=owner, spec=spec, name="e", kind=JobKind.EVAL)
    assert job.kind == JobKind.EVAL and job.spec["eval"] == {
        "from_job": None,
        "checkpoint": None,
        "split": "heldout",
    }


def test_it_checks_the_job_and_checkpoint_an_eval_names(
    team: Any, owner: Any, other_team: Any, outsider: Any, trained: Job
) -> None:
    def submit(eval_section: dict[str, Any], **kw: Any) -> list[str]:
        return fields_of(
            team=kw.get("team", team),
            user=owner,
            spec={**MATH, "eval": eval_section},
            name="e",
            kind=JobKind.EVAL,
        )

    # Not finished: no adapter yet, but its saved checkpoint can be evaluated.
    assert submit({"from_job": str(trained.pk)}) == ["eval.from_job"]
    assert submit({"from_job": str(trained.pk), "checkpoint": "step-000004"}) == ["eval.checkpoint"]
    assert submit({"from_job": str(uuid.uuid4())}) == ["eval.from_job"]
    # Another team's job is not found, whatever it holds.
    assert submit({"from_job": str(trained.pk), "checkpoint": "step-000002"}, team=other_team) == [
        "eval.from_job"
    ]
    job = services.submit_job(
        team=team,
        user=owner,
        spec={**MATH, "eval": {"from_job": str(trained.pk), "checkpoint": "step-000002"}},
        name="e",
        kind=JobKind.EVAL,
    )
    assert job.spec["eval"]["checkpoint"] == "step-000002"
    adapter = workdir(trained.pk) / "adapter"
    adapter.mkdir()
    (adapter / "adapter_model.safetensors").write_bytes(b"x")
    services.submit_job(
        team=team,
        user=owner,
        spec={**MATH, "eval": {"from_job": str(trained.pk)}},
        name="e2",
        kind=JobKind.EVAL,
    )


def test_it_evaluates_a_full_finetune_job_once_its_model_is_exported(
    team: Any, owner: Any, tiny_base_model: Any, data_dir: Path
) -> None:
    full = services.submit_job(
        team=team,
        user=owner,
        spec={**MATH, "method": "sft", "full_finetune": True},
        name="full",
    )
    spec = {**MATH, "eval": {"from_job": str(full.pk)}}
    with pytest.raises(SpecError) as refused:
        services.submit_job(team=team, user=owner, spec=spec, name="e", kind=JobKind.EVAL)
    (error,) = refused.value.errors
    assert error["field"] == "eval.from_job" and "no final model yet" in error["reason"]
    model = workdir(full.pk) / "model"
    model.mkdir(parents=True)
    (model / "config.json").write_text("{}")
    (model / "model.safetensors").write_bytes(b"x")
    services.submit_job(team=team, user=owner, spec=spec, name="e", kind=JobKind.EVAL)


def test_it_checks_the_job_a_snapshot_opponent_names(
    team: Any, owner: Any, other_team: Any, trained: Job
) -> None:
    pytest.importorskip("textarena")

    def spec(**env_config: Any) -> dict[str, Any]:
        return {
            "method": "rl",
            "env": "textarena",
            "env_config": {"game": "TicTacToe-v0", "opponent": "snapshot", **env_config},
            "rollout": {"max_turns": 6},
        }

    def submit(env_config: dict[str, Any], **kw: Any) -> list[str]:
        return fields_of(
            team=kw.get("team", team),
            user=owner,
            spec={**spec(**env_config), **kw.get("more", {})},
            name="vs",
        )

    job = str(trained.pk)
    # No final adapter yet: its saved checkpoint may play, the rules of eval.from_job.
    assert submit({"opponent_job": job}) == ["env_config.opponent_job"]
    assert submit({"opponent_job": job, "opponent_checkpoint": "step-9"}) == [
        "env_config.opponent_checkpoint"
    ]
    assert submit({"opponent_job": str(uuid.uuid4())}) == ["env_config.opponent_job"]
    assert submit({"opponent_job": job, "opponent_checkpoint": "step-000002"}, team=other_team) == [
        "env_config.opponent_job"
    ]
    # The frozen policy samples in the trainer's process, on the native runner.
    assert submit({}, more={"rollout": {"env_execution": "queue"}}) == ["rollout.env_execution"]
    assert submit({}, more={"runner": "verl"}) == ["runner"]
    ok = services.submit_job(
        team=team,
        user=owner,
        spec=spec(opponent_job=job, opponent_checkpoint="step-000002"),
        name="vs",
    )
    assert ok.spec["env_config"]["opponent_job"] == job
    assert services.submit_job(team=team, user=owner, spec=spec(), name="vs-base").state == (
        JobState.QUEUED
    )
