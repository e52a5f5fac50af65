"""What a submission must satisfy beyond its spec's own rules: the base-model registry, the
environment's data contract and the team's datasets, what an eval job evaluates and the
weights of a frozen opponent.

Each check returns the errors it found as ``{"field", "reason"}`` dicts, for ``SpecError``.
"""

from __future__ import annotations

from django.core.exceptions import ValidationError

from accounts.models import Team
from environments.datasets import DatasetValidationError, resolve
from environments.registry import (
    ContractError,
    check_contract,
    frozen_opponent,
    get_env,
    shows_images,
)

from . import artifacts
from .datasets import BUILTIN_REF_PREFIX, find_team_dataset
from .models import BaseModel, Job, JobKind
from .spec import JobSpec, SpecError, check_base_model_limits, parse_spec

__all__ = [
    "check_base_model",
    "check_env_and_dataset",
    "check_eval",
    "check_init",
    "check_opponent",
]


def check_base_model(parsed: JobSpec) -> list[dict[str, str]]:
    # A smoke job loads no model: only a base_model the caller named explicitly is checked.
    if parsed.method == "smoke" and "base_model" not in parsed.model_fields_set:
        return []
    model = BaseModel.objects.filter(name=parsed.base_model).first()
    if model is not None and model.enabled:
        # Every submission path (API, web form, admin, scripts) meets the registry's limits.
        errors = check_base_model_limits(
            parsed, max_lora_rank=model.max_lora_rank, max_context=model.max_context
        )
        return errors + _check_images(parsed, model) + _check_target_modules(parsed, model)
    available = ", ".join(BaseModel.objects.enabled().values_list("name", flat=True)) or "none"
    reason = "is disabled" if model is not None else "is not a registered base model"
    return [
        {"field": "base_model", "reason": f"{parsed.base_model!r} {reason}; available: {available}"}
    ]


def _check_target_modules(parsed: JobSpec, model: BaseModel) -> list[dict[str, str]]:
    """Each LoRA target must name a module of the base model, matched as the trainer matches
    it (the whole dotted name or its last components): a typo would otherwise fail the job
    once it holds GPUs, or, beside a good name, leave that module silently untrained."""
    targets = parsed.lora.target_modules
    if parsed.method not in ("rl", "sft") or parsed.full_finetune or isinstance(targets, str):
        return []
    modules = model.module_names()
    if modules is None:  # not readable on this host: the trainer checks it where it loads
        return []
    missing = [t for t in targets if not any(m == t or m.endswith("." + t) for m in modules)]
    if not missing:
        return []
    known = ", ".join(sorted({m.rsplit(".", 1)[-1] for m in modules}))
    return [
        {
            "field": "lora.target_modules",
            "reason": f"base model {model.name!r} has no module named "
            f"{', '.join(repr(t) for t in missing)}; its modules: {known}",
        }
    ]


def _check_images(parsed: JobSpec, model: BaseModel) -> list[dict[str, str]]:
    """An environment that shows images needs a base model with a vision tower."""
    if parsed.env is None or not shows_images(parsed.env) or model.takes_images() is not False:
        return []
    vision = (
        ", ".join(m.name for m in BaseModel.objects.enabled() if m.takes_images())
        or "none registered"
    )
    return [
        {
            "field": "base_model",
            "reason": f"env {parsed.env!r} shows the policy images, and {model.name!r} is a "
            f"text-only model; use a vision-language base model ({vision})",
        }
    ]


def check_env_and_dataset(parsed: JobSpec, team: Team) -> tuple[str | None, list[dict[str, str]]]:
    """Apply the environment's 2x2 contract and find the dataset.

    Returns the canonical dataset reference to store (``dataset:<id>`` or ``builtin:<name>``)
    and the errors.
    """
    if parsed.env is None:
        return parsed.dataset, []  # the spec model already refused a dataset without env
    try:
        check_contract(parsed.env, parsed.dataset)
    except ContractError as exc:
        return parsed.dataset, [exc.as_dict()]
    if parsed.dataset is None:
        return None, []
    if parsed.dataset.startswith(BUILTIN_REF_PREFIX):
        try:
            resolve(parsed.dataset)
        except DatasetValidationError as exc:
            return parsed.dataset, [{"field": "dataset", "reason": exc.errors[0].reason}]
        return parsed.dataset, []
    dataset = find_team_dataset(team.pk, parsed.dataset)
    if dataset is None:
        reason = f"team {team.slug!r} has no dataset {parsed.dataset!r} (by name or id)"
        return parsed.dataset, [{"field": "dataset", "reason": reason}]
    if dataset.env != parsed.env:
        # Validated for another env: fine when both read the same columns.
        try:
            same = get_env(dataset.env).schema == get_env(parsed.env).schema
        except ContractError:
            same = False
        if not same:
            reason = (
                f"dataset {dataset.name!r} was validated for env {dataset.env!r}, whose columns "
                f"differ from env {parsed.env!r}'s; upload it for {parsed.env!r}"
            )
            return parsed.dataset, [{"field": "dataset", "reason": reason}]
    return dataset.ref, []


