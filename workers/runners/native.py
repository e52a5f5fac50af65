"""The native runner: ``method: rl`` and ``method: sft`` on this project's engine (CPU or GPU).

It resolves what the database knows (`workers.runners.inputs`: the base model's directory,
the dataset file and its test split), takes the process's engine for the base model
(`workers.runners.engines`) and hands the run to `workers.runners.loop.TrainingLoop`.
Artifacts land in the job's workdir, which survives requeues: ``checkpoints/`` (with
``checkpoints.jsonl``), ``eval/``, ``adapter/`` (PEFT) or ``model/`` (full fine-tuning) and
``summary.json``.

A job of several GPUs (on one node or, as a gang, across nodes) trains data-parallel, one rank
per leased GPU (`workers.runners.distributed`): rank 0 here, in the leader's task, with the
job's context; the others in `join`, each run by a ``join_job`` task on its GPU's node, with a
`FollowerContext` that reports nothing (rank 0 logs the whole batch's metrics, evaluates,
checkpoints and exports).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from environments.registry import frozen_opponent
from jobs import artifacts
from jobs.models import Job
from jobs.spec import JobSpec, parse_spec
from training.engine import Engine
from training.policy import Policy
from workers import conf, gang
from workers.runners.adapters import load_full_model, load_peft_adapter
from workers.runners.base import JobContext, MemberLost
from workers.runners.distributed import Collective, PeerLost
from workers.runners.engines import engine_for, policy_from_spec
from workers.runners.evaluation import run_eval
from workers.runners.inputs import base_model_path, dataset_rows, eval_job_rows
from workers.runners.loop import TrainingLoop
from workers.runners.loop_types import LoopContext
from workers.runners.rollouts import Opponent


def _init_weights(spec: JobSpec) -> Path | None:
    """Where the weights of `spec.init` lie: the job's checkpoint state or its final adapter
    (checked at submission; gone since, the run fails rather than start from scratch)."""
    if spec.init is None:
        return None
    job_id, checkpoint = spec.init.from_job, spec.init.checkpoint
    path = (
        artifacts.checkpoint_file(job_id, checkpoint)
        if checkpoint is not None
        else artifacts.adapter_dir(job_id)
    )
    if path is None:
        what = f"checkpoint {checkpoint!r}" if checkpoint is not None else "final adapter"
        raise LookupError(f"init: the {what} of job {job_id} is gone")
    return path


def _load_job_weights(
    engine: Engine, job_id: str | None, checkpoint: str | None, policy_id: str
) -> Policy | None:
    """A new engine policy holding job `job_id`'s final weights (its adapter, or its model for
    full fine-tuning), or its `checkpoint`; None for no job (the base model). The caller
    removes it from the engine."""
    if job_id is None:
        return None
    # The job that trained the weights shapes the policy they load into.
    trained = parse_spec(Job.objects.get(pk=job_id).spec)
    policy = policy_from_spec(engine, trained, policy_id=policy_id)
    try:
        if checkpoint is not None:
            path = artifacts.checkpoint_file(job_id, checkpoint)
            if path is None:
                raise LookupError(f"checkpoint {checkpoint!r} of job {job_id} is gone")
            policy.load_state(path)
        elif trained.full_finetune:
            model = artifacts.model_dir(job_id)
            if model is None:
                raise LookupError(f"job {job_id} has no final model")
            load_full_model(policy, model)
        else:
            adapter = artifacts.adapter_dir(job_id)
            if adapter is None:
                raise LookupError(f"job {job_id} has no final adapter")
            load_peft_adapter(policy, adapter)
    except BaseException:
        engine.remove_policy(policy.id)
        raise
    return policy


@contextmanager
def _frozen_opponent(engine: Engine, spec: JobSpec, policy_id: str) -> Iterator[Opponent | None]:
    """The frozen policy the job's env config plays against (environments.registry
    .frozen_opponent), loaded for the attempt and removed after it; None if it plays none."""
    wanted = frozen_opponent(str(spec.env), spec.env_config) if spec.env else None
    if wanted is None:
        yield None
        return
    policy = _load_job_weights(engine, wanted["job"], wanted["checkpoint"], policy_id)
    try:
        yield Opponent(policy.id if policy is not None else None)
    finally:
        if policy is not None:
            engine.remove_policy(policy.id)


def _run_eval(ctx: JobContext, spec: JobSpec, engine: Engine) -> None:
    """Load the snapshot the spec names (or none: the base model) and evaluate it."""
    assert spec.eval is not None
    source: dict[str, Any] = {"from_job": spec.eval.from_job, "checkpoint": spec.eval.checkpoint}
    tag = f"{ctx.job_id}-{ctx.attempt}"
    policy = _load_job_weights(engine, spec.eval.from_job, spec.eval.checkpoint, f"eval-{tag}")
    try:
        with _frozen_opponent(engine, spec, f"opponent-{tag}") as opponent:
            run_eval(
                ctx,
                spec,
                engine,
                eval_rows=eval_job_rows(spec),
                policy=policy,
                source=source,
                opponent=opponent,
            )
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
    plan = gang.ranks(ctx.members)
    collective = None
    if len(plan) > 1:
        collective = _host_ranks(ctx, len(plan), device)
    try:
        _train(ctx, spec, engine, rows, eval_rows, f"{ctx.job_id}-{ctx.attempt}", collective)
    except PeerLost as exc:
        raise MemberLost(str(exc)) from exc
    finally:
        if collective is not None:
            collective.close()


def _train(
    ctx: LoopContext,
    spec: JobSpec,
    engine: Engine,
    rows: list[dict[str, Any]] | None,
    eval_rows: list[dict[str, Any]] | None,
    tag: str,
    collective: Collective | None,
) -> None:
    """One rank's training run: policy `job-{tag}`, its frozen opponent `opponent-{tag}`."""
    with _frozen_opponent(engine, spec, f"opponent-{tag}") as opponent:
        loop = TrainingLoop(
            ctx,
            spec,
            engine,
            rows=rows,
            eval_rows=eval_rows,
            policy_id=f"job-{tag}",
            collective=collective,
            opponent=opponent,
            # Followers get rank 0's weights in `resume`'s broadcast; the files may be elsewhere.
            init_weights=_init_weights(spec)
            if collective is None or collective.rank == 0
            else None,
        )
        try:
            loop.run()
        finally:
            loop.close()


