"""The JobSpec: the one serializable description of a job, versioned.

``parse_spec`` picks the model by the ``version`` field (default: the current version) and
turns pydantic's errors into ``SpecError(errors=[{"field": "a.b", "reason": ...}])``. A new
field is added to the current model with a default; an incompatible change adds a new
version model and registers it in ``SPEC_VERSIONS``.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    ValidationInfo,
    field_validator,
    model_validator,
)

from accounts.json_checks import unstorable_text_at
from environments.registry import (
    ContractError,
    frozen_opponent,
    get_env,
    make_config,
    pairs_episodes,
    shows_images,
)
from environments.types import DataSource, Interaction

from .spec_sections import (
    AlgorithmSpec,
    EvalSpec,
    FieldErrors,
    InitSpec,
    LoRASpec,
    OptimizerSpec,
    RolloutSpec,
    SpecError,
    changed,
)

CURRENT_VERSION = 1
MAX_RUNTIME_S = 7 * 86400
# Fields that only a training job (rl / sft) reads; a smoke job refuses them.
TRAINING_FIELDS = (
    "algorithm",
    "rollout",
    "lora",
    "full_finetune",
    "activation_checkpointing",
    "optimizer",
    "steps",
    "batch_size",
    "eval_every",
    "eval_examples",
    "checkpoint_every",
    "seed",
    "runner",
    "env_config",
)
# Fields only RL reads: SFT has no sampler and no advantages.
RL_ONLY_FIELDS = ("algorithm", "rollout")


# Fields an eval job refuses: it trains nothing, and the weights' shape comes from `from_job`.
EVAL_REFUSED_FIELDS = (
    "algorithm",
    "lora",
    "full_finetune",
    "activation_checkpointing",
    "optimizer",
    "steps",
    "batch_size",
    "eval_every",
    "checkpoint_every",
)


class JobSpecV1(BaseModel):
    # strict: JSON true is not 1 and "2" is not 2; a typo fails loudly instead of coercing.
    model_config = ConfigDict(extra="forbid", strict=True, frozen=True)

    version: Literal[1] = Field(1, description="Spec format version.")
    method: Literal["smoke", "rl", "sft"] = Field(
        description="'smoke' is the built-in smoke job; 'rl' and 'sft' train a policy."
    )
    base_model: str = Field("tiny", min_length=1, max_length=200, description="Base model name.")
    env: str | None = Field(
        None,
        min_length=1,
        max_length=200,
        validate_default=True,
        description="Environment name (see environments.registry); required for 'rl' and 'sft'.",
    )
    dataset: str | None = Field(
        None,
        min_length=1,
        max_length=500,
        description=(
            "A dataset of the team, by name or id, or 'builtin:<name>'. Needed exactly when the "
            "env reads a dataset; stored as 'dataset:<id>' once the job is accepted."
        ),
    )
    gpus: int = Field(
        1,
        ge=1,
        le=256,
        description=(
            "GPUs of the job: one node's block, or with `gpus_per_node` a gang; native rl and "
            "sft jobs train one data-parallel rank per GPU."
        ),
    )
    gpus_per_node: int | None = Field(
        None,
        ge=1,
        le=64,
        description=(
            "GPUs on each node of a job across nodes (a gang of ceil(gpus / gpus_per_node) "
            "nodes, all held or none); null = every GPU on one node."
        ),
    )
    priority: int = Field(50, ge=0, le=100, description="Higher runs first.")
    max_runtime_s: int = Field(
        3600, ge=1, le=MAX_RUNTIME_S, description="Wall-clock limit of one attempt, seconds."
    )
    smoke_steps: int = Field(5, ge=1, le=1000, description="Smoke job only: steps to run.")
    smoke_step_seconds: float = Field(
        0.5, ge=0, le=60, description="Smoke job only: seconds of work per step."
    )

    # --- training (rl / sft) --------------------------------------------------------------
    env_config: dict[str, Any] = Field(
        default_factory=dict,
        description="Settings of the environment's config (see GET /api/v1/environments).",
    )
    algorithm: AlgorithmSpec = Field(default_factory=AlgorithmSpec, description="RL only.")
    rollout: RolloutSpec = Field(default_factory=RolloutSpec, description="RL only.")
    lora: LoRASpec = Field(default_factory=LoRASpec, description="The adapter to train.")
    full_finetune: bool = Field(
        False, description="Train every weight of a private copy instead (small models only)."
    )
    activation_checkpointing: bool = Field(
        False,
        description="Recompute each layer's activations in backward: memory that no longer "
        "grows with layers x tokens, for about a third more compute (long sequences). The "
        "verl runner always does (its default).",
    )
    optimizer: OptimizerSpec = Field(default_factory=OptimizerSpec, description="AdamW.")
    steps: int = Field(100, ge=1, le=1_000_000, description="Optimizer steps to run.")
    batch_size: int = Field(
        32, ge=1, le=4096, description="SFT only: examples per step (RL: prompts x group)."
    )
    eval_every: int = Field(
        0, ge=0, le=1_000_000, description="Evaluate on the test split every N steps; 0 = off."
    )
    eval_examples: int = Field(
        64, ge=1, le=10_000, description="Test prompts per evaluation (greedy decoding)."
    )
    checkpoint_every: int = Field(
        10,
        ge=0,
        le=1_000_000,
        description="Save the full training state every N steps (and at the end); 0 = end only.",
    )
    seed: int = Field(0, ge=0, le=2**31 - 1, description="Seeds data order, adapter and sampling.")
    runner: Literal["native", "verl"] = Field(
        "native", description="'native' (this engine, CPU or GPU) or 'verl' (GPU at scale)."
    )

    init: InitSpec | None = Field(
        None,
        description=(
            "Start from another LoRA job's weights (its final adapter or a checkpoint) instead "
            "of a fresh adapter, e.g. RL on the adapter an SFT job trained; native runner."
        ),
    )

    eval: EvalSpec | None = Field(
        None,
        description=(
            "Eval jobs only (kind 'eval'): the snapshot to evaluate on `eval_examples` held-out "
            "prompts with greedy decoding; `rollout` and `env_config` apply as in training."
        ),
    )

    @field_validator("env")
    @classmethod
    def _env_for_training(cls, value: str | None, info: ValidationInfo) -> str | None:
        # The env defines the prompts, the rewards and the dataset schema of a training job.
        method = info.data.get("method")
        if value is None and method in ("rl", "sft"):
            raise ValueError(f"required for method {method!r}")
        return value

    @field_validator("dataset")
    @classmethod
    def _dataset_needs_env(cls, value: str | None, info: ValidationInfo) -> str | None:
        # Only when env passed its own checks: otherwise env already carries the error.
        if value is not None and "env" in info.data and info.data["env"] is None:
            raise ValueError("a dataset is read by an environment: give `env` as well")
        return value

    @field_validator("smoke_steps", "smoke_step_seconds")
    @classmethod
    def _smoke_fields_need_smoke(cls, value: Any, info: ValidationInfo) -> Any:
        # Runs only for fields the caller set (defaults are not validated); the default value
        # itself passes so that a stored spec (every field written out) parses again.
        default = cls.model_fields[str(info.field_name)].default
        if info.data.get("method", "smoke") != "smoke" and value != default:
            raise ValueError("only valid with method 'smoke'")
        return value

    @model_validator(mode="after")
    def _combinations(self) -> JobSpecV1:
        errors: list[tuple[str, str]] = []
        if self.method == "smoke":
            for name in TRAINING_FIELDS:
                if changed(self, name):
                    errors.append((name, "only valid with method 'rl' or 'sft'"))
        if self.method == "sft":
            for name in RL_ONLY_FIELDS:
                if changed(self, name):
                    errors.append((name, "only valid with method 'rl'"))
        if self.method == "rl" and changed(self, "batch_size"):
            errors.append(("batch_size", "only valid with method 'sft' (RL: rollout sizes)"))
        if self.eval is not None:
            if self.method == "smoke":
                errors.append(("eval", "an eval job gives method 'rl' or 'sft' and an env"))
            for name in EVAL_REFUSED_FIELDS:
                if changed(self, name):
                    errors.append((name, "an eval job trains nothing: not valid with `eval`"))
        if self.gpus_per_node is not None:
            errors.extend(_gang_errors(self))
        elif self.gpus > 64:
            errors.append(("gpus", "a node holds at most 64: give `gpus_per_node` to span nodes"))
        if self.full_finetune and changed(self, "lora"):
            errors.append(("lora", "give either `lora` or `full_finetune: true`, not both"))
        if self.method in ("rl", "sft") and self.env is not None:
            errors.extend(_env_errors(self))
            errors.extend(_rank_errors(self))
        if self.init is not None:
            errors.extend(_init_errors(self))
        if self.runner == "verl" and self.method == "sft" and self.eval is not None:
            errors.append(("runner", "eval jobs run on the native runner"))
        if self.runner == "verl" and self.method == "sft" and self.env and shows_images(self.env):
            errors.append(
                ("runner", f"env {self.env!r} shows images: verl runs its RL jobs, not SFT")
            )
        if self.runner == "verl" and self.method == "rl":
            errors.extend(_verl_errors(self))
        if errors:
            raise FieldErrors(errors)
        return self


def _init_errors(spec: JobSpecV1) -> list[tuple[str, str]]:
    if spec.method not in ("rl", "sft"):
        return [("init", "only valid with method 'rl' or 'sft'")]
    if spec.eval is not None:
        return [("init", "an eval job names its weights in `eval.from_job`")]
    if spec.full_finetune:
        return [("init", "loads a LoRA adapter: not valid with `full_finetune: true`")]
    if spec.runner != "native":
        return [("init", "the native runner starts from another job's weights; verl does not")]
    return []


def _gang_errors(spec: JobSpecV1) -> list[tuple[str, str]]:
    per = spec.gpus_per_node
    assert per is not None
    if per > spec.gpus:
        return [("gpus_per_node", f"more than the job's {spec.gpus} GPUs")]
    if per == spec.gpus or spec.method == "smoke":
        # A smoke job touches no device: across nodes it exercises the gang's lease alone.
        return []
    if spec.gpus % per:
        return [("gpus_per_node", f"must divide gpus ({spec.gpus}): every rank the same size")]
    if spec.runner == "verl" and spec.method == "sft":
        return [
            (
                "gpus_per_node",
                "verl's SFT trainer across nodes is not launched yet (verl RL and native jobs "
                "are): give gpus_per_node = gpus",
            )
        ]
    return []


def _rank_errors(spec: JobSpecV1) -> list[tuple[str, str]]:
    """A native job trains one data-parallel rank per GPU: each needs a share of the batch."""
    if spec.gpus < 2 or spec.runner != "native" or spec.eval is not None:
        return []
    if spec.method == "rl" and spec.rollout.prompts_per_step < spec.gpus:
        return [
            (
                "rollout.prompts_per_step",
                f"{spec.rollout.prompts_per_step} groups cannot be shared by the job's "
                f"{spec.gpus} ranks (one per GPU): at least {spec.gpus}",
            )
        ]
    if spec.method == "sft" and spec.batch_size < spec.gpus:
        return [
            (
                "batch_size",
                f"{spec.batch_size} rows cannot be shared by the job's {spec.gpus} ranks (one "
                f"per GPU): at least {spec.gpus}",
            )
        ]
    return []


def _env_errors(spec: JobSpecV1) -> list[tuple[str, str]]:
    """Checks that need the environment registry (pure code, no database).

    An unknown env name is left to ``check_contract`` at submission, which names it.
    """
    try:
        env = get_env(str(spec.env))
    except ContractError:
        return []
    errors: list[tuple[str, str]] = []
    try:
        make_config(env.name, spec.env_config)
    except ContractError as exc:
        errors.extend(exc.problems())
    if spec.method == "sft" and env.data_source is not DataSource.DATASET:
        errors.append(
            ("env", f"method 'sft' learns from a dataset's answers; env {env.name!r} has none")
        )
    if spec.method == "rl":
        multi = env.interaction is Interaction.MULTI_TURN
        if spec.algorithm.advantage == "grpo_per_step" and not multi:
            errors.append(
                (
                    "algorithm.advantage",
                    f"'grpo_per_step' needs a multi-turn env; {env.name!r} is single turn",
                )
            )
        if changed(spec.rollout, "max_turns") and not multi:
            errors.append(("rollout.max_turns", f"env {env.name!r} is single turn"))
        if spec.algorithm.advantage == "rloo" and spec.rollout.group_size < 2:
            errors.append(("rollout.group_size", "'rloo' needs at least 2 samples per group"))
        if pairs_episodes(env.name, spec.env_config) and spec.rollout.group_size % 2:
            errors.append(("rollout.group_size", "self-play pairs episodes: give an even size"))
    if spec.rollout.env_execution == "queue" and pairs_episodes(env.name, spec.env_config):
        errors.append(
            (
                "rollout.env_execution",
                "self-play plays a group's episodes against each other in one process: 'inline'",
            )
        )
    elif spec.rollout.env_execution == "queue" and frozen_opponent(env.name, spec.env_config):
        errors.append(
            (
                "rollout.env_execution",
                "a snapshot opponent is sampled beside the policy, in the trainer's process: "
                "'inline'",
            )
        )
    return errors


def _verl_errors(spec: JobSpecV1) -> list[tuple[str, str]]:
    """What verl cannot run (workers.runners.verl maps the rest; docs/verl.md)."""
    errors = []
    if spec.algorithm.advantage == "baseline":
        errors.append(("algorithm.advantage", "'baseline' has no verl estimator: grpo or rloo"))
    if spec.eval is not None:
        errors.append(("runner", "eval jobs run on the native runner"))
    if spec.env is not None and pairs_episodes(spec.env, spec.env_config):
        errors.append(("runner", "self-play pairs a group's episodes; verl samples them apart"))
    if spec.env is not None and frozen_opponent(spec.env, spec.env_config):
        errors.append(("runner", "a snapshot opponent is sampled by the native runner only"))
    # verl's image path (docs/verl.md) is its single-turn agent loop.
    images = spec.env is not None and shows_images(spec.env)
    if images and get_env(str(spec.env)).interaction is Interaction.MULTI_TURN:
        errors.append(
            ("runner", f"env {spec.env!r} shows images over several turns: native runner")
        )
    if spec.rollout.env_execution != "inline":
        errors.append(
            (
                "rollout.env_execution",
                "the verl runner steps environments in its own workers: 'inline' only",
            )
        )
    if spec.rollout.max_off_policy_steps:
        errors.append(
            ("rollout.max_off_policy_steps", "the native runner's pipelining: 0 with verl")
        )
    return errors


def check_base_model_limits(
    spec: JobSpecV1, *, max_lora_rank: int, max_context: int
) -> list[dict[str, str]]:
    """Errors of a training spec against its base model's registry limits (database side)."""
    if spec.method not in ("rl", "sft"):
        return []
    errors = []
    if not spec.full_finetune and spec.lora.rank > max_lora_rank:
        errors.append(
            {
                "field": "lora.rank",
                "reason": f"{spec.lora.rank} is above the max_lora_rank ({max_lora_rank}) "
                f"of base model {spec.base_model!r}",
            }
        )
    if spec.method == "rl" and spec.rollout.max_tokens >= max_context:
        errors.append(
            {
                "field": "rollout.max_tokens",
                "reason": f"must leave room for the prompt in base model {spec.base_model!r}'s "
                f"context of {max_context} tokens",
            }
        )
    return errors


