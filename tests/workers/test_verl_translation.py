"""JobSpec -> verl: the Hydra overrides, the parquet files and the reward function (no verl)."""

from __future__ import annotations

import base64
from pathlib import Path
from typing import Any

import pyarrow.parquet as pq
import pytest

from environments.datasets import load_rows, resolve
from environments.registry import build_group
from jobs.spec import SpecError, parse_spec
from workers.runners import verl, verl_config
from workers.runners.verl_agent_loop import AGENT_NAME, CLASS_PATH
from workers.runners.verl_reward import compute_score

A = "actor_rollout_ref"


def _spec(**over: Any) -> Any:
    base = {"method": "rl", "env": "math", "dataset": "builtin:arith_train", "runner": "verl"}
    return parse_spec({**base, **over})


def _rows(n: int = 40) -> list[dict[str, Any]]:
    return load_rows(resolve("builtin:arith_train"), "math")[:n]


def _overrides(spec: Any, tmp_path: Path, **kw: Any) -> dict[str, str]:
    rows = None if spec.dataset is None else _rows()
    data = verl_config.write_datasets(spec, tmp_path / "data", rows=rows, eval_rows=None)
    argv = verl_config.build_overrides(
        spec,
        model_path="/models/qwen",
        data=data,
        checkpoint_dir=tmp_path / "ckpt",
        n_gpus=kw.pop("n_gpus", 2),
        experiment="job-9",
        **kw,
    )
    out = dict(a.split("=", 1) for a in argv)
    assert len(out) == len(argv), "an override is given twice"
    return out


def test_it_maps_a_grpo_lora_job(tmp_path: Path) -> None:
    spec = _spec(
        steps=12,
        eval_every=4,
        checkpoint_every=5,
        seed=3,
        algorithm={"advantage": "grpo", "normalize_std": True, "kl_coef": 0.05},
        rollout={"group_size": 8, "prompts_per_step": 4, "temperature": 0.7, "top_p": 0.9},
        lora={"rank": 8, "alpha": 16.0, "target_modules": ["q_proj", "v_proj"]},
        optimizer={"lr": 2e-5, "betas": [0.9, 0.99], "grad_clip": None},
    )
    o = _overrides(spec, tmp_path)
    assert o["algorithm.adv_estimator"] == "grpo"
    assert o["algorithm.norm_adv_by_std_in_grpo"] == "true"
    assert o[f"{A}.actor.policy_loss.loss_mode"] == "vanilla"
    assert o[f"{A}.actor.loss_agg_mode"] == "token-mean"
    assert o[f"{A}.actor.use_kl_loss"] == "true" and o[f"{A}.actor.kl_loss_coef"] == "0.05"
    assert o[f"{A}.model.lora_rank"] == "8" and o[f"{A}.model.lora_alpha"] == "16"
    assert o[f"{A}.model.target_modules"] == "[q_proj,v_proj]"
    assert o[f"{A}.rollout.load_format"] == "safetensors"
    assert o[f"{A}.rollout.name"] == "vllm" and o[f"{A}.rollout.mode"] == "async"
    assert o[f"{A}.rollout.n"] == "8"
    assert o[f"{A}.rollout.temperature"] == "0.7" and o[f"{A}.rollout.top_p"] == "0.9"
    assert o["data.max_response_length"] == "64"
    assert o["data.train_batch_size"] == "4" and o[f"{A}.actor.ppo_mini_batch_size"] == "4"
    assert o[f"{A}.actor.optim.lr"] == "2e-05"
    assert o[f"{A}.actor.optim.betas"] == "[0.9,0.99]"
    assert float(o[f"{A}.actor.grad_clip"]) >= 1e9
    assert o["trainer.n_gpus_per_node"] == "2"
    assert o["trainer.total_training_steps"] == "12"
    # 40 rows / 4 per step = 10 steps per epoch: 12 steps need 2 epochs.
    assert o["trainer.total_epochs"] == "2"
    assert o["trainer.save_freq"] == "5" and o["trainer.test_freq"] == "4"
    assert o["trainer.val_before_train"] == "true"
    assert o["trainer.default_local_dir"] == str(tmp_path / "ckpt")
    assert o["trainer.logger"] == "[console]"
    assert o["reward.custom_reward_function.path"] == str(verl_config.REWARD_FILE)
    assert o["reward.custom_reward_function.name"] == "compute_score"
    assert o["data.seed"] == "3"
    assert o[f"{A}.rollout.multi_turn.enable"] == "false"


