"""Keeping a GPU lease alive while the work it pays for runs.

Shared by the job runner task (``workers.tasks.run_job``) and the model workers of the Tinker
protocol, which renew more beside the lease (``still_held`` is their hook).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable

from workers import conf
from workers.locktable import GpuLockTable, Lease

log = logging.getLogger(__name__)

__all__ = ["LeaseKeeper"]


class LeaseKeeper(threading.Thread):
    """Renews a lease every heartbeat interval; tells its owner when the lease is lost."""

    def __init__(self, table: GpuLockTable, lease: Lease, on_lost: Callable[[], object]) -> None:
        super().__init__(name=f"lease-{lease.job_id}", daemon=True)
        self.table = table
        self.lease = lease
        self.on_lost = on_lost
        self.stopping = threading.Event()

    def still_held(self) -> bool:
        """One renewal; False once the lease is gone. Subclasses renew more beside it."""
        if self.table.renew(self.lease, conf.lease_seconds()) is None:
            log.warning("lease %s was lost", self.lease.job_id)
            return False
        return True

    def run(self) -> None:
        while not self.stopping.wait(conf.heartbeat_interval()):
            try:
                if not self.still_held():
                    self.on_lost()
                    return
            except Exception:
                # Redis briefly unreachable: the lease has two more intervals before it expires.
                log.exception("could not renew lease %s", self.lease.job_id)

    def stop(self) -> None:
        self.stopping.set()
        self.join(timeout=5)
