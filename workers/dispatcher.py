"""The dispatcher: admits queued jobs onto GPU blocks.

Called after every submission commits and after every release (``request_dispatch``), and by
the reaper. One pass, under a Redis lock so two dispatchers never admit the same job twice:

1. Order the queued jobs by *effective priority*, then age (oldest first). Effective priority
   is the job's priority plus one point per ``OPENTINKER_AGING_SECONDS`` spent waiting, so a
   low-priority job does not wait forever behind a stream of high-priority ones.
2. Walk that order and try to allocate each job's block (all-or-nothing: one node, or for a
   job with ``gpus_per_node`` a gang of nodes under one lease).
3. A job that does not fit is skipped and smaller jobs behind it may *backfill* free GPUs,
   but only while it has waited less than ``OPENTINKER_BACKFILL_WINDOW_SECONDS``. Once it has
   waited longer it holds a *reservation*: the pass stops at it, nothing behind it is
   admitted, and GPUs drain until it fits; a gang reserves the same way, so a stream of small
   jobs cannot starve it. A job the live nodes could not hold even when idle (larger than
   every live node; a gang wanting more live nodes of its size than there are) gets no
   reservation (it could block the queue for good while its nodes are down).

A job of a team whose GPU-hours this month have reached its ``gpu_hours_per_month`` quota is
passed over before allocation (so it never reserves the pool), with a note saying so; the
reaper's pass, every few seconds, admits it once the quota is raised or the month turns.

An admitted job goes QUEUED -> STARTING (``jobs.services.mark_starting``, with the Celery task
id saved for revocation) and ``workers.tasks.run_job`` is sent to ``gpu.<node>``.
"""

from __future__ import annotations

import json
import logging
import uuid
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from celery import current_app
from django.utils import timezone
from redis.exceptions import LockError

from jobs import placement, services
from jobs.models import Job, JobState
from workers import audit, conf, gang
from workers.celeryconf import JOIN_JOB_TASK, RUN_JOB_TASK, node_queue
from workers.locktable import GpuLockTable, Lease, is_job_id

log = logging.getLogger(__name__)

__all__ = [
    "JOBS_WAITING_KEY",
    "KEY_PREFIX",
    "Candidate",
    "admission_order",
    "dispatch_once",
    "queued_candidates",
    "request_dispatch",
]

KEY_PREFIX = "ot:dispatch:"
LOCK_KEY = KEY_PREFIX + "lock"
PENDING_KEY = KEY_PREFIX + "pending"
# Far longer than one pass; only bounds how long a crashed dispatcher blocks the next one.
LOCK_TIMEOUT_SECONDS = 60
# Set while a job waits for GPUs that model workers hold (renewed by every dispatch pass, the
# reaper's included): a JSON list of the nodes where model workers serving nothing should
# leave before their idle time is up, those where their GPUs would let the job start.
JOBS_WAITING_KEY = KEY_PREFIX + "jobs-waiting"
JOBS_WAITING_SECONDS = 30
SCAN_LIMIT = 1000


@dataclass(frozen=True)
class Candidate:
    job_id: str
    priority: int
    gpus: int
    created: datetime
    attempt: int
    spec: dict[str, Any]
    team_id: int | None = None

    @property
    def gpus_per_node(self) -> int | None:
        per = self.spec.get("gpus_per_node")
        return int(per) if isinstance(per, int) and not isinstance(per, bool) else None

    def effective_priority(self, now: datetime, aging_seconds: int) -> float:
        waited = max(0.0, (now - self.created).total_seconds())
        return self.priority + waited // aging_seconds

    def waited(self, now: datetime) -> float:
        return max(0.0, (now - self.created).total_seconds())


def admission_order(
    candidates: list[Candidate], now: datetime, aging_seconds: int
) -> list[Candidate]:
    return sorted(
        candidates,
        key=lambda c: (-c.effective_priority(now, aging_seconds), c.created, c.job_id),
    )


