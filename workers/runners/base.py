"""What a runner gets: the ``JobContext``."""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path
from types import ModuleType
from typing import Any

from jobs.spec import JobSpec, parse_spec

__all__ = ["METRICS_FLUSH_SECONDS", "JobCancelled", "JobContext", "LeaseLost", "MemberLost"]

# Longest a logged metric waits in the context's buffer while steps keep coming: the web UI
# polls every few seconds. A step slower than this writes its metrics at once.
METRICS_FLUSH_SECONDS = 1.0


def _job_services() -> ModuleType:
    # Lazy: verl's Ray workers import this package (the agent loop lives in it) without
    # Django, and jobs.services needs Django's app registry.
    from jobs import services

    return services


class JobCancelled(Exception):
    """A runner may raise this instead of returning when it sees ``ctx.cancelled()``."""


class LeaseLost(Exception):
    """The attempt lost its GPU lease (or was requeued): its results no longer count."""


class MemberLost(Exception):
    """Another member of a job across nodes stopped: the attempt is requeued (and resumes
    from its last checkpoint) with the whole gang's GPUs given back."""


@dataclass
class JobContext:
    """A job attempt as its runner sees it.

    ``devices`` are torch device strings for the leased block (``cuda:i`` or ``cpu``);
    ``workdir`` is private to the job and survives requeues (checkpoints go there).

    Metrics are buffered: ``log_metrics`` writes the buffer in one transaction once
    ``metrics_flush_interval`` seconds have passed since the last write, and ``flush_metrics``
    writes it now. A runner flushes before every checkpoint (so no step at or before a
    checkpoint can be lost with the process) and after an evaluation; the task flushes when
    the runner returns or raises. Steps lost with a killed process lie after the last
    checkpoint, and the resumed attempt runs them again.
    """

    job_id: str
    attempt: int
    spec: dict[str, Any]
    devices: list[str]
    workdir: Path
    node: str = ""
    gpus: list[int] = field(default_factory=list)
    # The lease's members, the leader (this node) first: [(node, [gpus])]; one for most jobs.
    members: list[tuple[str, list[int]]] = field(default_factory=list)
    # Redis cancel flag check; the task passes ``workers.control.is_cancel_requested``.
    cancel_check: Callable[[str], bool] | None = None
    heartbeat_interval: float = 10.0
    metrics_flush_interval: float = METRICS_FLUSH_SECONDS
    stop_reason: str | None = None  # "cancelled" or "lease_lost" once cancelled() said so
    _lost: threading.Event = field(default_factory=threading.Event, repr=False)
    _db_cancel: bool = field(default=False, repr=False)
    _last_heartbeat: float = field(default=0.0, repr=False)
    _pending_metrics: list[tuple[int, dict[str, float]]] = field(default_factory=list, repr=False)
    _last_flush: float = field(default=-math.inf, repr=False)

    # --- called by the runner -------------------------------------------------------------

    @cached_property
    def job_spec(self) -> JobSpec:
        """``spec`` validated, once per attempt: runners read this rather than parse again."""
        return parse_spec(self.spec)

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
        from jobs.models import Job  # lazy for the reason given at _job_services

        services = _job_services()
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
        services = _job_services()
        # Checked now, so a bad value fails the step that produced it.
        self._pending_metrics.append((step, services.check_metrics(step, metrics)))
        if time.monotonic() - self._last_flush >= self.metrics_flush_interval:
            self.flush_metrics()

    def flush_metrics(self) -> None:
        """Write the buffered metrics now (one transaction)."""
        services = _job_services()
        self._last_flush = time.monotonic()
        if not self._pending_metrics:
            return
        pending, self._pending_metrics = self._pending_metrics, []
        if not services.record_metric_steps(self.job_id, pending, attempt=self.attempt):
            self.lose_lease()

    def discard_metrics_after(self, step: int) -> None:
        """Forget the metrics of steps after ``step``, written or buffered: a run resumed from
        the checkpoint of ``step`` logs them again."""
        services = _job_services()
        self._pending_metrics = [(s, m) for s, m in self._pending_metrics if s <= step]
        if services.discard_metrics_after(self.job_id, step, attempt=self.attempt) is None:
            self.lose_lease()

    def event(self, message: str, data: Mapping[str, Any] | None = None) -> None:
        _job_services().add_event(self.job_id, "log", message, data)

    # --- called by the task ---------------------------------------------------------------

    def lose_lease(self) -> None:
        self._lost.set()

    @property
    def lease_lost(self) -> bool:
        return self._lost.is_set()