def _host_ranks(ctx: JobContext, world: int, device: str) -> Collective:
    try:
        return Collective.host(
            world=world,
            device=device,
            address=conf.node_address(),
            publish=lambda address: gang.publish_rendezvous(ctx.job_id, ctx.attempt, address),
            timeout_s=conf.gang_timeout(),
        )
    except PeerLost as exc:
        raise MemberLost(str(exc)) from exc


class FollowerContext:
    """A follower rank's `LoopContext`: rank 0 reports for the whole gang and decides when it
    stops, so this one only keeps a private scratch directory."""

    def __init__(self, workdir: Path, attempt: int) -> None:
        self.workdir = workdir
        self.attempt = attempt

    def cancelled(self) -> bool:
        return False

    def heartbeat(self, step: int | None = None, *, force: bool = False) -> None:
        pass  # the member's heartbeat is `gang.MemberBeat`, independent of step length

    def log_metrics(self, step: int, metrics: Mapping[str, float]) -> None:
        pass

    def flush_metrics(self) -> None:
        pass

    def discard_metrics_after(self, step: int) -> None:
        pass

    def event(self, message: str, data: Mapping[str, Any] | None = None) -> None:
        pass


def join(
    job_id: str,
    spec_data: dict[str, Any],
    *,
    attempt: int,
    rank: int,
    world: int,
    device: str,
    workdir: Path,
    still_wanted: Callable[[], bool],
) -> bool:
    """Run rank ``rank`` of a gang's attempt until rank 0 says stop. False when the attempt
    ended before this rank could join it (no rendezvous while the lease lasted)."""
    spec = parse_spec(spec_data)
    engine = engine_for(base_model_path(spec), device)
    rows, _ = dataset_rows(spec)
    timeout = conf.gang_timeout()
    address = gang.wait_rendezvous(job_id, attempt, timeout_s=timeout, still_wanted=still_wanted)
    if address is None:
        return False
    collective = Collective.join(
        rendezvous=address, rank=rank, world=world, device=device, timeout_s=timeout
    )
    try:
        tag = f"{job_id}-{attempt}-rank{rank}"
        _train(FollowerContext(workdir, attempt), spec, engine, rows, [], tag, collective)
    finally:
        collective.close()
    return True