def queued_candidates() -> list[Candidate]:
    """The queued jobs, highest priority and oldest first (at most ``SCAN_LIMIT``)."""
    rows = (
        Job.objects.filter(state=JobState.QUEUED)
        .order_by("-priority", "created")
        .values("id", "priority", "gpus_requested", "created", "attempt", "spec", "team_id")[
            :SCAN_LIMIT
        ]
    )
    return [
        Candidate(
            job_id=str(r["id"]),
            priority=int(r["priority"]),
            gpus=int(r["gpus_requested"]),
            created=r["created"],
            attempt=int(r["attempt"]),
            spec=r["spec"] or {},
            team_id=r["team_id"],
        )
        for r in rows
    ]


def _start(table: GpuLockTable, cand: Candidate, lease: Lease) -> bool:
    """Mark the job STARTING and send its task; on any failure give the GPUs back."""
    task_id = str(uuid.uuid4())
    if not services.mark_starting(
        cand.job_id, node=lease.node, gpus=lease.gpu_ids, task_id=task_id
    ):
        # Cancelled (or taken) between the scan and now.
        table.release(lease)
        return False
    audit.lease_acquired(lease, cand.attempt)
    try:
        _send(RUN_JOB_TASK, cand, lease, lease.node, lease.gpus, task_id=task_id)
        world = len(gang.ranks(lease.blocks))
        # A join_job for every follower the lease calls for, each on its node's queue.
        for member in gang.followers(cand.spec, lease.blocks):
            extra = {"rank": member.rank, "world": world}
            _send(JOIN_JOB_TASK, cand, lease, member.node, member.gpus, **extra)
    except Exception as exc:
        log.exception("could not send job %s to gpu.%s", cand.job_id, lease.node)
        table.release(lease)
        audit.lease_ended(cand.job_id, cand.attempt, "abandoned")
        services.requeue_job(
            cand.job_id,
            attempt=cand.attempt,
            reason=f"could not send the job to its worker: {exc}",
            max_attempts=conf.max_attempts(),
        )
        return False
    log.info("job %s -> %s (task %s)", cand.job_id, " ".join(lease.gpu_ids), task_id)
    return True


def _send(
    task: str,
    cand: Candidate,
    lease: Lease,
    node: str,
    gpus: tuple[int, ...],
    *,
    task_id: str | None = None,
    **extra: int,
) -> None:
    """One task of the attempt (``run_job`` or ``join_job``) to ``node``'s queue."""
    soft, hard = conf.task_time_limits(cand.spec)
    current_app.send_task(
        task,
        args=[cand.job_id],
        kwargs={
            "attempt": cand.attempt,
            "node": node,
            "gpus": list(gpus),
            "lease_token": lease.token,
            **extra,
        },
        queue=node_queue(node),
        task_id=task_id,
        soft_time_limit=soft,
        time_limit=hard,
    )


def dispatch_once(table: GpuLockTable | None = None, now: datetime | None = None) -> list[str]:
    """One admission pass (the caller holds the dispatch lock). Returns admitted job ids.

    Every job left waiting gets a note saying why (``Job.queue_note``); while a job waits
    for GPUs that model workers hold, ``JOBS_WAITING_KEY`` is set, which tells those serving
    nothing on the nodes where that would place it to give their blocks back early."""
    table = table or GpuLockTable(conf.get_redis())
    now = now or timezone.now()
    nodes = table.nodes()
    alive_sizes = [len(i["gpus"]) for i in nodes.values() if i["alive"]]
    if not alive_sizes:
        # Nothing could be placed: one UPDATE instead of the queue scan (every submit lands here).
        services.note_all_waiting("no GPU worker is running: no live node to place it on")
        return []
    candidates = queued_candidates()
    if not candidates:
        return []
    aging, window, ttl = conf.aging_seconds(), conf.backfill_window_seconds(), conf.lease_seconds()
    admitted: list[str] = []
    waiting: dict[str, str] = {}
    pool = _Pool(table)
    # Read without the quota lock: mark_starting checks again under it.
    spent = services.spent_budget_notes({c.team_id for c in candidates if c.team_id}, now)
    ordered_candidates = admission_order(candidates, now, aging)
    for i, cand in enumerate(ordered_candidates):
        if cand.team_id in spent:
            waiting[cand.job_id] = spent[cand.team_id]
            continue
        per_node = cand.gpus_per_node
        lease = table.allocate(cand.job_id, cand.gpus, ttl, per_node=per_node)
        if lease is None:
            if not placement.fits(alive_sizes, cand.gpus, per_node):
                waiting[cand.job_id] = (
                    f"needs {_gpus(cand.gpus, per_node)}: no live node can hold that "
                    f"(live nodes have {', '.join(map(str, sorted(set(alive_sizes))))} GPUs)"
                )
                continue
            pool.starved(cand.gpus, per_node)
            if cand.waited(now) >= window:
                log.info("job %s (%d GPUs) reserves the pool: no backfill", cand.job_id, cand.gpus)
                waiting[cand.job_id] = (
                    f"first in line for {_gpus(cand.gpus, per_node)} ({pool.describe()}): "
                    "jobs behind it wait until they are free"
                )
                for behind in ordered_candidates[i + 1 :]:
                    waiting[behind.job_id] = (
                        f"behind job {cand.job_id}, which waits for {_gpus(cand.gpus, per_node)}"
                    )
                break
            waiting[cand.job_id] = f"waiting for {_gpus(cand.gpus, per_node)} ({pool.describe()})"
            continue
        if _start(table, cand, lease):
            admitted.append(cand.job_id)
    pool.publish()
    services.note_waiting(waiting)
    return admitted


