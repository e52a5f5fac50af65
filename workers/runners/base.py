"""What a runner gets: the ``JobContext``."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

__all__ = ["JobCancelled", "JobContext", "LeaseLost"]


class JobCancelled(Exception):
    """A runner may raise this instead of returning when it sees ``ctx.cancelled()``."""


class LeaseLost(Exception):
    """The attempt lost its GPU lease (or was requeued): its results no longer count."""


@dataclass
class JobContext:
    """A job attempt as its runner sees it.

    ``devices`` are torch device strings for the leased block (``cuda:i`` or ``cpu``);
    ``workdir`` is private to the job and survives requeues (checkpoints go there).
    """

    job_id: str
    attempt: int
    spec: dict[str, Any]
    devices: list[str]
    workdir: Path
    node: str = ""
    gpus: list[int] = field(default_factory=list)
    # Redis cancel flag check; the task passes ``workers.control.is_cancel_requested``.
    cancel_check: Callable[[str], bool] | None = None
    heartbeat_interval: float = 10.0
    stop_reason: str | None = None  # "cancelled" or "lease_lost" once cancelled() said so
    _lost: threading.Event = field(default_factory=threading.Event, repr=False)
    _db_cancel: bool = field(default=False, repr=False)
    _last_heartbeat: float = field(default=0.0, repr=False)

    # --- called by the runner -------------------------------------------------------------

    def cancelled(self) -> bool:
        """True when the runner must stop now: a cancel was requested or the lease was lost."""
        if self._lost.is_set():
            self.stop_reason = "lease_lost"
            return True
        if self._db_cancel or (self.cancel_check is not None and self.cancel_check(self.job_id)):
            self.stop_reason = "cancelled"
            return True
        return False

    def heartbeat(self, step: int | None = None, *, force: bool = False) -> None:
        """Record progress; written to the job row at most every ``heartbeat_interval``."""
        from jobs import services
        from jobs.models import Job

        now = time.monotonic()
        if not force and now - self._last_heartbeat < self.heartbeat_interval:
            return
        self._last_heartbeat = now
        if not services.heartbeat(self.job_id, attempt=self.attempt, step=step):
            self.lose_lease()
            return
        # The job row is a second cancel channel, in case the Redis flag was never set.
        self._db_cancel = bool(Job.objects.filter(pk=self.job_id, cancel_requested=True).exists())

    def log_metrics(self, step: int, metrics: Mapping[str, float]) -> None:
        from jobs import services

        if not services.record_metrics(self.job_id, step, dict(metrics), attempt=self.attempt):
            self.lose_lease()

    def event(self, message: str, data: Mapping[str, Any] | None = None) -> None:
        from jobs import services

        services.add_event(self.job_id, "log", message, data)

    # --- called by the task ---------------------------------------------------------------

    def lose_lease(self) -> None:
        self._lost.set()

    @property
    def lease_lost(self) -> bool:
        return self._lost.is_set()
