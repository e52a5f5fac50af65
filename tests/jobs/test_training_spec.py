"""JobSpec v1 training fields (rl / sft): defaults, ranges, impossible combinations."""

from __future__ import annotations

import pytest

from jobs.spec import SpecError, check_base_model_limits, parse_spec

MATH = {"env": "math", "dataset": "builtin:arith_train"}


def errors_of(data: dict) -> list[dict[str, str]]:
    with pytest.raises(SpecError) as exc:
        parse_spec(data)
    return exc.value.errors


def test_it_fills_in_training_defaults_and_round_trips_the_stored_form():
    spec = parse_spec({"method": "rl", **MATH})
    assert spec.algorithm.advantage == "grpo" and spec.algorithm.loss == "importance_sampling"
    assert spec.algorithm.kl_coef == 0.0
    assert (spec.rollout.group_size, spec.rollout.prompts_per_step) == (4, 8)
    assert spec.lora.target_modules == "all-linear" and not spec.full_finetune
    assert spec.optimizer.betas == [0.9, 0.95] and spec.runner == "native"
    # The stored spec lists every field (smoke fields included): it must parse again.
    stored = spec.model_dump(mode="json")
    assert parse_spec(stored) == spec
    sft = parse_spec({"method": "sft", **MATH, "full_finetune": True, "batch_size": 4})
    assert parse_spec(sft.model_dump(mode="json")) == sft


@pytest.mark.parametrize(
    "extra, field",
    [
        ({"lora": {"rank": 0}}, "lora.rank"),
        ({"lora": {"alpha": 0}}, "lora.alpha"),
        ({"lora": {"target_modules": []}}, "lora.target_modules"),
        ({"lora": {"target_modules": ["q_proj", "q_proj"]}}, "lora.target_modules"),
        ({"lora": {"dropout": 0.1}}, "lora.dropout"),
        ({"rollout": {"group_size": 0}}, "rollout.group_size"),
        ({"rollout": {"temperature": 2.5}}, "rollout.temperature"),
        ({"rollout": {"top_p": 0}}, "rollout.top_p"),
        ({"rollout": {"max_tokens": "64"}}, "rollout.max_tokens"),
        ({"rollout": {"max_turns": 4}}, "rollout.max_turns"),
        ({"algorithm": {"advantage": "gae"}}, "algorithm.advantage"),
        ({"algorithm": {"loss": "reinforce"}}, "algorithm.loss"),
        ({"algorithm": {"kl_coef": -0.1}}, "algorithm.kl_coef"),
        ({"algorithm": {"loss_aggregation": "token_mean"}}, "algorithm.loss_aggregation"),
        ({"algorithm": {"loss": "ppo", "dro_beta": 0.1}}, "algorithm.dro_beta"),
        ({"algorithm": {"clip_low": 0.5}}, "algorithm.clip_low"),
        ({"algorithm": {"advantage": "grpo_per_step"}}, "algorithm.advantage"),
        ({"algorithm": {"advantage": "rloo"}, "rollout": {"group_size": 1}}, "rollout.group_size"),
        ({"optimizer": {"lr": 0}}, "optimizer.lr"),
        ({"optimizer": {"betas": [0.9, 1.0]}}, "optimizer.betas"),
        ({"optimizer": {"grad_clip": -1}}, "optimizer.grad_clip"),
        ({"steps": 0}, "steps"),
        ({"eval_every": -1}, "eval_every"),
        ({"seed": -1}, "seed"),
        ({"runner": "deepspeed"}, "runner"),
        ({"env_config": {"temperature": 1}}, "env_config.temperature"),
        ({"full_finetune": True, "lora": {"rank": 4}}, "lora"),
        ({"rollout": {"env_execution": "remote"}}, "rollout.env_execution"),
        ({"rollout": {"env_execution": True}}, "rollout.env_execution"),
        ({"runner": "verl", "rollout": {"env_execution": "queue"}}, "rollout.env_execution"),
    ],
)
def test_it_names_the_field_of_a_bad_rl_setting(extra, field):
    errors = errors_of({"method": "rl", **MATH, **extra})
    assert field in [e["field"] for e in errors], errors
    assert all(e["reason"] for e in errors)


