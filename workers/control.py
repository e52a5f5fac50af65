"""Cancelling a job that holds GPUs, the reaper that ends what its worker abandoned, and the
flag by which a Celery worker that is shutting down tells its long-running tasks."""

from __future__ import annotations

import logging
import os
import socket
from datetime import timedelta
from typing import Any

import redis
from celery import current_app
from django.utils import timezone

from jobs import services
from jobs.models import ACTIVE_STATES, Job, JobState
from workers import audit, conf
from workers.celeryconf import CONTROL_QUEUE, ENFORCE_CANCEL_TASK
from workers.dispatcher import request_dispatch
from workers.locktable import GpuLockTable, Lease
from workers.outages import RateLimitedWarning

log = logging.getLogger(__name__)

__all__ = [
    "CANCEL_PREFIX",
    "cancel_running",
    "clear_cancel",
    "clear_stopping",
    "enforce_cancel",
    "is_cancel_requested",
    "is_stopping",
    "mark_stopping",
    "reap",
]

CANCEL_PREFIX = "ot:cancel:"
# The flag outlives any job; it is deleted when the job's runner ends.
CANCEL_FLAG_SECONDS = 8 * 24 * 3600

# How long a started runner has to stop by itself at a step boundary (a clean end: buffered
# metrics written, no half-written checkpoint) before the canceller takes its GPUs back.
CANCEL_GRACE_SECONDS = 2.0

STOPPING_PREFIX = "ot:stopping:"
STOPPING_FLAG_SECONDS = 3600


def _stopping_key(pid: int) -> str:
    return f"{STOPPING_PREFIX}{socket.gethostname()}:{pid}"


def mark_stopping() -> None:
    """This Celery worker (the calling main process) is shutting down: tasks that serve until
    idle (model workers) end at their next check instead of holding the shutdown for their idle
    time. Called from the worker's shutdown handler; Redis being unreachable is not fatal."""
    try:
        conf.get_redis().set(_stopping_key(os.getpid()), "1", ex=STOPPING_FLAG_SECONDS)
    except Exception:  # a shutdown must not fail on this
        log.warning("could not flag this worker as stopping", exc_info=True)


def clear_stopping() -> None:
    """Forget a flag left by an earlier worker with this host name and pid (a restarted
    container runs its worker as the same pid on the same host name)."""
    try:
        conf.get_redis().delete(_stopping_key(os.getpid()))
    except Exception:  # the broker connection reports an unreachable Redis
        log.warning("could not clear this worker's stopping flag", exc_info=True)


def is_stopping() -> bool:
    """Whether the Celery worker running this process is shutting down: the parent of a
    prefork pool child, or this process itself under the solo and threads pools."""
    keys = {_stopping_key(os.getpid()), _stopping_key(os.getppid())}
    return bool(conf.get_redis().exists(*keys))


def _table() -> GpuLockTable:
    return GpuLockTable(conf.get_redis())


_cancel_flag_unreachable = RateLimitedWarning(log)


def is_cancel_requested(job_id: str) -> bool:
    """The Redis cancel flag. While Redis is unreachable the answer is "not seen here": the
    job row carries the cancel as well, and the runner reads it at every heartbeat."""
    try:
        return bool(conf.get_redis().exists(f"{CANCEL_PREFIX}{job_id}"))
    except redis.RedisError as exc:
        _cancel_flag_unreachable("cancel flags unreadable, Redis unreachable (%s)", exc)
        return False


def clear_cancel(job_id: str) -> None:
    conf.get_redis().delete(f"{CANCEL_PREFIX}{job_id}")


def _revoke(task_id: str) -> None:
    if not task_id:
        return
    try:
        # No terminate: a started runner stops at its next step and releases its own GPUs;
        # killing it mid-write could leave a half-written checkpoint.
        current_app.control.revoke(task_id)
    except Exception:
        log.exception("could not revoke task %s", task_id)


def cancel_running(job_id: str) -> None:
    """Stop a STARTING or RUNNING job (``jobs.services.cancel_job`` calls this on commit).

    Sets the cancel flag the runner checks every step and revokes the Celery task. A job whose
    task has not started yet has its lease taken back here and ends CANCELLED at once; a
    started runner ends the job itself within one step. If the runner is gone, its lease
    expires and the reaper ends the job CANCELLED.
    """
    job_id = str(job_id)
    conf.get_redis().set(f"{CANCEL_PREFIX}{job_id}", "1", ex=CANCEL_FLAG_SECONDS)
    row = Job.objects.filter(pk=job_id).values("state", "attempt", "celery_task_id").first()
    if row is None:
        return
    if row["state"] == JobState.STARTING and _table().release_unstarted(job_id):
        audit.lease_ended(job_id, row["attempt"], "cancelled")
        services.finish_job(job_id, JobState.CANCELLED, attempt=row["attempt"])
        _revoke(row["celery_task_id"])
        request_dispatch()
        return
    _revoke(row["celery_task_id"])
    # The runner stops at its next step; a step can be long on a loaded machine, so the
    # block is taken back when the grace period is over, whatever the runner is doing.
    current_app.send_task(
        ENFORCE_CANCEL_TASK, args=[job_id], countdown=CANCEL_GRACE_SECONDS, queue=CONTROL_QUEUE
    )


