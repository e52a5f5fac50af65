"""Celery tasks: ``run_job`` and ``join_job`` on ``gpu.<node>``, ``reap`` on ``control``.

Tasks take primary keys and JSON only. ``run_job`` owns one attempt of one job: it proves it
still holds the lease, marks the job RUNNING, runs the runner with a background thread
renewing the lease every TTL/3, writes the metrics the runner left buffered, finishes the job
through ``jobs.services`` and releases the GPUs, whatever happened. A job across nodes runs
``run_job`` on its leader's node and ``join_job`` on each other member's node (`workers.gang`):
the followers hold no state of the job's; when one stops, the leader requeues the attempt.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from celery import shared_task
from celery.exceptions import SoftTimeLimitExceeded
from django.conf import settings

from jobs import services
from jobs.models import Job, JobState
from workers import audit, conf, control, gang, runners
from workers.celeryconf import ENFORCE_CANCEL_TASK, JOIN_JOB_TASK, REAP_TASK, RUN_JOB_TASK
from workers.devices import lease_devices
from workers.dispatcher import request_dispatch
from workers.leases import LeaseKeeper
from workers.locktable import GpuLockTable, Lease
from workers.outages import through_outage

log = logging.getLogger(__name__)

__all__ = ["enforce_cancel", "job_workdir", "join_job", "reap", "run_job"]


def job_workdir(job_id: str) -> Path:
    base = Path(getattr(settings, "OPENTINKER_DATA_DIR", "var"))
    path = base / "jobs" / str(job_id)
    path.mkdir(parents=True, exist_ok=True)
    return path


@shared_task(name=RUN_JOB_TASK, acks_late=True, ignore_result=True)
def run_job(job_id: str, *, attempt: int, node: str, gpus: list[int], lease_token: str) -> str:
    """Run one attempt of a job on the GPUs its lease names. Returns the outcome for logs."""
    table = GpuLockTable(conf.get_redis())
    lease = Lease(job_id=str(job_id), node=node, gpus=tuple(gpus), token=lease_token)
    # Proves the lease is still ours (a cancel or the reaper may have taken it while the task
    # waited in the queue) and marks it started so a cancel can no longer take it from under us.
    if table.renew(lease, conf.lease_seconds(), start=True) is None:
        log.info("job %s attempt %s: lease gone before start, nothing to do", job_id, attempt)
        return "lease-lost"
    row = Job.objects.filter(pk=job_id).values("spec").first()
    if row is None or not services.mark_running(job_id, attempt=attempt):
        table.release(lease)
        audit.lease_ended(str(job_id), attempt, "abandoned")
        request_dispatch()
        return "not-startable"

    spec: dict[str, Any] = row["spec"] or {}
    held = table.lease_of(str(job_id))
    members = [(n, list(g)) for n, g in held.blocks] if held is not None else [(node, list(gpus))]
    ctx = runners.JobContext(
        job_id=str(job_id),
        attempt=attempt,
        spec=spec,
        devices=lease_devices(table, node, gpus),
        workdir=job_workdir(job_id),
        node=node,
        gpus=list(gpus),
        members=members,
        cancel_check=control.is_cancel_requested,
        heartbeat_interval=conf.heartbeat_interval(),
    )
    keeper: LeaseKeeper = LeaseKeeper(table, lease, ctx.lose_lease)
    followers = [r.rank for r in gang.followers(spec, members)]
    if followers:
        keeper = gang.GangKeeper(
            table, lease, ctx.lose_lease, attempt=attempt, follower_ranks=followers
        )
    keeper.start()
    state, code, message = JobState.SUCCEEDED, "", ""
    requeue = ""
    try:
        runner = runners.runner_for(ctx.job_spec)
        runner(ctx)
        if ctx.stop_reason == "cancelled":
            state = JobState.CANCELLED
    except runners.JobCancelled:
        state = JobState.CANCELLED
    except runners.LeaseLost:
        ctx.lose_lease()
    except runners.MemberLost as exc:
        requeue = failure_message(exc)
    except SoftTimeLimitExceeded:
        state, code = JobState.FAILED, "timeout"
        message = f"exceeded its max runtime of {conf.job_max_runtime(spec)} s"
    except runners.UnknownMethod as exc:
        state, code, message = JobState.FAILED, "unknown_method", str(exc)
    except Exception as exc:
        state, code = JobState.FAILED, "runner_error"
        message = failure_message(exc)
        # The traceback is for the operator, in this worker's log; the job says what failed.
        log.exception("job %s failed", job_id)
    finally:
        # The runner may have buffered a few steps' metrics (cancel, failure, or a runner that
        # never flushes): they are stored while the attempt is still the job's live one.
        try:
            ctx.flush_metrics()
        except Exception:
            log.exception("job %s: could not write its last metrics", job_id)
        keeper.stop()
    lost_rank = getattr(keeper, "lost_rank", None)
    if lost_rank is not None and state is JobState.SUCCEEDED and ctx.stop_reason != "cancelled":
        requeue = requeue or f"rank {lost_rank} of the job stopped beating"

    outcome = "lease-lost"
    try:
        if requeue:
            # A member of the gang stopped: the attempt goes back to the queue (it resumes
            # from its last checkpoint), and the whole gang's GPUs with its one lease.
            requeued = services.requeue_job(
                job_id, attempt=attempt, reason=requeue, max_attempts=conf.max_attempts()
            )
            outcome = "requeued" if requeued else "stale"
        # After a lost lease the reaper (or a cancel) owns the job: this outcome does not count.
        elif not ctx.lease_lost:
            finished = services.finish_job(
                job_id, state, attempt=attempt, error_code=code, error_message=message
            )
            outcome = state.lower() if finished else "stale"
    finally:
        # The gang's keys go first: once the GPUs are free nothing of the attempt is left.
        if followers:
            through_outage(lambda: gang.clear(str(job_id), attempt), f"job {job_id}: gang keys")
        # Even if the database write failed: the GPUs go back now, and a job left RUNNING
        # without a lease is requeued by the reaper. Through a Redis outage these wait for the
        # server (the lease's TTL frees the GPUs if it stays away).
        if through_outage(lambda: table.release(lease), f"job {job_id}: release its GPUs"):
            audit.lease_ended(str(job_id), attempt, "released")
        through_outage(lambda: control.clear_cancel(str(job_id)), f"job {job_id}: clear flags")
    through_outage(request_dispatch, "dispatch after a job")
    log.info("job %s attempt %s: %s", job_id, attempt, outcome)
    return outcome


@shared_task(name=JOIN_JOB_TASK, ignore_result=True)
def join_job(
    job_id: str,
    *,
    attempt: int,
    node: str,
    gpus: list[int],
    lease_token: str,
    rank: int,
    world: int,
) -> str:
    """Run follower ``rank`` of a job's attempt on this node until the leader ends it: a
    data-parallel rank (native) or a node of the job's Ray cluster (verl). Not redelivered:
    a follower lost with its worker is the leader's to notice."""
    from workers.runners import native, verl
    from workers.runners.distributed import PeerLost

    table = GpuLockTable(conf.get_redis())

    def still_wanted() -> bool:
        held = table.lease_of(str(job_id))
        return held is not None and held.token == lease_token

    if not still_wanted():
        return "lease-lost"
    row = Job.objects.filter(pk=job_id, attempt=attempt).values("spec").first()
    if row is None:
        return "stale"
    spec: dict[str, Any] = row["spec"] or {}
    beat = gang.MemberBeat(str(job_id), attempt, rank)
    beat.beat()
    beat.start()
    outcome = "failed"
    workdir = job_workdir(job_id) / "ranks" / f"{attempt}-{rank}"
    workdir.mkdir(parents=True, exist_ok=True)
    devices = lease_devices(table, node, gpus)
    try:
        if spec.get("runner") == "verl":
            joined = verl.join(
                str(job_id),
                spec,
                attempt=attempt,
                rank=rank,
                node=node,
                gpus=list(gpus),
                devices=devices,
                workdir=workdir,
                still_wanted=still_wanted,
            )
        else:
            joined = native.join(
                str(job_id),
                spec,
                attempt=attempt,
                rank=rank,
                world=world,
                device=devices[0],
                workdir=workdir,
                still_wanted=still_wanted,
            )
        outcome = "done" if joined else "no-rendezvous"
    except PeerLost as exc:
        log.warning("job %s rank %s: %s", job_id, rank, exc)
        outcome = "peer-lost"
    except Exception:
        # The leader sees this rank leave (its collectives fail) and requeues the attempt.
        log.exception("job %s rank %s failed", job_id, rank)
    finally:
        beat.stop(done=outcome in ("done", "no-rendezvous"))
    log.info("job %s attempt %s rank %s: %s", job_id, attempt, rank, outcome)
    return outcome


# What a job's error_message may say of an exception: its words, not the process's internals
# (file paths, hosts and ports of the services it talks to).
MAX_FAILURE_CHARS = 500
INFRASTRUCTURE_ERRORS = {
    "ConnectionError": "lost the connection to Redis",
    "TimeoutError": "Redis did not answer in time",
    "OperationalError": "the database refused the operation",
}


def failure_message(exc: BaseException) -> str:
    """One line for the job's owner: the exception's class and message, without traceback."""
    name = type(exc).__name__
    module = type(exc).__module__.split(".")[0]
    if module in {"redis", "django"} and name in INFRASTRUCTURE_ERRORS:
        return f"the runner {INFRASTRUCTURE_ERRORS[name]} ({module} {name})"
    text = " ".join(str(exc).split())
    if len(text) > MAX_FAILURE_CHARS:
        text = text[: MAX_FAILURE_CHARS - 3] + "..."
    return f"{name}: {text}" if text else name


@shared_task(name=ENFORCE_CANCEL_TASK, ignore_result=True)
def enforce_cancel(job_id: str) -> bool:
    return control.enforce_cancel(job_id)


@shared_task(name=REAP_TASK, ignore_result=True)
def reap() -> dict[str, Any]:
    return control.reap()
