"""The JobSpec's sections (algorithm, rollout, LoRA, optimizer, eval) and the errors its
validators raise; `jobs.spec` assembles them into the versioned JobSpec."""

from __future__ import annotations

import uuid
from typing import Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    field_validator,
    model_validator,
)

ALL_LINEAR = "all-linear"


class SpecError(ValueError):
    """An invalid job spec; ``errors`` names each offending field and why."""

    def __init__(self, errors: list[dict[str, str]]) -> None:
        self.errors = errors
        super().__init__("; ".join(f"{e['field'] or '(spec)'}: {e['reason']}" for e in errors))


class FieldErrors(ValueError):
    """Errors of a model validator, each naming a field relative to the model."""

    def __init__(self, errors: list[tuple[str, str]]) -> None:
        self.errors = errors
        super().__init__("; ".join(f"{f}: {r}" for f, r in errors))


def changed(model: BaseModel, name: str) -> bool:
    """Set to something other than its default.

    Comparing with the default (not just "was set") keeps a stored spec, which lists every
    field with its value, valid when parsed again.
    """
    if name not in model.model_fields_set:
        return False
    info = type(model).model_fields[name]
    return bool(getattr(model, name) != info.get_default(call_default_factory=True))


class Section(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True, frozen=True)


class AlgorithmSpec(Section):
    """How rewards become a gradient (method 'rl')."""

    advantage: Literal["grpo", "rloo", "grpo_per_step", "baseline"] = Field(
        "grpo",
        description=(
            "Advantage estimator: 'grpo' (reward minus group mean), 'rloo' (leave-one-out), "
            "'grpo_per_step' (per-turn returns, multi-turn envs), 'baseline' (reward minus "
            "`baseline`)."
        ),
    )
    normalize_std: bool = Field(
        False, description="grpo: divide by the group's reward std (Dr. GRPO leaves it off)."
    )
    baseline: float = Field(0.0, ge=-1e6, le=1e6, description="'baseline' only: the constant.")
    loss: Literal["importance_sampling", "ppo", "cispo", "dro"] = Field(
        "importance_sampling", description="Policy loss (training.losses)."
    )
    clip_low: float = Field(0.8, ge=0.0, le=1.0, description="ppo/cispo: lower ratio clip.")
    clip_high: float = Field(1.2, ge=1.0, le=10.0, description="ppo/cispo: upper ratio clip.")
    dro_beta: float = Field(0.05, ge=0.0, le=100.0, description="dro: quadratic penalty beta.")
    kl_coef: float = Field(
        0.0,
        ge=0.0,
        le=10.0,
        description=(
            "Per-token KL penalty against the base model, folded into the advantage; 0 = off."
        ),
    )
    loss_aggregation: Literal["token_sum", "sequence_mean"] = Field(
        "token_sum",
        description=(
            "How the loss weighs its terms: 'token_sum' (every action token alike, so a long "
            "episode outweighs a short one) or 'sequence_mean' (every episode alike: each "
            "episode's action tokens share a weight of 1)."
        ),
    )

    @model_validator(mode="after")
    def _options_fit_the_choice(self) -> AlgorithmSpec:
        errors = []
        owners = {
            "clip_low": ("ppo", "cispo"),
            "clip_high": ("ppo", "cispo"),
            "dro_beta": ("dro",),
        }
        for name, losses in owners.items():
            if changed(self, name) and self.loss not in losses:
                errors.append((name, f"applies only to loss {' or '.join(losses)}"))
        if changed(self, "baseline") and self.advantage != "baseline":
            errors.append(("baseline", "applies only to advantage 'baseline'"))
        if changed(self, "normalize_std") and self.advantage not in ("grpo", "grpo_per_step"):
            errors.append(("normalize_std", "applies only to advantage grpo or grpo_per_step"))
        if errors:
            raise FieldErrors(errors)
        return self


class RolloutSpec(Section):
    """How each step samples (method 'rl')."""

    group_size: int = Field(4, ge=1, le=256, description="Samples per prompt (G).")
    prompts_per_step: int = Field(8, ge=1, le=1024, description="Groups (prompts) per step.")
    temperature: float = Field(1.0, ge=0.0, le=2.0, description="Sampling temperature.")
    top_p: float = Field(1.0, gt=0.0, le=1.0, description="Nucleus mass kept.")
    max_tokens: int = Field(64, ge=1, le=32768, description="Most tokens per model turn.")
    max_turns: int = Field(8, ge=1, le=64, description="Most model turns per episode.")
    env_execution: Literal["inline", "queue"] = Field(
        "inline",
        description=(
            "Where the environment steps run: 'inline' in the trainer's process, or 'queue' on "
            "env workers (the `env` Celery queue, one task per group and turn), which keeps "
            "env code and its sandboxes off the GPU worker. The trajectories are the same for "
            "the same seed. Native runner only; self-play envs run inline only."
        ),
    )
    max_off_policy_steps: int = Field(
        0,
        ge=0,
        le=4,
        description=(
            "Pipelined RL (native runner): the rollouts of step k+1 are sampled while step k "
            "trains, from the last published snapshot, at most this many steps behind the "
            "weights they train (the loss's importance ratio corrects for it). 0 = every "
            "step samples the weights the previous step ended with."
        ),
    )


