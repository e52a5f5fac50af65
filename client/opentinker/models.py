"""Typed views of the server's JSON. Unknown fields are ignored so that a newer server with
more fields still talks to an older client."""

from __future__ import annotations

from datetime import datetime
from typing import Any
from uuid import UUID

from pydantic import BaseModel, ConfigDict, Field

FINAL_STATES = frozenset({"SUCCEEDED", "FAILED", "CANCELLED"})


class _Model(BaseModel):
    model_config = ConfigDict(extra="ignore", frozen=True)


class JobRecord(_Model):
    """A job as ``GET /api/v1/jobs/{id}`` returns it."""

    id: UUID
    team: str
    created_by: str | None = None
    name: str = ""
    kind: str = "train"
    spec: dict[str, Any] = Field(default_factory=dict)
    spec_version: int = 1
    state: str
    priority: int = 50
    gpus_requested: int = 1
    gpus_held: list[str] = Field(default_factory=list)
    node: str = ""
    attempt: int = 1
    cancel_requested: bool = False
    created: datetime
    started: datetime | None = None
    finished: datetime | None = None
    heartbeat: datetime | None = None
    current_step: int | None = None
    gpu_seconds: float = 0.0
    error_code: str = ""
    error_message: str = ""
    # Why a queued job still waits (older servers do not send it).
    queue_note: str = ""

    @property
    def is_final(self) -> bool:
        return self.state in FINAL_STATES

    @property
    def total_steps(self) -> int | None:
        """Steps the spec asks for (smoke jobs: ``smoke_steps``)."""
        method = self.spec.get("method")
        key = "smoke_steps" if method == "smoke" else "steps"
        value = self.spec.get(key, 5 if method == "smoke" else None)
        return value if isinstance(value, int) else None


class JobEvent(_Model):
    id: int
    created: datetime
    kind: str
    from_state: str = ""
    to_state: str = ""
    message: str = ""
    data: Any = None


class Metrics(_Model):
    """Time series by metric name: ``series["reward/mean"] == [(step, value), ...]``."""

    series: dict[str, list[tuple[float, float]]] = Field(default_factory=dict)

    def last(self, name: str) -> float | None:
        points = self.series.get(name)
        return points[-1][1] if points else None

    def final(self) -> dict[str, float]:
        """Each metric's value at its last step."""
        return {name: points[-1][1] for name, points in self.series.items() if points}

    def steps(self, name: str) -> list[int]:
        return [int(step) for step, _ in self.series.get(name, [])]


class Checkpoint(_Model):
    name: str
    step: int
    created: float
    attempt: int | None = None
    eval: dict[str, float] = Field(default_factory=dict)
    size_bytes: int = 0
    download: str = ""


class Artifact(_Model):
    name: str
    kind: str
    format: str = ""
    files: list[str] = Field(default_factory=list)
    size_bytes: int = 0
    download: str = ""


class Team(_Model):
    id: int
    name: str
    slug: str
    role: str | None = None
    created: datetime | None = None


class ApiKey(_Model):
    id: int
    name: str
    prefix: str
    team: str
    created_by: str | None = None
    created: datetime | None = None
    last_used: datetime | None = None
    expires_at: datetime | None = None
    revoked_at: datetime | None = None
    rotated_to: int | None = None
    active: bool = True


class IssuedApiKey(ApiKey):
    """A new key: ``key`` is the secret, shown by the server this once."""

    key: str


class Dataset(_Model):
    id: UUID
    ref: str
    team: str
    created_by: str | None = None
    name: str
    env: str
    format: str
    rows: int
    columns: list[str] = Field(default_factory=list)
    sha256: str = ""
    size_bytes: int = 0
    created: datetime | None = None


class Me(_Model):
    username: str
    teams: list[Team] = Field(default_factory=list)
    key: ApiKey | None = None


class QuotaLimits(_Model):
    max_gpus: int
    max_queued_jobs: int
    gpu_hours_per_month: float
    openai_requests_per_minute: int = 0
    """0: no limit."""
    openai_tokens_per_minute: int = 0


class QuotaUsage(_Model):
    gpus_in_use: int
    queued_jobs: int
    gpu_hours_this_month: float
    serving_gpu_hours_this_month: float = 0.0
    """The shared model workers' time on the team's requests (part of the above)."""


class Quota(_Model):
    team: str
    limits: QuotaLimits
    usage: QuotaUsage


class BaseModelInfo(_Model):
    name: str
    max_lora_rank: int
    max_context: int
    description: str = ""
