"""The native runner: ``method: rl`` and ``method: sft`` on this project's engine (CPU or GPU).

It resolves what the database knows (`workers.runners.inputs`: the base model's directory,
the dataset file and its test split), takes the process's engine for the base model
(`workers.runners.engines`) and hands the run to `workers.runners.loop.TrainingLoop`.
Artifacts land in the job's workdir, which survives requeues: ``checkpoints/`` (with
``checkpoints.jsonl``), ``eval/``, ``adapter/`` (PEFT) or ``model/`` (full fine-tuning) and
``summary.json``.
"""

from __future__ import annotations

from typing import Any

from jobs import artifacts
from jobs.models import Job
from jobs.spec import JobSpec, parse_spec
from training.engine import Engine
from workers.runners.adapters import load_peft_adapter
from workers.runners.base import JobContext
from workers.runners.engines import engine_for, policy_from_spec
from workers.runners.evaluation import run_eval
from workers.runners.inputs import base_model_path, dataset_rows, eval_job_rows
from workers.runners.loop import TrainingLoop


def _run_eval(ctx: JobContext, spec: JobSpec, engine: Engine) -> None:
    """Load the snapshot the spec names (or none: the base model) and evaluate it."""
    assert spec.eval is not None
    source: dict[str, Any] = {"from_job": spec.eval.from_job, "checkpoint": spec.eval.checkpoint}
    policy = None
    if spec.eval.from_job is not None:
        # The job that trained the snapshot shapes the policy it loads into.
        trained = parse_spec(Job.objects.get(pk=spec.eval.from_job).spec)
        policy = policy_from_spec(engine, trained, policy_id=f"eval-{ctx.job_id}-{ctx.attempt}")
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
        run_eval(ctx, spec, engine, eval_rows=eval_job_rows(spec), policy=policy, source=source)
    finally:
        if policy is not None:
            engine.remove_policy(policy.id)


def run(ctx: JobContext) -> None:
    """Run one attempt of an rl/sft job (resuming from the workdir's last checkpoint), or an
    eval job (a spec with `eval`)."""
    spec = ctx.job_spec
    device = ctx.devices[0] if ctx.devices else "cpu"
    engine = engine_for(base_model_path(spec), device)
    if spec.eval is not None:
        _run_eval(ctx, spec, engine)
        return
    rows, eval_rows = dataset_rows(spec)
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