def check_eval(parsed: JobSpec, team: Team, kind: str) -> list[dict[str, str]]:
    """An eval job names what it evaluates; a training job must not.

    ``eval.from_job`` must be a training job of the same team on the same base model, with
    the named checkpoint, or (no checkpoint) its final adapter or model, already on disk.
    """
    if kind != JobKind.EVAL:
        if parsed.eval is not None:
            return [{"field": "eval", "reason": "only valid for kind 'eval'"}]
        return []
    if parsed.eval is None:
        return [{"field": "eval", "reason": "required for kind 'eval' ({} = the base model)"}]
    if parsed.eval.from_job is None:
        return []
    return check_source_job(
        team,
        parsed.base_model,
        parsed.eval.from_job,
        parsed.eval.checkpoint,
        fields=("eval.from_job", "eval.checkpoint"),
    )


def check_opponent(parsed: JobSpec, team: Team) -> list[dict[str, str]]:
    """An env config that plays a frozen snapshot of another job's weights names one the
    engine can load beside the policy: the rules of ``eval.from_job``."""
    wanted = frozen_opponent(parsed.env, parsed.env_config) if parsed.env else None
    if wanted is None or wanted["job"] is None:
        return []
    return check_source_job(
        team,
        parsed.base_model,
        str(wanted["job"]),
        wanted["checkpoint"],
        fields=("env_config.opponent_job", "env_config.opponent_checkpoint"),
    )


def check_init(parsed: JobSpec, team: Team) -> list[dict[str, str]]:
    """The weights a training job starts from: the rules of ``eval.from_job`` for a LoRA job,
    and the same adapter shape as this job's own `lora` (the weights are copied into it)."""
    if parsed.init is None:
        return []
    fields = ("init.from_job", "init.checkpoint")
    errors = check_source_job(
        team,
        parsed.base_model,
        parsed.init.from_job,
        parsed.init.checkpoint,
        fields=fields,
        lora_only=True,
    )
    if errors:
        return errors
    source = parse_spec(Job.objects.get(pk=parsed.init.from_job).spec)
    theirs, mine = source.lora.model_dump(), parsed.lora.model_dump()
    if theirs != mine:
        differ = ", ".join(
            f"{k} {theirs[k]!r} here {mine[k]!r}" for k in mine if theirs[k] != mine[k]
        )
        reason = (
            f"job {parsed.init.from_job} trained another adapter shape ({differ}): give its `lora`"
        )
        return [{"field": "lora", "reason": reason}]
    return []


def check_source_job(
    team: Team,
    base_model: str,
    job_id: str,
    checkpoint: str | None,
    *,
    fields: tuple[str, str],
    lora_only: bool = False,
) -> list[dict[str, str]]:
    """Weights another job trained, loaded into this one: a training job of `team` on
    `base_model` with `checkpoint` or, without one, its final adapter (or model: a full
    fine-tuning job, unless `lora_only`) on disk. `fields` name the job and the checkpoint in
    the errors."""
    job_field, checkpoint_field = fields
    try:
        source = Job.objects.filter(pk=job_id, team=team).first()
    except ValidationError:  # not a UUID: a config that skipped its own check
        source = None
    if source is None:
        return [{"field": job_field, "reason": f"team {team.slug!r} has no job {job_id}"}]
    try:
        source_spec = parse_spec(source.spec)
    except SpecError:
        source_spec = None
    if source_spec is None or source_spec.method not in ("rl", "sft") or source.kind != "train":
        return [{"field": job_field, "reason": "is not a training job (rl or sft)"}]
    if source_spec.full_finetune and lora_only:
        reason = "trained every weight (full_finetune); only a LoRA adapter starts a LoRA policy"
        return [{"field": job_field, "reason": reason}]
    if source_spec.base_model != base_model:
        reason = f"job {source.pk} trained base model {source_spec.base_model!r}"
        return [{"field": "base_model", "reason": reason}]
    if checkpoint is not None:
        if artifacts.checkpoint_file(source.pk, checkpoint) is None:
            listed = artifacts.checkpoints(source.pk)
            # The native engine's state loads here; verl checkpoints are not for it.
            names = ", ".join(c["name"] for c in listed if c["kind"] == "native") or "none"
            reason = f"job {source.pk} has no checkpoint {checkpoint!r}; has: {names}"
            return [{"field": checkpoint_field, "reason": reason}]
        return []
    full = source_spec.full_finetune
    if (artifacts.model_dir if full else artifacts.adapter_dir)(source.pk) is None:
        reason = (
            f"job {source.pk} has no final {'model' if full else 'adapter'} yet "
            f"(state {source.state}); name one of its checkpoints in {checkpoint_field}"
        )
        return [{"field": job_field, "reason": reason}]
    return []