@pytest.mark.parametrize(
    ("algorithm", "mode", "extra"),
    [
        ({"loss": "ppo", "clip_low": 0.7, "clip_high": 1.3}, "vanilla", {"low": 0.3, "high": 0.3}),
        ({"loss": "cispo", "clip_high": 2.0}, "cispo", {"low": 0.2, "high": 1.0}),
        ({"loss": "dro", "dro_beta": 0.2}, "dro", {"beta": 0.2}),
        ({"advantage": "rloo"}, "vanilla", {}),
    ],
)
def test_it_maps_each_policy_loss(
    tmp_path: Path, algorithm: dict[str, Any], mode: str, extra: dict[str, float]
) -> None:
    o = _overrides(_spec(algorithm=algorithm), tmp_path)
    assert o[f"{A}.actor.policy_loss.loss_mode"] == mode
    assert o["algorithm.adv_estimator"] == algorithm.get("advantage", "grpo")
    if "low" in extra:
        # verl's ratios are distances from 1.
        assert float(o[f"{A}.actor.clip_ratio_low"]) == pytest.approx(extra["low"])
        assert float(o[f"{A}.actor.clip_ratio_high"]) == pytest.approx(extra["high"])
    else:
        assert f"{A}.actor.clip_ratio_low" not in o
    if "beta" in extra:
        assert float(o[f"{A}.actor.policy_loss.dro_beta"]) == extra["beta"]


def test_it_maps_full_finetuning_without_lora(tmp_path: Path) -> None:
    o = _overrides(_spec(full_finetune=True), tmp_path)
    assert o[f"{A}.model.lora_rank"] == "0"
    assert f"{A}.model.lora_alpha" not in o and f"{A}.rollout.load_format" not in o


def test_it_routes_multi_turn_envs_through_the_agent_loop(tmp_path: Path) -> None:
    spec = parse_spec(
        {
            "method": "rl",
            "env": "gomoku",
            "runner": "verl",
            "steps": 3,
            "algorithm": {"advantage": "grpo_per_step"},
            "rollout": {"max_turns": 6, "max_tokens": 16, "prompts_per_step": 2},
        }
    )
    cfg = tmp_path / "loops.yaml"
    with pytest.raises(ValueError, match="agent loop"):
        _overrides(spec, tmp_path)
    o = _overrides(spec, tmp_path, agent_loop_config=cfg)
    assert o["algorithm.adv_estimator"] == "grpo"
    assert o[f"{A}.rollout.multi_turn.enable"] == "true"
    assert o[f"{A}.rollout.multi_turn.max_assistant_turns"] == "6"
    assert o[f"{A}.rollout.agent.default_agent_loop"] == AGENT_NAME
    assert o[f"{A}.rollout.agent.agent_loop_config_path"] == str(cfg)
    # 6 actions of 16 tokens and the 5 observations between them.
    assert o["data.max_response_length"] == str(
        6 * 16 + 5 * verl_config.OBSERVATION_TOKENS_PER_TURN
    )
    table = pq.read_table(tmp_path / "data" / "train.parquet").to_pylist()
    # A generator env: one row (episode seed) per prompt of every step.
    assert len(table) == 3 * 2
    assert {r["agent_name"] for r in table} == {AGENT_NAME}
    assert len({r["extra_info"]["group_spec"] for r in table}) == len(table)


def test_it_writes_the_agent_loop_config_that_names_the_class(tmp_path: Path) -> None:
    import yaml

    path = verl.write_agent_loop_config(tmp_path / "loops.yaml")
    assert yaml.safe_load(path.read_text()) == [{"name": AGENT_NAME, "_target_": CLASS_PATH}]


def test_it_writes_parquet_in_verls_schema_and_grades_with_the_env(tmp_path: Path) -> None:
    spec = _spec(eval_examples=5)
    rows = _rows(20)
    data = verl_config.write_datasets(spec, tmp_path, rows=rows, eval_rows=rows[:3])
    train = pq.read_table(data.train).to_pylist()
    val = pq.read_table(data.val).to_pylist()
    assert (data.train_rows, data.val_rows) == (20, 3) and len(train) == 20 and len(val) == 3
    assert set(train[0]) == {"data_source", "prompt", "ability", "reward_model", "extra_info"}
    assert sorted(r["prompt"][-1]["content"] for r in train) == sorted(r["question"] for r in rows)
    row = train[0]
    assert row["data_source"] == "math" and row["prompt"][0]["role"] == "user"
    truth = row["reward_model"]["ground_truth"]
    args = (row["data_source"], row["reward_model"]["ground_truth"])
    assert compute_score(args[0], f"so \\boxed{{{truth}}}", args[1], row["extra_info"]) == 1.0
    assert compute_score(args[0], "\\boxed{-1.5}", args[1], row["extra_info"]) == 0.0
    # Rows from elsewhere (no group spec) are graded against ground_truth directly.
    assert compute_score("gsm8k", "it is \\boxed{0.5}", "1/2") == 1.0