def _gpus(n: int, per_node: int | None) -> str:
    what = f"{n} GPU{'s' if n != 1 else ''}"
    return what if per_node is None else f"{what}, {per_node} a node"


class _Pool:
    """The pool as a pass found it once a job could not be placed (read once, when first
    needed): what waiting jobs' notes say, and whether model workers should make room."""

    def __init__(self, table: GpuLockTable) -> None:
        self.table = table
        self._live: list[dict[str, Any]] | None = None
        self._starved: set[str] = set()

    def live(self) -> list[dict[str, Any]]:
        if self._live is None:
            snap = self.table.snapshot()
            self._live = [dict(i, name=name) for name, i in snap["nodes"].items() if i["alive"]]
            for info in self._live:
                info["serving"] = sum(1 for h in info["held"].values() if not is_job_id(h))
        return self._live

    def starved(self, gpus: int, per_node: int | None) -> None:
        """A job of ``gpus`` waits: the nodes whose model workers should leave when idle are
        those where the free GPUs and the model workers' together would hold the job (its
        share of a node, for a gang). Jobs' GPUs are not counted: they leave when done."""
        need = gpus if per_node is None else per_node
        self._starved.update(
            i["name"] for i in self.live() if i["serving"] and len(i["free"]) + i["serving"] >= need
        )

    def publish(self) -> None:
        """Tell model workers on the starved nodes (``JOBS_WAITING_KEY``, renewed by every
        pass that still finds them so; it lapses when none does)."""
        if self._starved:
            self.table.redis.set(
                JOBS_WAITING_KEY, json.dumps(sorted(self._starved)), ex=JOBS_WAITING_SECONDS
            )

    def describe(self) -> str:
        live = self.live()
        free = sum(len(i["free"]) for i in live)
        serving = sum(i["serving"] for i in live)
        text = f"{free} of {sum(len(i['gpus']) for i in live)} free"
        if serving:
            text += f"; {serving} held by model workers, which give them back when idle"
        return text


def request_dispatch() -> list[str]:
    """Run dispatch passes until no request is pending; returns the job ids admitted here.

    Never blocks on another dispatcher: a caller that finds the lock taken leaves a pending
    mark, and the holder runs one more pass before it lets go, so no request is lost.
    """
    client = conf.get_redis()
    table = GpuLockTable(client)
    admitted: list[str] = []
    client.set(PENDING_KEY, "1")
    while True:
        lock = client.lock(LOCK_KEY, timeout=LOCK_TIMEOUT_SECONDS, blocking=False)
        if not lock.acquire(blocking=False):
            return admitted
        try:
            client.delete(PENDING_KEY)
            admitted.extend(dispatch_once(table))
        finally:
            try:
                lock.release()
            except LockError:  # expired under a very slow pass: the next holder carries on
                log.warning("dispatch lock expired before release")
        if not client.exists(PENDING_KEY):
            return admitted
