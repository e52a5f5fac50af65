"""An audit trail of GPU leases. Redis (``workers.locktable``) decides who holds a GPU;
these rows only record what it decided, for the admin and for accounting questions."""

from __future__ import annotations

from django.db import models


class GpuLeaseRecord(models.Model):
    class Outcome(models.TextChoices):
        HELD = "held", "Held"
        RELEASED = "released", "Released by its runner"
        REAPED = "reaped", "Expired and reclaimed"
        CANCELLED = "cancelled", "Taken back by a cancel"
        ABANDONED = "abandoned", "Never started"

    job = models.ForeignKey("jobs.Job", on_delete=models.CASCADE, related_name="gpu_leases")
    attempt = models.PositiveIntegerField()
    node = models.CharField(max_length=200)
    gpus = models.JSONField(default=list, help_text='["node:index", ...]')
    acquired = models.DateTimeField(auto_now_add=True, db_index=True)
    released = models.DateTimeField(null=True, blank=True)
    outcome = models.CharField(
        max_length=16, choices=Outcome.choices, default=Outcome.HELD, db_index=True
    )

    class Meta:
        ordering = ["-acquired"]
        constraints = [
            models.UniqueConstraint(fields=["job", "attempt"], name="gpulease_job_attempt")
        ]

    def __str__(self) -> str:
        return f"{self.job_id}#{self.attempt} on {self.node} {self.gpus} ({self.outcome})"