@pytest.mark.parametrize(
    "data, field",
    [
        ({"method": "sft", **MATH, "rollout": {"group_size": 2}}, "rollout"),
        ({"method": "sft", **MATH, "algorithm": {"loss": "ppo"}}, "algorithm"),
        ({"method": "sft", "env": "bandit"}, "env"),
        ({"method": "sft", **MATH, "runner": "verl", "eval": {}}, "runner"),
        (
            # verl trains on images with RL only (docs/verl.md).
            {
                "method": "sft",
                "env": "geometry",
                "dataset": "builtin:geometry_train",
                "runner": "verl",
            },
            "runner",
        ),
        ({"method": "smoke", "steps": 3}, "steps"),
        ({"method": "smoke", "lora": {"rank": 4}}, "lora"),
    ],
)
def test_it_refuses_settings_the_method_does_not_use(data, field):
    assert field in [e["field"] for e in errors_of(data)]


def test_it_accepts_multi_turn_settings_on_a_multi_turn_env():
    spec = parse_spec(
        {
            "method": "rl",
            "env": "gomoku",
            "rollout": {"max_turns": 12, "group_size": 2},
            "algorithm": {"advantage": "grpo_per_step", "normalize_std": True},
        }
    )
    assert spec.rollout.max_turns == 12


def test_it_checks_the_base_models_limits():
    spec = parse_spec(
        {"method": "rl", **MATH, "lora": {"rank": 128}, "rollout": {"max_tokens": 2048}}
    )
    errors = check_base_model_limits(spec, max_lora_rank=64, max_context=1024)
    assert [e["field"] for e in errors] == ["lora.rank", "rollout.max_tokens"]
    full = parse_spec({"method": "sft", **MATH, "full_finetune": True})
    assert check_base_model_limits(full, max_lora_rank=1, max_context=1024) == []


@pytest.mark.parametrize(
    "data, field",
    [
        ({"method": "rl", **MATH, "eval": {"checkpoint": "step-000002"}}, "eval.checkpoint"),
        ({"method": "rl", **MATH, "eval": {"from_job": "not-a-uuid"}}, "eval.from_job"),
        (
            {"method": "rl", **MATH, "eval": {"checkpoint": "../x", "from_job": None}},
            "eval.checkpoint",
        ),
        ({"method": "rl", **MATH, "eval": {"epochs": 1}}, "eval.epochs"),
        ({"method": "rl", **MATH, "eval": {}, "steps": 5}, "steps"),
        ({"method": "rl", **MATH, "eval": {}, "lora": {"rank": 4}}, "lora"),
        ({"method": "smoke", "eval": {}}, "eval"),
    ],
)
def test_it_names_the_field_of_a_bad_eval_section(data, field):
    assert field in [e["field"] for e in errors_of(data)]


def test_it_accepts_an_eval_section_and_round_trips_it():
    job = "6F1C6D0E-8F9A-4A53-9D63-8B9A3D0B1C2E"
    spec = parse_spec(
        {"method": "rl", **MATH, "eval": {"from_job": job, "checkpoint": "step-000004"}}
    )
    assert spec.eval is not None and spec.eval.from_job == job.lower()
    assert parse_spec(spec.model_dump(mode="json")) == spec
    assert parse_spec({"method": "rl", **MATH}).eval is None


