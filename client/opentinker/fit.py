"""``fit()``: one call from keyword arguments to a trained adapter on disk."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .client import Client, Job
from .errors import JobFailed, SpecError
from .spec import check_spec


@dataclass(frozen=True)
class FitResult:
    job: Job
    metrics: dict[str, float]
    """Each metric's value at its last step."""
    adapter_path: Path | None
    """The unpacked PEFT adapter (None for jobs that produce none, e.g. smoke)."""


def fit(
    *,
    client: Client | None = None,
    name: str = "",
    team: str | None = None,
    progress: bool = True,
    output_dir: str | Path = ".",
    timeout: float | None = None,
    **spec: Any,
) -> FitResult:
    """Build a JobSpec from the keyword arguments, submit it, follow it to the end with a
    progress bar, download the adapter and return the final metrics.

    >>> fit(method="rl", env="math", dataset="add2", steps=20, rollout={"group_size": 8})

    Raises ``JobFailed`` if the job ends FAILED or CANCELLED, ``ValidationError`` (from the
    server) or ``SpecError`` (unknown keyword, before anything is sent) for a bad spec, and
    ``WaitTimeout`` after ``timeout`` seconds (the job keeps running).
    """
    own = client is None
    client = client or Client()
    try:
        errors = check_spec(spec, client.jobspec_schema())
        if errors:
            raise SpecError(
                "invalid job spec: " + "; ".join(f"{e['field']}: {e['reason']}" for e in errors),
                errors,
            )
        job = client.jobs.submit(spec, name=name, team=team)
        job.wait(progress=progress, timeout=timeout)
        if job.state != "SUCCEEDED":
            raise JobFailed(job.record)
        metrics = job.metrics().final()
        adapter = None
        if any(a.name == "adapter" for a in job.artifacts()):
            adapter = job.download_artifact("adapter", Path(output_dir) / job.id)
        return FitResult(job=job, metrics=metrics, adapter_path=adapter)
    finally:
        if own:
            client.close()
