"""The native runner: ``method: rl`` and ``method: sft`` on this project's engine (CPU or GPU).

It resolves what the database knows (the base model's directory, the dataset file and its
test split), loads the engine once per worker process and base model, and hands the run to
`workers.runners.loop.TrainingLoop`. Artifacts land in the job's workdir, which survives
requeues: ``checkpoints/`` (with ``checkpoints.jsonl``), ``eval/``, ``adapter/`` (PEFT) or
``model/`` (full fine-tuning) and ``summary.json``.
"""

from __future__ import annotations

import re
import threading
from pathlib import Path
from typing import Any

from jobs.spec import JobSpec, SpecError, check_base_model_limits, parse_spec
from workers.runners.base import JobContext

# Engines stay loaded between jobs of one worker process: loading the base model is the
# slowest part of a short job. Key: (model directory, device).
_ENGINES: dict[tuple[str, str], Any] = {}
_ENGINES_LOCK = threading.Lock()
_TRAIN_SPLIT = re.compile(r"^(builtin:.+)_train$")


def _engine(path: Path, device: str) -> Any:
    from training.engine import Engine

    key = (str(path), device)
    with _ENGINES_LOCK:
        engine = _ENGINES.get(key)
        if engine is None:
            engine = Engine(path, device=device)
            _ENGINES[key] = engine
        return engine


def _base_model_path(spec: JobSpec) -> Path:
    from jobs.models import BaseModel

    model = BaseModel.objects.filter(name=spec.base_model, enabled=True).first()
    if model is None:
        raise LookupError(f"base model {spec.base_model!r} is not registered or is disabled")
    # The API checks these at submission; a job submitted another way is checked here.
    errors = check_base_model_limits(
        spec, max_lora_rank=model.max_lora_rank, max_context=model.max_context
    )
    if errors:
        raise SpecError(errors)
    path = model.resolved_path()
    if not path.is_dir():
        raise FileNotFoundError(
            f"base model {spec.base_model!r}: no model directory at {path} on this worker"
        )
    return path


def _rows(spec: JobSpec) -> tuple[list[dict[str, Any]] | None, list[dict[str, Any]] | None]:
    """(training rows, evaluation rows); None for generator environments."""
    from environments.datasets import load_rows
    from jobs.datasets import resolve_dataset_ref
    from workers.runners.loop import split_holdout

    if spec.dataset is None:
        return None, None
    env = str(spec.env)
    rows = load_rows(resolve_dataset_ref(spec.dataset), env)
    match = _TRAIN_SPLIT.match(spec.dataset)
    if match:
        try:
            # A built-in training split has a test split next to it.
            return rows, load_rows(resolve_dataset_ref(match.group(1) + "_test"), env)
        except LookupError:
            pass
    if not spec.eval_every:
        return rows, []
    return split_holdout(rows, spec.eval_examples, spec.seed)


def _eval_rows(spec: JobSpec) -> list[dict[str, Any]] | None:
    """An eval job's prompts: by default exactly those a training run of this spec evaluates
    on (`_rows` with evaluation on), so the numbers of both compare."""
    from environments.datasets import load_rows
    from jobs.datasets import resolve_dataset_ref

    assert spec.eval is not None
    if spec.dataset is None:
        return None
    if spec.eval.split == "all":
        return load_rows(resolve_dataset_ref(spec.dataset), str(spec.env))
    return _rows(spec.model_copy(update={"eval_every": 1}))[1]


def _run_eval(ctx: JobContext, spec: JobSpec, engine: Any) -> None:
    """Load the snapshot the spec names (or none: the base model) and evaluate it."""
    from jobs import artifacts
    from jobs.adapters import load_peft_adapter
    from jobs.models import Job
    from workers.runners.loop import run_eval

    assert spec.eval is not None
    source: dict[str, Any] = {"from_job": spec.eval.from_job, "checkpoint": spec.eval.checkpoint}
    policy = None
    if spec.eval.from_job is not None:
        trained = parse_spec(Job.objects.get(pk=spec.eval.from_job).spec)
        policy = engine.create_policy(
            rank=trained.lora.rank,
            alpha=trained.lora.alpha,
            target_modules=trained.lora.target_modules,
            seed=trained.seed,
            policy_id=f"eval-{ctx.job_id}-{ctx.attempt}",
        )
    try:
        if policy is not None and spec.eval.checkpoint is not None:
            path = artifacts.checkpoint_file(spec.eval.from_job, spec.eval.checkpoint)
            if path is None:
                raise LookupError(f"checkpoint {spec.eval.checkpoint!r} is gone")
            policy.load_state(path)
        elif policy is not None:
            adapter = artifacts.adapter_dir(spec.eval.from_job)
            if adapter is None:
                raise LookupError(f"job {spec.eval.from_job} has no final adapter")
            load_peft_adapter(policy, adapter)
        run_eval(ctx, spec, engine, eval_rows=_eval_rows(spec), policy=policy, source=source)
    finally:
        if policy is not None:
            engine.remove_policy(policy.id)


def run(ctx: JobContext) -> None:
    """Run one attempt of an rl/sft job (resuming from the workdir's last checkpoint), or an
    eval job (a spec with `eval`)."""
    from workers.runners.loop import TrainingLoop

    spec = parse_spec(ctx.spec)
    if spec.method not in ("rl", "sft"):
        raise ValueError(f"the native runner trains methods rl and sft, not {spec.method!r}")
    if spec.runner == "verl":
        from workers.runners import verl

        return verl.run(ctx)
    if spec.runner != "native":
        raise ValueError(f"runner {spec.runner!r} is not available on this worker")
    device = ctx.devices[0] if ctx.devices else "cpu"
    engine = _engine(_base_model_path(spec), device)
    if spec.eval is not None:
        _run_eval(ctx, spec, engine)
        return
    rows, eval_rows = _rows(spec)
    loop = TrainingLoop(
        ctx,
        spec,
        engine,
        rows=rows,
        eval_rows=eval_rows,
        policy_id=f"job-{ctx.job_id}-{ctx.attempt}",
    )
    try:
        loop.run()
    finally:
        loop.close()