def enforce_cancel(job_id: str) -> bool:
    """End a cancelled job whose runner has not stopped within ``CANCEL_GRACE_SECONDS``: its
    GPUs go back to the pool and the job is CANCELLED now. The runner finds its lease gone
    at its next check and stops; its own finish is then stale. False when there was nothing
    left to do (the runner stopped in time, or the job already ended)."""
    job_id = str(job_id)
    row = (
        Job.objects.filter(pk=job_id, state__in=ACTIVE_STATES, cancel_requested=True)
        .values("attempt")
        .first()
    )
    if row is None:
        return False
    if _table().release_job(job_id):
        audit.lease_ended(job_id, row["attempt"], "cancelled")
    ended = services.finish_job(job_id, JobState.CANCELLED, attempt=row["attempt"])
    request_dispatch()
    if ended:
        log.info("job %s: cancelled, its runner had not stopped within the grace period", job_id)
    return ended


def reap() -> dict[str, Any]:
    """Reclaim expired leases and end or requeue their jobs; then dispatch.

    A job whose lease expired goes back to the queue with attempt + 1 (or FAILED after
    ``OPENTINKER_MAX_ATTEMPTS``; or CANCELLED if a cancel was requested), through
    ``jobs.services.requeue_job``. A STARTING/RUNNING job with no lease at all (Redis lost its
    state) is treated the same once it has been silent for two lease periods. A node that let
    a lease expire is withdrawn from placement until its worker refreshes it again. A lease
    held by a service (a Tinker model worker) is reclaimed and logged: there is no job to
    requeue, and the service's next request starts a new worker.

    The running jobs of a team whose GPU-hours this month are spent are stopped as a cancel
    stops them (``jobs.services.stop_jobs_over_budget``): a team overruns its month by at most
    one reaper period times the GPUs it holds (billing stops at the stop request).

    Each lease and job is handled on its own: one that fails is logged and the pass goes on,
    since the leases are already reclaimed and a job skipped here would stay STARTING or
    RUNNING on GPUs it no longer holds.
    """
    table = _table()
    requeued: list[str] = []
    reclaimed = [lease for lease in table.expired() if table.reclaim(lease)]
    # A node that let a lease expire has most likely lost its worker: take it out of
    # placement before requeueing (each requeue dispatches), so the job does not go straight
    # back to it. A live worker's announcer marks it alive again within one heartbeat.
    for node in {lease.node for lease in reclaimed}:
        table.withdraw(node)
    for lease in reclaimed:
        try:
            if _end_reclaimed(lease):
                requeued.append(lease.job_id)
        except Exception:
            log.exception(
                "reaper: could not end %s, whose lease on %s expired", lease.job_id, lease.node
            )

    try:
        stopped = services.stop_jobs_over_budget()
    except Exception:
        stopped = []
        log.exception("reaper: could not stop the jobs of teams over their GPU-hours")

    # A cancel whose scheduled enforcement was lost (a worker restart) is enforced here.
    overdue = timezone.now() - timedelta(seconds=2 * CANCEL_GRACE_SECONDS)
    for job_id in Job.objects.filter(
        state__in=ACTIVE_STATES, cancel_requested=True, cancel_requested_at__lt=overdue
    ).values_list("id", flat=True):
        try:
            if enforce_cancel(str(job_id)):
                requeued.append(str(job_id))
        except Exception:
            log.exception("reaper: could not enforce the cancel of job %s", job_id)

    silent_since = timezone.now() - timedelta(seconds=2 * conf.lease_seconds())
    stale = Job.objects.filter(state__in=ACTIVE_STATES, heartbeat__lt=silent_since).values_list(
        "id", "attempt"
    )
    for job_id, attempt in stale:
        try:
            if _requeue_leaseless(table, str(job_id), attempt):
                requeued.append(str(job_id))
        except Exception:
            log.exception("reaper: could not requeue job %s, which holds no lease", job_id)
    admitted = request_dispatch()
    reclaimed_ids = [lease.job_id for lease in reclaimed]
    if stopped:
        log.info("reaper: stopping %s: their teams' GPU-hours this month are spent", stopped)
    if reclaimed or requeued:
        log.info("reaper: reclaimed %s, requeued or ended %s", reclaimed_ids, requeued)
    return {
        "reclaimed": reclaimed_ids,
        "requeued": requeued,
        "admitted": admitted,
        "stopped_over_budget": stopped,
    }


def _end_reclaimed(lease: Lease) -> bool:
    """End what held ``lease``, now reclaimed; True when a job was requeued or ended."""
    audit.lease_ended(lease.job_id, None, "reaped")
    if not lease.is_job:
        log.warning(
            "reaper: reclaimed %s from %s, which stopped heartbeating (not a job: nothing to"
            " requeue)",
            " ".join(lease.gpu_ids),
            lease.job_id,
        )
        return False
    row = Job.objects.filter(pk=lease.job_id).values("state", "attempt").first()
    if row is None or row["state"] not in ACTIVE_STATES:
        return False
    reason = f"lease on {lease.node} expired: its worker stopped heartbeating"
    ended = services.requeue_job(
        lease.job_id, attempt=row["attempt"], reason=reason, max_attempts=conf.max_attempts()
    )
    clear_cancel(lease.job_id)
    return ended


def _requeue_leaseless(table: GpuLockTable, job_id: str, attempt: int) -> bool:
    if table.lease_of(job_id) is not None:
        return False
    if not services.requeue_job(
        job_id,
        attempt=attempt,
        reason="the job held no GPU lease (control-plane state lost)",
        max_attempts=conf.max_attempts(),
    ):
        return False
    audit.lease_ended(job_id, attempt, "reaped")
    return True
