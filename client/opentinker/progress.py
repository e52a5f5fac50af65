"""The progress display of ``Job.wait``: step out of total, last reward, ETA."""

from __future__ import annotations

import sys
from typing import Self

from rich.console import Console
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    TextColumn,
    TimeElapsedColumn,
    TimeRemainingColumn,
)


class JobProgress:
    """A rich progress bar on stderr (stdout stays clean for ``--json``)."""

    def __init__(self, job_id: str, total: int | None, console: Console | None = None) -> None:
        self.console = console or Console(file=sys.stderr)
        self._progress = Progress(
            TextColumn("[bold]{task.description}"),
            BarColumn(),
            MofNCompleteColumn(),
            TextColumn("{task.fields[state]}"),
            TextColumn("{task.fields[reward]}"),
            TimeElapsedColumn(),
            TextColumn("eta"),
            TimeRemainingColumn(),
            console=self.console,
            transient=False,
        )
        self._task = self._progress.add_task(f"job {job_id[:8]}", total=total, state="", reward="")

    def __enter__(self) -> Self:
        self._progress.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._progress.stop()

    def update(self, *, step: int | None, state: str, reward: float | None) -> None:
        shown = f"reward {reward:.3f}" if reward is not None else ""
        self._progress.update(self._task, completed=step or 0, state=state, reward=shown)