JobSpec = JobSpecV1
SPEC_VERSIONS: dict[int, type[BaseModel]] = {1: JobSpecV1}


def parse_spec(data: Any) -> JobSpec:
    """Validate a raw spec (a dict, e.g. from JSON) into the model of its version."""
    if not isinstance(data, dict):
        raise SpecError([{"field": "", "reason": "the spec must be a JSON object"}])
    version = data.get("version", CURRENT_VERSION)
    model = SPEC_VERSIONS.get(version) if isinstance(version, int) else None
    if model is None or isinstance(version, bool):
        known = ", ".join(str(v) for v in sorted(SPEC_VERSIONS))
        raise SpecError([{"field": "version", "reason": f"unknown spec version; known: {known}"}])
    # pydantic cannot even report a key that holds a lone surrogate (it raises
    # UnicodeEncodeError), and PostgreSQL's jsonb stores no NUL.
    unstorable = unstorable_text_at(data)
    if unstorable is not None:
        raise SpecError([{"field": unstorable[0], "reason": unstorable[1]}])
    try:
        return model.model_validate(data)  # type: ignore[return-value]
    except ValidationError as exc:
        errors: list[dict[str, str]] = []
        for err in exc.errors():
            cause = (err.get("ctx") or {}).get("error")
            if isinstance(cause, FieldErrors):
                prefix = "".join(f"{part}." for part in err["loc"])
                errors.extend({"field": prefix + f, "reason": r} for f, r in cause.errors)
                continue
            # Union members add their type to the location (e.g. "lora.target_modules.list[str]").
            loc = [str(part) for part in err["loc"] if not _is_type_tag(str(part))]
            errors.append(
                {"field": ".".join(loc), "reason": err["msg"].removeprefix("Value error, ")}
            )
        raise SpecError(errors) from exc


def _is_type_tag(part: str) -> bool:
    return part.startswith(("literal[", "list[", "function-")) or part in ("str", "int", "float")
