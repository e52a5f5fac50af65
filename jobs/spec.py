"""The JobSpec: the one serializable description of a job, versioned.

``parse_spec`` picks the model by the ``version`` field (default: the current version) and
turns pydantic's errors into ``SpecError(errors=[{"field": "a.b", "reason": ...}])``. A new
field is added to the current model with a default; an incompatible change adds a new
version model and registers it in ``SPEC_VERSIONS``.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, ValidationInfo, field_validator

CURRENT_VERSION = 1
MAX_RUNTIME_S = 7 * 86400


class SpecError(ValueError):
    """An invalid job spec; ``errors`` names each offending field and why."""

    def __init__(self, errors: list[dict[str, str]]) -> None:
        self.errors = errors
        super().__init__("; ".join(f"{e['field'] or '(spec)'}: {e['reason']}" for e in errors))


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
    gpus: int = Field(1, ge=1, le=64, description="GPUs in the job's block (one node).")
    priority: int = Field(50, ge=0, le=100, description="Higher runs first.")
    max_runtime_s: int = Field(
        3600, ge=1, le=MAX_RUNTIME_S, description="Wall-clock limit of one attempt, seconds."
    )
    smoke_steps: int = Field(5, ge=1, le=1000, description="Smoke job only: steps to run.")
    smoke_step_seconds: float = Field(
        0.5, ge=0, le=60, description="Smoke job only: seconds of work per step."
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
        # Runs only for fields the caller set (defaults are not validated).
        if info.data.get("method", "smoke") != "smoke":
            raise ValueError("only valid with method 'smoke'")
        return value


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
    try:
        return model.model_validate(data)  # type: ignore[return-value]
    except ValidationError as exc:
        raise SpecError(
            [
                {
                    "field": ".".join(str(part) for part in err["loc"]),
                    "reason": err["msg"].removeprefix("Value error, "),
                }
                for err in exc.errors()
            ]
        ) from exc