def test_it_counts_prompt_tokens_with_the_chat_template(tmp_path: Path) -> None:
    from environments.renderer import Renderer
    from tests.environments.conftest import build_chatml_tokenizer

    tok = build_chatml_tokenizer()
    spec = _spec()
    rows = _rows(10)
    data = verl_config.write_datasets(spec, tmp_path, rows=rows, eval_rows=None, tokenizer=tok)
    renderer = Renderer(tok)
    # The native runner's renderer, an independent count of the same rendered prompts.
    longest = max(
        len(renderer.prompt_tokens([{"role": "user", "content": r["question"]}])) for r in rows
    )
    assert data.max_prompt_tokens == longest


def test_it_refuses_what_verl_cannot_run_at_submission() -> None:
    with pytest.raises(SpecError) as bad:
        _spec(algorithm={"advantage": "baseline"})
    assert bad.value.errors[0]["field"] == "algorithm.advantage"
    with pytest.raises(SpecError) as selfplay:
        parse_spec({"method": "rl", "env": "gomoku_selfplay", "runner": "verl"})
    assert selfplay.value.errors[0]["field"] == "runner"
    sft = {"method": "sft", "env": "math", "dataset": "builtin:arith_train", "runner": "verl"}
    assert parse_spec(sft).runner == "verl"
    with pytest.raises(SpecError) as eval_job:
        parse_spec({**sft, "eval": {}})
    assert "runner" in {e["field"] for e in eval_job.value.errors}


def test_it_refuses_runs_that_cannot_start(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="at least one GPU"):
        _overrides(_spec(), tmp_path, n_gpus=0)
    with pytest.raises(ValueError, match="do not fill one step"):
        _overrides(_spec(rollout={"prompts_per_step": 64}), tmp_path)


def test_it_quotes_values_hydra_would_misread() -> None:
    assert verl_config.hydra_value("/data/run 1/train.parquet") == "'/data/run 1/train.parquet'"
    assert verl_config.hydra_value("it's") == "'it\\'s'"
    assert verl_config.hydra_value(["a", 1, True]) == "[a,1,true]"
    assert verl_config.hydra_value(None) == "null"


def test_it_writes_sft_examples_as_verl_messages_with_the_graded_answer(tmp_path: Path) -> None:
    spec = parse_spec(
        {
            "method": "sft",
            "env": "math",
            "dataset": "builtin:arith_train",
            "runner": "verl",
            "batch_size": 8,
            "steps": 7,
            "checkpoint_every": 3,
            "lora": {"rank": 4, "alpha": 8},
            "optimizer": {"lr": 3e-4, "grad_clip": 0.5},
        }
    )
    rows = _rows(20)
    # A row's own completion is the assistant turn verbatim.
    rows[0]["completion"] = f"It is \\boxed{{{rows[0]['answer']}}}."
    data = verl_config.write_sft_datasets(spec, tmp_path / "data", rows=rows, eval_rows=rows[:4])
    assert (data.train_rows, data.val_rows) == (20, 4)
    records = pq.read_table(data.train).to_pylist()
    by_question = {r["question"]: r for r in rows}
    seen = set()
    for record in records:
        *prompt, answer = record["messages"]
        assert prompt[-1]["role"] == "user" and answer["role"] == "assistant"
        (row,) = [r for q, r in by_question.items() if q in prompt[-1]["content"]]
        seen.add(row["question"])
        assert answer["content"] == row.get("completion", f"\\boxed{{{row['answer']}}}")
        # The assistant turn is what the env itself grades correct.
        (episode,) = build_group(
            {"env": "math", "config": {}, "row": row, "seed": 0, "group_size": 1}
        ).make_episodes()
        episode.initial_observation()
        assert episode.step(answer["content"]).reward == 1.0
    assert seen == set(by_question)
    argv = verl_config.build_sft_overrides(
        spec,
        model_path="/models/qwen",
        data=data,
        checkpoint_dir=tmp_path / "ckpt",
        n_gpus=2,
        experiment="job-9",
        max_length=128,
        cpu=True,
    )
    o = dict(a.split("=", 1) for a in argv)
    assert len(o) == len(argv)
    assert o["data.train_batch_size"] == "8" and o["data.micro_batch_size_per_gpu"] == "4"
    assert o["model.lora_rank"] == "4" and o["model.lora_alpha"] == "8"
    assert o["optim.lr"] == "0.0003" and o["optim.clip_grad"] == "0.5"
    # 20 rows make 2 steps of 8 per epoch: 7 steps need 4 epochs.
    assert o["trainer.total_epochs"] == "4" and o["trainer.total_training_steps"] == "7"
    assert o["trainer.save_freq"] == "3" and o["trainer.device"] == "cpu"
    with pytest.raises(ValueError, match="does not split"):
        verl_config.build_sft_overrides(
            spec, model_path="/m", data=data, checkpoint_dir=tmp_path, n_gpus=3, experiment="x"
        )


