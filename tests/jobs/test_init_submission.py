"""submit_job: what a training job's `init` (the weights it starts from) may name."""

from __future__ import annotations

import uuid
from pathlib import Path
from typing import Any

import pytest

from jobs import services
from jobs.artifacts import workdir
from jobs.models import Job, JobKind
from jobs.spec import SpecError, parse_spec

SFT = {"method": "sft", "env": "math", "dataset": "builtin:arith_train", "lora": {"rank": 4}}
RL = {"method": "rl", "env": "math", "dataset": "builtin:arith_train", "lora": {"rank": 4}}


def errors_of(**kwargs: Any) -> list[tuple[str, str]]:
    with pytest.raises(SpecError) as exc:
        services.submit_job(**kwargs)
    return [(e["field"], e["reason"]) for e in exc.value.errors]


def spec_errors(data: dict[str, Any]) -> list[str]:
    with pytest.raises(SpecError) as exc:
        parse_spec(data)
    return [e["field"] for e in exc.value.errors]


@pytest.fixture
def sft_job(team: Any, owner: Any, tiny_base_model: Any, data_dir: Path) -> Job:
    """A LoRA SFT job with a checkpoint on disk and no final adapter yet."""
    job = services.submit_job(team=team, user=owner, spec=SFT, name="sft")
    ckpt = workdir(job.pk) / "checkpoints"
    (ckpt / "step-000002").mkdir(parents=True)
    (ckpt / "step-000002" / "state.pt").write_bytes(b"x")
    (ckpt / "checkpoints.jsonl").write_text('{"name": "step-000002", "step": 2}\n')
    return job


def test_the_spec_takes_init_for_lora_training_on_the_native_runner_only() -> None:
    job = str(uuid.uuid4())
    parsed = parse_spec({**RL, "init": {"from_job": job}})
    assert parsed.init is not None and parsed.init.from_job == job
    assert parsed.init.checkpoint is None
    assert spec_errors({**RL, "init": {"from_job": "nope"}}) == ["init.from_job"]
    assert spec_errors({**RL, "init": {}}) == ["init.from_job"]
    assert spec_errors({**RL, "init": {"from_job": job, "checkpoint": "../x"}}) == [
        "init.checkpoint"
    ]
    assert spec_errors({"method": "smoke", "init": {"from_job": job}}) == ["init"]
    full = {k: v for k, v in SFT.items() if k != "lora"} | {"full_finetune": True}
    assert spec_errors({**full, "init": {"from_job": job}}) == ["init"]
    assert "init" in spec_errors({**RL, "runner": "verl", "gpus": 1, "init": {"from_job": job}})
    eval_spec = {k: v for k, v in RL.items() if k != "lora"} | {"eval": {}}
    assert spec_errors({**eval_spec, "init": {"from_job": job}}) == ["init"]
    # A spec without it stores `init: null`, and a stored spec parses again.
    stored = parse_spec(RL).model_dump(mode="json")
    assert stored["init"] is None and parse_spec(stored).init is None


def test_it_checks_the_job_checkpoint_and_adapter_shape_init_names(
    team: Any, owner: Any, other_team: Any, sft_job: Job
) -> None:
    def submit(init: dict[str, Any], **overrides: Any) -> list[str]:
        spec = {**RL, "init": init, **overrides.pop("spec", {})}
        found = errors_of(team=overrides.get("team", team), user=owner, spec=spec, name="rl")
        assert all(reason for _, reason in found)
        return [field for field, _ in found]

    job = str(sft_job.pk)
    # No final adapter yet: a checkpoint of it can be named.
    assert submit({"from_job": job}) == ["init.from_job"]
    assert submit({"from_job": job, "checkpoint": "step-000009"}) == ["init.checkpoint"]
    assert submit({"from_job": str(uuid.uuid4())}) == ["init.from_job"]
    assert submit({"from_job": job, "checkpoint": "step-000002"}, team=other_team) == [
        "init.from_job"
    ]
    # The weights are copied into this job's adapter: its shape must be theirs.
    shape = errors_of(
        team=team,
        user=owner,
        spec={**RL, "lora": {"rank": 8}, "init": {"from_job": job, "checkpoint": "step-000002"}},
        name="rl",
    )
    assert [f for f, _ in shape] == ["lora"] and "rank 4 here 8" in shape[0][1]
    rl = services.submit_job(
        team=team,
        user=owner,
        spec={**RL, "init": {"from_job": job, "checkpoint": "step-000002"}},
        name="rl",
    )
    assert rl.spec["init"] == {"from_job": job, "checkpoint": "step-000002"}
    adapter = workdir(sft_job.pk) / "adapter"
    adapter.mkdir()
    (adapter / "adapter_model.safetensors").write_bytes(b"x")
    again = services.submit_job(
        team=team, user=owner, spec={**RL, "init": {"from_job": job}}, name="rl2"
    )
    assert again.spec["init"]["from_job"] == job


def test_it_refuses_an_eval_or_full_finetune_job_as_the_source(
    team: Any, owner: Any, tiny_base_model: Any, data_dir: Path, sft_job: Job
) -> None:
    full_spec = {k: v for k, v in SFT.items() if k != "lora"} | {"full_finetune": True}
    full = services.submit_job(team=team, user=owner, spec=full_spec, name="full")
    found = errors_of(
        team=team, user=owner, spec={**RL, "init": {"from_job": str(full.pk)}}, name="x"
    )
    assert [f for f, _ in found] == ["init.from_job"] and "full_finetune" in found[0][1]
    evaluation = services.submit_job(
        team=team,
        user=owner,
        spec={
            **{k: v for k, v in SFT.items() if k != "lora"},
            "eval": {"from_job": str(sft_job.pk), "checkpoint": "step-000002"},
        },
        name="e",
        kind=JobKind.EVAL,
    )
    found = errors_of(
        team=team, user=owner, spec={**RL, "init": {"from_job": str(evaluation.pk)}}, name="x"
    )
    assert [f for f, _ in found] == ["init.from_job"]