class LoRASpec(Section):
    """The adapter trained on the frozen base model."""

    rank: int = Field(16, ge=1, le=1024, description="LoRA rank r (at most the base model's).")
    alpha: float = Field(32.0, gt=0.0, le=4096.0, description="LoRA alpha (scale alpha / r).")
    target_modules: Literal["all-linear"] | list[str] = Field(
        ALL_LINEAR,
        description="Module name suffixes such as ['q_proj', 'v_proj'], or 'all-linear'.",
    )

    @field_validator("target_modules")
    @classmethod
    def _modules_named(cls, value: str | list[str]) -> str | list[str]:
        if isinstance(value, list):
            if not value or len(value) > 64:
                raise ValueError("give between 1 and 64 module names, or 'all-linear'")
            if any(
                not m or len(m) > 100 or not m.replace("_", "").replace(".", "").isalnum()
                for m in value
            ):
                raise ValueError("module names are dotted identifiers such as 'q_proj'")
            if len(set(value)) != len(value):
                raise ValueError("module names must be distinct")
        return value


class OptimizerSpec(Section):
    """AdamW settings of every optim_step."""

    lr: float = Field(1e-4, gt=0.0, le=1.0, description="Learning rate.")
    betas: list[float] = Field(
        default_factory=lambda: [0.9, 0.95], description="AdamW (beta1, beta2), each in [0, 1)."
    )
    weight_decay: float = Field(0.0, ge=0.0, le=1.0, description="Decoupled weight decay.")
    grad_clip: float | None = Field(
        1.0, gt=0.0, le=1e6, description="Clip the global grad norm to this; null = off."
    )

    @field_validator("betas")
    @classmethod
    def _two_betas(cls, value: list[float]) -> list[float]:
        if len(value) != 2 or not all(0.0 <= b < 1.0 for b in value):
            raise ValueError("give two numbers in [0, 1): [beta1, beta2]")
        return value


def job_id(value: str) -> str:
    """A job id in its canonical form, or the field's error."""
    try:
        return str(uuid.UUID(value))
    except ValueError:
        raise ValueError("must be a job id (UUID)") from None


def checkpoint_field(description: str) -> Any:
    """An optional checkpoint name of another job, as its checkpoints directory lists it."""
    return Field(
        None, min_length=1, max_length=100, pattern=r"^[A-Za-z0-9_.-]+$", description=description
    )


class EvalSpec(Section):
    """What an eval job (``kind: eval``) runs through the env, with training switched off."""

    from_job: str | None = Field(
        None,
        description=(
            "Id of a job of the team whose weights are evaluated: its final adapter, or "
            "`checkpoint`; null = the base model itself."
        ),
    )
    checkpoint: str | None = checkpoint_field(
        "A checkpoint of `from_job` (e.g. 'step-000010') instead of its final adapter."
    )
    split: Literal["heldout", "all"] = Field(
        "heldout",
        description=(
            "'heldout': the prompts a training run evaluates on (a built-in set's test split, "
            "else the seeded hold-out of `eval_examples` rows for this `seed`); 'all': the "
            "dataset's first `eval_examples` rows."
        ),
    )

    @field_validator("from_job")
    @classmethod
    def _job_id(cls, value: str | None) -> str | None:
        return None if value is None else job_id(value)

    @model_validator(mode="after")
    def _checkpoint_of_a_job(self) -> EvalSpec:
        if self.checkpoint is not None and self.from_job is None:
            raise FieldErrors([("checkpoint", "names a checkpoint of `from_job`: give both")])
        return self


class InitSpec(Section):
    """The weights a LoRA training job starts from instead of a fresh adapter: another job's
    (SFT, then RL on the same adapter; or a second run of RL). The optimizer starts afresh."""

    from_job: str = Field(
        description=(
            "Id of a LoRA rl/sft job of the team on the same base model, with the same `lora` "
            "settings as this job: its final adapter, or `checkpoint`."
        ),
    )
    checkpoint: str | None = checkpoint_field(
        "A checkpoint of `from_job` (e.g. 'step-000010'): its weights only."
    )

    @field_validator("from_job")
    @classmethod
    def _job_id(cls, value: str) -> str:
        return job_id(value)