def test_it_runs_envs_inline_unless_the_spec_names_the_env_queue():
    assert parse_spec({"method": "rl", **MATH}).rollout.env_execution == "inline"
    queued = parse_spec({"method": "rl", **MATH, "rollout": {"env_execution": "queue"}})
    assert queued.rollout.env_execution == "queue"
    assert parse_spec(queued.model_dump(mode="json")) == queued
    # Self-play needs both players in one process.
    selfplay = {"method": "rl", "env": "gomoku_selfplay", "rollout": {"group_size": 2}}
    assert parse_spec(selfplay).rollout.env_execution == "inline"
    selfplay["rollout"]["env_execution"] = "queue"
    assert [e["field"] for e in errors_of(selfplay)] == ["rollout.env_execution"]


@pytest.mark.parametrize(
    "data, reason",
    [
        ({"method": "smoke", "gpus": 2, "gpus_per_node": 4}, "more than the job's 2 GPUs"),
        ({"method": "rl", **MATH, "gpus": 6, "gpus_per_node": 4}, "must divide gpus"),
        (
            {"method": "sft", **MATH, "runner": "verl", "gpus": 4, "gpus_per_node": 2},
            "verl's SFT trainer across nodes is not launched yet",
        ),
        ({"method": "smoke", "gpus": 65}, "at most 64"),
    ],
)
def test_it_checks_gpus_per_node(data: dict, reason: str) -> None:
    errors = errors_of(data)
    assert any(reason in e["reason"] for e in errors), errors
    assert {e["field"] for e in errors} <= {"gpus", "gpus_per_node"}


def test_it_accepts_gangs_of_native_jobs_and_one_node_blocks_with_gpus_per_node() -> None:
    assert parse_spec({"method": "smoke", "gpus": 6, "gpus_per_node": 4}).gpus_per_node == 4
    assert parse_spec({"method": "rl", **MATH, "gpus": 2, "gpus_per_node": 2}).gpus == 2
    rl = parse_spec({"method": "rl", **MATH, "gpus": 4, "gpus_per_node": 2})
    assert (rl.gpus, rl.gpus_per_node) == (4, 2)


def test_every_rank_of_a_native_job_gets_a_share_of_the_batch() -> None:
    rl = {"method": "rl", **MATH, "gpus": 4, "rollout": {"prompts_per_step": 2}}
    assert [e["field"] for e in errors_of(rl)] == ["rollout.prompts_per_step"]
    assert "at least 4" in errors_of(rl)[0]["reason"]
    sft = {"method": "sft", **MATH, "gpus": 2, "gpus_per_node": 1, "batch_size": 1}
    assert [e["field"] for e in errors_of(sft)] == ["batch_size"]
    assert parse_spec({**rl, "rollout": {"prompts_per_step": 4}}).gpus == 4


def test_it_holds_textarena_self_play_to_gomoku_self_plays_rules() -> None:
    selfplay = {"method": "rl", "env": "textarena", "env_config": {"opponent": "selfplay"}}
    assert parse_spec({**selfplay, "rollout": {"group_size": 4}}).env == "textarena"
    odd = errors_of({**selfplay, "rollout": {"group_size": 3}})
    assert [e["field"] for e in odd] == ["rollout.group_size"]
    queued = errors_of({**selfplay, "rollout": {"group_size": 2, "env_execution": "queue"}})
    assert [e["field"] for e in queued] == ["rollout.env_execution"]
    assert "runner" in [e["field"] for e in errors_of({**selfplay, "runner": "verl"})]
    # Against the random opponent each episode plays alone.
    parse_spec({"method": "rl", "env": "textarena", "rollout": {"group_size": 3}})


def test_it_bounds_pipelined_rollouts_and_keeps_them_off_verl() -> None:
    data = {"method": "rl", **MATH, "rollout": {"max_off_policy_steps": 1}}
    assert parse_spec(data).rollout.max_off_policy_steps == 1
    too_far = errors_of({**data, "rollout": {"max_off_policy_steps": 5}})
    assert [e["field"] for e in too_far] == ["rollout.max_off_policy_steps"]
    verl = errors_of({**data, "runner": "verl"})
    assert "rollout.max_off_policy_steps" in [e["field"] for e in verl]