def test_a_job_across_nodes_joins_the_gangs_ray_cluster_instead_of_starting_one(
    tmp_path: Path,
) -> None:
    spec = parse_spec(
        {
            "method": "rl",
            "env": "math",
            "dataset": "builtin:arith_train",
            "runner": "verl",
            "gpus": 4,
            "gpus_per_node": 2,
            "rollout": {"prompts_per_step": 4, "group_size": 4},
        }
    )
    one = _overrides(spec, tmp_path / "one", n_gpus=2, cpu=True)
    two = _overrides(spec, tmp_path / "two", n_gpus=2, cpu=True, nnodes=2)
    assert (one["trainer.nnodes"], two["trainer.nnodes"]) == ("1", "2")
    assert two["trainer.n_gpus_per_node"] == "2"
    # Joining a running cluster, ray.init may not declare resources: the nodes did.
    assert one["+ray_kwargs.ray_init.num_gpus"] == "2"
    assert "+ray_kwargs.ray_init.num_gpus" not in two
    assert "ray_kwargs.ray_init.num_cpus" not in two
    # 16 sequences over 4 GPUs: micro-batches of 4.
    assert two["actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu"] == "4"


def _geometry(**over: Any) -> Any:
    base = {
        "method": "rl",
        "base_model": "tiny-vl",
        "env": "geometry",
        "dataset": "builtin:geometry_train",
        "runner": "verl",
    }
    return parse_spec({**base, **over})


def test_it_writes_image_prompts_in_verls_multimodal_form(tmp_path: Path) -> None:
    from transformers import AutoTokenizer

    from environments.renderer import Renderer
    from training import vision
    from training.model import TINY_VL_MODEL

    rows = load_rows(resolve("builtin:geometry_train"), "geometry")[:12]
    tok = AutoTokenizer.from_pretrained(TINY_VL_MODEL)
    processor = vision.load_processor(TINY_VL_MODEL)
    pictures = verl_config.Pictures(processor)
    spec = _geometry(env_config={"prompt_suffix": " Answer in \\boxed{}."})
    data = verl_config.write_datasets(
        spec, tmp_path, rows=rows, eval_rows=rows[:4], tokenizer=tok, pictures=pictures
    )
    train = pq.read_table(data.train).to_pylist()
    assert (data.train_rows, data.val_rows) == (12, 4)
    by_image = {r["images"][0]["bytes"]: r for r in train}
    for row in rows:
        record = by_image[base64.b64decode(row["images"][0])]
        # One string per message, the image where the problem marks it, its bytes beside.
        (message,) = record["prompt"]
        assert message["content"] == row["problem"] + " Answer in \\boxed{}."
        (image,) = record["images"]
        assert (image["min_pixels"], image["max_pixels"]) == (3136, 50176)
        truth = record["reward_model"]["ground_truth"]
        solved = f"so \\boxed{{{truth}}}"
        assert compute_score("geometry", solved, truth, record["extra_info"]) == 1.0
    # The longest prompt with every placeholder repeated as the image fills it: the native
    # runner's renderer, an independent count of the same prompts.
    renderer = Renderer(tok, image_tokens=lambda data: vision.encode_image(processor, data).tokens)
    counts = []
    for gs in verl_config._group_specs(spec, rows, len(rows), spec.seed):
        (episode,) = build_group(gs).make_episodes()
        counts.append(len(renderer.prompt_tokens(episode.initial_observation()[0])))
    assert data.max_prompt_tokens == max(counts) > 16


def test_it_maps_a_vision_job_with_lora_off_the_tower(tmp_path: Path) -> None:
    rows = load_rows(resolve("builtin:geometry_train"), "geometry")[:40]
    for full in (False, True):
        spec = _geometry(full_finetune=full)
        data = verl_config.write_datasets(spec, tmp_path / str(full), rows=rows, eval_rows=None)
        argv = verl_config.build_overrides(
            spec,
            model_path="/models/vl",
            data=data,
            checkpoint_dir=tmp_path / "ckpt",
            n_gpus=1,
            experiment="job-9",
            cpu=True,
        )
        o = dict(a.split("=", 1) for a in argv)
        assert o["data.image_key"] == "images"
        assert o["data.filter_overlong_prompts"] == "false"
        assert o[f"+{A}.rollout.engine_kwargs.vllm.limit_mm_per_prompt"] == "{image:8,video:0}"
        if full:
            assert f"{A}.model.exclude_modules" not in o
        else:
            assert o[f"{A}.model.exclude_modules"] == "'.*visual.*'"


def test_it_runs_rl_on_an_image_env_and_refuses_sft() -> None:
    assert _geometry().runner == "verl"
    with pytest.raises(SpecError) as sft:
        _geometry(method="sft")
    assert "runner" in {e["field"] for e in sft.value.errors}
