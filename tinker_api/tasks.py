"""Celery tasks of the Tinker protocol (found by ``app.autodiscover_tasks``).

Every Celery worker imports this module; the model worker (and torch with it) is imported
only when a task starts serving, so control and env workers never load torch.
"""

from __future__ import annotations

import json
import logging
import uuid
from collections.abc import Callable
from typing import TYPE_CHECKING

from celery import shared_task

from tinker_api import futures
from tinker_api.events import QUEUE_COUNTED
from tinker_api.services import sessions
from tinker_api.services.queue import SERVE_BASE_MODEL
from workers import conf
from workers.celeryconf import END_SILENT_SESSIONS_TASK
from workers.devices import lease_devices
from workers.dispatcher import request_dispatch
from workers.leases import LeaseKeeper
from workers.locktable import GpuLockTable, Lease

if TYPE_CHECKING:
    from tinker_api.worker.server import ModelWorker

log = logging.getLogger(__name__)


class Heartbeat(LeaseKeeper):
    """Renews the lease and the worker's registration every heartbeat interval."""

    def __init__(
        self,
        table: GpuLockTable,
        lease: Lease,
        base: str,
        worker_id: str,
        on_lost: Callable[[], None],
    ) -> None:
        super().__init__(table, lease, on_lost)
        self.name = f"tinker-worker-{base}"
        self.base, self.worker_id = base, worker_id

    def still_held(self) -> bool:
        ttl = conf.lease_seconds()
        if self.table.renew(self.lease, ttl) is None:
            # A Redis that restarted empty forgot the lease while this worker still runs on
            # the block; ending would lose its models' unsaved state, so take the block back
            # unless another lease has it by now.
            if self.table.reinstate(self.lease, ttl) is None:
                log.warning("lease %s was lost", self.lease.job_id)
                return False
            log.warning("lease %s was gone from Redis (emptied?): reinstated", self.lease.job_id)
        return futures.register_worker(self.base, self.worker_id, ttl)

    def check_now(self) -> None:
        """One heartbeat at once, from the serve loop: after Redis lost its data, another
        worker must not be started for this base model, nor its block be given to a job,
        while this one waits for its next heartbeat."""
        if not self.still_held():
            self.on_lost()


@shared_task(name=SERVE_BASE_MODEL, ignore_result=True)
def serve_base_model(
    base: str, *, base_path: str, node: str, gpus: list[int], lease_job_id: str, lease_token: str
) -> str:
    """Serve the Tinker requests of one base model on the leased block until idle."""
    # A Redis blink must not end the worker: its models' state since their last save lives
    # only in its memory. An outage longer than a lease ends it all the same (the lease,
    # and with it the block, is gone by then).
    with conf.redis_patience(conf.lease_seconds()):
        return _serve(
            base,
            base_path=base_path,
            node=node,
            gpus=gpus,
            lease_job_id=lease_job_id,
            lease_token=lease_token,
        )


def _serve(
    base: str, *, base_path: str, node: str, gpus: list[int], lease_job_id: str, lease_token: str
) -> str:
    table = GpuLockTable(conf.get_redis())
    lease = Lease(job_id=lease_job_id, node=node, gpus=tuple(gpus), token=lease_token)
    worker_id = f"{node}:{uuid.uuid4().hex[:12]}"
    try:
        if table.renew(lease, conf.lease_seconds(), start=True) is None:
            return "lease-lost"
        if not futures.register_worker(base, worker_id, conf.lease_seconds()):
            table.release(lease)
            return "another-worker"
    finally:
        futures.clear_starting(base)
    worker: ModelWorker | None = None
    heartbeat = Heartbeat(table, lease, base, worker_id, on_lost=lambda: None)
    heartbeat.start()
    outcome = "failed"
    try:
        # Imported here: the model worker imports torch (see the module docstring).
        from tinker_api.worker.server import ModelWorker

        device = lease_devices(table, node, gpus)[0]
        worker = ModelWorker(base, base_path, device, worker_id, node, gpus=len(gpus))
        heartbeat.on_lost = worker.stopping.set
        worker.on_data_lost = heartbeat.check_now
        outcome = worker.serve()
        if outcome in ("idle", "yielded", "shutdown"):
            # Still registered and holding the lease: no other worker serves these models
            # until this one is gone, so what it writes is their newest state.
            worker.policies.spill()
    except Exception as exc:
        log.exception("model worker for %s failed", base)
        outcome = f"failed: {exc}"
    finally:
        heartbeat.stop()
        if worker is not None:
            # The database's, first: a worker often ends because Redis is gone, and the calls
            # below would then raise before its last charges were written.
            worker.meter.flush(force=True)
        futures.unregister_worker(base, worker_id)
        futures.clear_epoch(worker_id)
        if worker is not None:
            worker.fail_everything(f"the model worker for {base} stopped ({outcome})")
        else:
            drain_failed(base, worker_id, f"the model worker for {base} could not start: {outcome}")
        table.release(lease)
        log.info("model worker %s for %s ended: %s", worker_id, base, outcome)
        # A queued job may have waited for this block: place it now, not at the reaper's
        # next pass.
        request_dispatch()
    return outcome


@shared_task(name=END_SILENT_SESSIONS_TASK, ignore_result=True)
def end_silent_sessions() -> int:
    """Periodic (beat): sessions whose client went away, whichever worker held them."""
    return sessions.end_abandoned_sessions(sessions.session_timeout())


def drain_failed(base: str, worker_id: str, reason: str) -> None:
    """Fail every request queued for ``base``: a worker that cannot load the base model must
    not leave clients polling futures nobody will run."""
    r = conf.get_redis()
    while True:
        try:
            got = r.xreadgroup(futures.GROUP, worker_id, {futures.stream_key(base): ">"}, count=512)
        except Exception as exc:
            if futures.is_nogroup(exc):
                return  # no stream (Redis lost its data): nothing queued to fail
            raise
        entries = [e for _s, batch in got or [] for e in batch]
        if not entries:
            return
        for entry_id, raw in entries:
            op = json.loads(raw[b"op"])
            futures.fail(str(op["rid"]), reason)
            if op.get("op") in QUEUE_COUNTED:
                futures.samples_answered(base, 1)
            r.xack(futures.stream_key(base), futures.GROUP, entry_id)
