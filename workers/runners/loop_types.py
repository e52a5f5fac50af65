"""What the native training loop's modules share: the context they report to, their error,
and the layout of the job's workdir (no Django, no torch in here)."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any, Protocol

__all__ = [
    "ADAPTER_DIR",
    "CHECKPOINT_DIR",
    "EVAL_DIR",
    "MODEL_DIR",
    "SUMMARY_FILE",
    "LoopContext",
    "TrainingError",
]

CHECKPOINT_DIR = "checkpoints"
ADAPTER_DIR = "adapter"
MODEL_DIR = "model"
EVAL_DIR = "eval"
SUMMARY_FILE = "summary.json"


class LoopContext(Protocol):
    """The job as the loop sees it: ``workers.runners.base.JobContext`` in the service,
    anything with these methods in a notebook or a benchmark."""

    workdir: Path
    attempt: int

    def cancelled(self) -> bool: ...

    def heartbeat(self, step: int | None = None, *, force: bool = False) -> None: ...

    def log_metrics(self, step: int, metrics: Mapping[str, float]) -> None: ...

    def flush_metrics(self) -> None: ...

    def discard_metrics_after(self, step: int) -> None: ...

    def event(self, message: str, data: Mapping[str, Any] | None = None) -> None: ...


class TrainingError(RuntimeError):
    """A job that cannot run as specified (bad data, context too small, ...)."""
