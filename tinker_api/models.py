"""What the Tinker protocol persists: sessions, training models (runs), sampling sessions and
checkpoints. Every row belongs to the team of the API key that created it; lookups go through
the ``for_team`` managers so another team's id reads as unknown.

Live training state (weights, optimizer) lives in the model worker's memory; the database
holds what survives it: the configuration to rebuild a model and the checkpoints on disk.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from django.conf import settings
from django.db import models
from django.utils import timezone


class TeamScopedQuerySet(models.QuerySet):
    def for_team(self, team_id: int) -> TeamScopedQuerySet:
        return self.filter(team_id=team_id)


class TinkerSession(models.Model):
    """One ``ServiceClient``: created at its first call, kept alive by heartbeats."""

    id = models.CharField(primary_key=True, max_length=64)
    team = models.ForeignKey("accounts.Team", on_delete=models.CASCADE, related_name="+")
    api_key = models.ForeignKey(
        "accounts.ApiKey", on_delete=models.SET_NULL, null=True, blank=True, related_name="+"
    )
    tags = models.JSONField(default=list, blank=True)
    user_metadata = models.JSONField(null=True, blank=True)
    # Given at creation, shown back by GET /sessions/{id}; nothing here groups by project.
    display_name = models.CharField(max_length=256, blank=True)
    project_id = models.CharField(max_length=256, blank=True)
    sdk_version = models.CharField(max_length=64, blank=True)
    created = models.DateTimeField(default=timezone.now)
    last_heartbeat = models.DateTimeField(default=timezone.now)
    finished_at = models.DateTimeField(null=True, blank=True)
    finish_reason = models.CharField(max_length=16, blank=True)
    finish_detail = models.TextField(blank=True)

    objects = TeamScopedQuerySet.as_manager()

    class Meta:
        ordering = ("-created",)

    def __str__(self) -> str:
        return self.id

    @property
    def finished(self) -> bool:
        return self.finished_at is not None


class TrainingModel(models.Model):
    """A LoRA training client's model, also its training run (``tinker://<id>/...``).

    The id follows the SDK's convention ``"{session_id}:train:{model_seq_id}"``.
    """

    id = models.CharField(primary_key=True, max_length=96)
    session = models.ForeignKey(TinkerSession, on_delete=models.CASCADE, related_name="models")
    team = models.ForeignKey("accounts.Team", on_delete=models.CASCADE, related_name="+")
    created_by = models.ForeignKey(
        settings.AUTH_USER_MODEL, on_delete=models.SET_NULL, null=True, related_name="+"
    )
    base_model = models.CharField(max_length=100, help_text="BaseModel registry name.")
    lora_rank = models.PositiveIntegerField()
    seed = models.BigIntegerField(default=0)
    train_unembed = models.BooleanField(default=True)
    train_mlp = models.BooleanField(default=True)
    train_attn = models.BooleanField(default=True)
    optimizer_config = models.JSONField(default=dict)
    user_metadata = models.JSONField(null=True, blank=True)
    # Where the model starts: a training checkpoint loaded at creation (load_weights), if any.
    init_checkpoint = models.CharField(max_length=300, blank=True)
    created = models.DateTimeField(default=timezone.now)
    last_request = models.DateTimeField(default=timezone.now)

    objects = TeamScopedQuerySet.as_manager()

    class Meta:
        ordering = ("-created",)

    def __str__(self) -> str:
        return self.id

    def spill_path(self) -> Path:
        """Where a model worker that leaves (idle, or its Celery worker stopping) writes this
        model's live state, so that the next worker takes it up where it was left."""
        return Path(settings.OPENTINKER_DATA_DIR) / f"tinker/{self.team_id}/{self.id}/live.pt"

    def drop_spill(self) -> None:
        """Delete the live state a model worker left, once no one will take it up."""
        self.spill_path().unlink(missing_ok=True)

    def worker_config(self) -> dict[str, Any]:
        """What a model worker needs to build this model's policy (JSON)."""
        return {
            "rank": self.lora_rank,
            "seed": self.seed,
            "train_unembed": self.train_unembed,
            "train_mlp": self.train_mlp,
            "train_attn": self.train_attn,
        }


class SamplingSession(models.Model):
    """A ``SamplingClient``: the base model, or a sampler checkpoint of a training model."""

    id = models.CharField(primary_key=True, max_length=120)
    session = models.ForeignKey(
        TinkerSession, on_delete=models.CASCADE, null=True, related_name="sampling_sessions"
    )
    team = models.ForeignKey("accounts.Team", on_delete=models.CASCADE, related_name="+")
    base_model = models.CharField(max_length=100)
    model_path = models.CharField(max_length=300, blank=True)
    checkpoint = models.ForeignKey(
        "Checkpoint", on_delete=models.SET_NULL, null=True, blank=True, related_name="+"
    )
    created = models.DateTimeField(default=timezone.now)

    objects = TeamScopedQuerySet.as_manager()

    def __str__(self) -> str:
        return self.id


_SEGMENTS = {"training": "weights", "sampler": "sampler_weights", "external": "external_weights"}


class Checkpoint(models.Model):
    """A saved state (``training``: weights + optimizer), sampler weights (``sampler``) or an
    export to download (``external``: the adapter as the cookbook's ``weights`` reads it)."""

    class Kind(models.TextChoices):
        TRAINING = "training"
        SAMPLER = "sampler"
        EXTERNAL = "external"

    model = models.ForeignKey(TrainingModel, on_delete=models.CASCADE, related_name="checkpoints")
    team = models.ForeignKey("accounts.Team", on_delete=models.CASCADE, related_name="+")
    kind = models.CharField(max_length=16, choices=Kind.choices)
    name = models.CharField(max_length=200)
    file = models.CharField(max_length=500, help_text="Relative to OPENTINKER_DATA_DIR.")
    size_bytes = models.BigIntegerField(null=True, blank=True)
    step = models.PositiveIntegerField(default=0)
    # The in-memory snapshot a worker published for it (sampler kind), for fast sampling.
    version = models.IntegerField(null=True, blank=True)
    user_metadata = models.JSONField(null=True, blank=True)
    # The seq_id of the save that wrote the row: a resubmission of that save (its claim had
    # expired) reuses the row where another save of the name is refused.
    seq = models.BigIntegerField(null=True, blank=True)
    created = models.DateTimeField(default=timezone.now)
    expires_at = models.DateTimeField(null=True, blank=True)
    # Published (``publish_checkpoint_from_tinker_path``): listed as public. Teams are the
    # only accounts here and a team sees all its checkpoints, so nothing else changes.
    public = models.BooleanField(default=False)

    objects = TeamScopedQuerySet.as_manager()

    class Meta:
        ordering = ("-created",)
        constraints = (
            models.UniqueConstraint(fields=["model", "kind", "name"], name="tinker_ckpt_unique"),
        )

    def __str__(self) -> str:
        return self.tinker_path

    @property
    def tinker_path(self) -> str:
        return f"tinker://{self.model_id}/{self.segment}/{self.name}"

    @property
    def segment(self) -> str:
        """The kind's word in ``tinker://`` paths and checkpoint ids."""
        return _SEGMENTS[self.kind]

    def file_path(self) -> Path:
        return Path(settings.OPENTINKER_DATA_DIR) / self.file

    @property
    def written(self) -> bool:
        """The model worker wrote its file (a row exists from its save's submission on)."""
        return self.size_bytes is not None and self.file_path().exists()
