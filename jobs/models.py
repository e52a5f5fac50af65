"""Jobs, their events and metrics.

Rows here are changed only through ``jobs.services``: every state change is a conditional
UPDATE there, so the model has no state-changing methods.
"""

from __future__ import annotations

import functools
import json
import uuid
from pathlib import Path
from typing import Any

from django.conf import settings
from django.db import models


class JobState(models.TextChoices):
    QUEUED = "QUEUED", "Queued"
    STARTING = "STARTING", "Starting"
    RUNNING = "RUNNING", "Running"
    SUCCEEDED = "SUCCEEDED", "Succeeded"
    FAILED = "FAILED", "Failed"
    CANCELLED = "CANCELLED", "Cancelled"


FINAL_STATES = frozenset({JobState.SUCCEEDED, JobState.FAILED, JobState.CANCELLED})
# States in which a job holds GPUs (a lease in the lock table).
ACTIVE_STATES = frozenset({JobState.STARTING, JobState.RUNNING})


class JobKind(models.TextChoices):
    TRAIN = "train", "Train"
    EVAL = "eval", "Eval"


class Job(models.Model):
    id = models.UUIDField(primary_key=True, default=uuid.uuid4, editable=False)
    team = models.ForeignKey("accounts.Team", on_delete=models.CASCADE, related_name="jobs")
    created_by = models.ForeignKey(
        settings.AUTH_USER_MODEL,
        null=True,
        blank=True,
        on_delete=models.SET_NULL,
        related_name="jobs",
    )
    name = models.CharField(max_length=200)
    kind = models.CharField(max_length=16, choices=JobKind.choices, default=JobKind.TRAIN)
    spec = models.JSONField(help_text="The validated JobSpec, normalised (defaults filled in).")
    spec_version = models.PositiveSmallIntegerField()
    state = models.CharField(
        max_length=16, choices=JobState.choices, default=JobState.QUEUED, db_index=True
    )
    priority = models.SmallIntegerField(default=50)
    gpus_requested = models.PositiveSmallIntegerField(default=1)
    gpus_held = models.JSONField(default=list, blank=True, help_text='["node:index", ...]')
    node = models.CharField(max_length=200, blank=True, default="")
    attempt = models.PositiveIntegerField(default=1)
    celery_task_id = models.CharField(max_length=255, blank=True, default="")
    cancel_requested = models.BooleanField(default=False)
    cancel_requested_at = models.DateTimeField(
        null=True, blank=True, help_text="When a cancel was asked for: billing stops there."
    )
    created = models.DateTimeField(auto_now_add=True, db_index=True)
    started = models.DateTimeField(null=True, blank=True, help_text="Start of the current attempt.")
    finished = models.DateTimeField(null=True, blank=True)
    heartbeat = models.DateTimeField(null=True, blank=True)
    current_step = models.PositiveIntegerField(default=0)
    gpu_seconds = models.FloatField(default=0.0, help_text="GPU time of finished attempts.")
    error_code = models.CharField(max_length=64, blank=True, default="")
    error_message = models.TextField(blank=True, default="")
    queue_note = models.CharField(
        max_length=300,
        blank=True,
        default="",
        help_text="Why a queued job is still waiting, from the dispatcher's last pass.",
    )

    class Meta:
        indexes = [
            models.Index(fields=["team", "state"], name="job_team_state"),
            # The dispatcher's scan: queued jobs by priority, then age.
            models.Index(fields=["state", "-priority", "created"], name="job_dispatch_order"),
        ]

    def __str__(self) -> str:
        return f"{self.name} ({self.pk})"

    @property
    def is_final(self) -> bool:
        return self.state in FINAL_STATES


class JobEvent(models.Model):
    class Kind(models.TextChoices):
        STATE = "state", "State change"
        CANCEL_REQUESTED = "cancel_requested", "Cancel requested"
        LOG = "log", "Log"

    job = models.ForeignKey(Job, on_delete=models.CASCADE, related_name="events")
    created = models.DateTimeField(auto_now_add=True, db_index=True)
    kind = models.CharField(max_length=32)
    from_state = models.CharField(max_length=16, blank=True, default="")
    to_state = models.CharField(max_length=16, blank=True, default="")
    message = models.TextField(blank=True, default="")
    data = models.JSONField(default=dict, blank=True)

    class Meta:
        ordering = ["created", "id"]

    def __str__(self) -> str:
        return f"{self.job_id} {self.kind} {self.from_state}->{self.to_state}"


class GpuCharge(models.Model):
    """GPU time charged to a team for one calendar month (UTC): one row per ended attempt and
    month it ran in, so an attempt across a month boundary is charged to each month its
    share. ``Job.gpu_seconds`` is the sum over the job's attempts."""

    team = models.ForeignKey("accounts.Team", on_delete=models.CASCADE, related_name="+")
    job = models.ForeignKey(Job, on_delete=models.CASCADE, related_name="gpu_charges")
    month = models.DateField(help_text="The first day of the month (UTC).")
    attempt = models.PositiveIntegerField()
    gpu_seconds = models.FloatField()
    created = models.DateTimeField(auto_now_add=True)

    class Meta:
        indexes = [models.Index(fields=["team", "month"], name="gpucharge_team_month")]

    def __str__(self) -> str:
        return f"{self.job_id} #{self.attempt} {self.month:%Y-%m}: {self.gpu_seconds:g} GPU-s"


class ServingCharge(models.Model):
    """GPU time of the shared model workers charged to a team for one calendar month (UTC)
    and base model: the compute its Tinker, ``/v1`` and job-sample requests took, a batch's
    time split between the teams in it by their share of its rows (sampling) or its bytes
    (forward/backward). A worker's idle time is the service's. Workers add to the row."""

    team = models.ForeignKey("accounts.Team", on_delete=models.CASCADE, related_name="+")
    month = models.DateField(help_text="The first day of the month (UTC).")
    base_model = models.CharField(max_length=100)
    gpu_seconds = models.FloatField(default=0.0)
    requests = models.PositiveBigIntegerField(default=0)
    updated = models.DateTimeField(auto_now=True)

    class Meta:
        constraints = [
            models.UniqueConstraint(
                fields=["team", "month", "base_model"], name="servingcharge_team_month_base"
            )
        ]

    def __str__(self) -> str:
        month = f"{self.month:%Y-%m}"
        return f"team {self.team_id} {month} {self.base_model}: {self.gpu_seconds:g} GPU-s"


class JobMetric(models.Model):
    job = models.ForeignKey(Job, on_delete=models.CASCADE, related_name="metrics")
    step = models.PositiveIntegerField()
    name = models.CharField(max_length=100)
    value = models.FloatField()

    class Meta:
        constraints = [
            # A resumed run re-logs steps after its checkpoint; it overwrites, never duplicates.
            models.UniqueConstraint(fields=["job", "step", "name"], name="jobmetric_job_step_name")
        ]
        indexes = [models.Index(fields=["job", "name", "step"], name="jobmetric_series")]

    def __str__(self) -> str:
        return f"{self.job_id} {self.name}@{self.step}={self.value}"


class DatasetFormat(models.TextChoices):
    JSONL = "jsonl", "JSON Lines"
    PARQUET = "parquet", "Parquet"


class Dataset(models.Model):
    """A team's uploaded dataset, validated for one environment's schema at upload.

    The file lives at ``OPENTINKER_DATA_DIR / path`` (``datasets/<team id>/<id>.<format>``);
    ``path`` is relative so the data directory can move. Rows are created and deleted only
    through ``jobs.datasets`` (which writes and removes the file with them).
    """

    id = models.UUIDField(primary_key=True, default=uuid.uuid4, editable=False)
    team = models.ForeignKey("accounts.Team", on_delete=models.CASCADE, related_name="datasets")
    created_by = models.ForeignKey(
        settings.AUTH_USER_MODEL,
        null=True,
        blank=True,
        on_delete=models.SET_NULL,
        related_name="datasets",
    )
    name = models.CharField(max_length=200)
    env = models.CharField(max_length=200, help_text="Environment whose schema the file passed.")
    format = models.CharField(max_length=16, choices=DatasetFormat.choices)
    path = models.CharField(max_length=500, help_text="Relative to OPENTINKER_DATA_DIR.")
    rows = models.PositiveIntegerField()
    columns = models.JSONField(default=list, blank=True)
    sha256 = models.CharField(max_length=64)
    size_bytes = models.PositiveBigIntegerField()
    created = models.DateTimeField(auto_now_add=True, db_index=True)

    class Meta:
        constraints = [
            models.UniqueConstraint(fields=["team", "name"], name="dataset_team_name_unique")
        ]

    def __str__(self) -> str:
        return f"{self.name} ({self.team_id}/{self.pk})"

    @property
    def ref(self) -> str:
        """The canonical reference a job spec stores: immune to renames and name reuse."""
        return f"dataset:{self.pk}"

    def file_path(self) -> Path:
        return Path(settings.OPENTINKER_DATA_DIR) / self.path


class BaseModelQuerySet(models.QuerySet["BaseModel"]):
    def enabled(self) -> BaseModelQuerySet:
        return self.filter(enabled=True)


class BaseModel(models.Model):
    """A base model jobs may train on, managed by administrators in the admin."""

    name = models.SlugField(max_length=100, unique=True, help_text="What a JobSpec names.")
    path = models.CharField(
        max_length=500,
        help_text="Model directory; a relative path is resolved against the project root.",
    )
    hub_id = models.CharField(
        max_length=200,
        blank=True,
        default="",
        help_text=(
            "The Hugging Face id of this model (e.g. Qwen/Qwen2.5-0.5B-Instruct), which Tinker "
            "clients load its tokenizer from and tinker-cookbook picks its renderer by. Blank: "
            "the model directory's path, which only clients on this host can read."
        ),
    )
    max_lora_rank = models.PositiveIntegerField(default=64)
    max_context = models.PositiveIntegerField(default=1024, help_text="Tokens.")
    enabled = models.BooleanField(default=True)
    description = models.TextField(blank=True, default="")
    created = models.DateTimeField(auto_now_add=True)

    objects = BaseModelQuerySet.as_manager()

    class Meta:
        ordering = ["name"]
        verbose_name = "base model"

    def __str__(self) -> str:
        return self.name

    def resolved_path(self) -> Path:
        """The model directory on this host (resolved at call time, never stored absolute)."""
        path = Path(self.path).expanduser()
        return path if path.is_absolute() else Path(settings.BASE_DIR) / path

    def takes_images(self) -> bool | None:
        """Whether the model has a vision tower (its config names an image token); None
        when its config cannot be read on this host."""
        try:
            config = json.loads((self.resolved_path() / "config.json").read_text())
        except (OSError, ValueError):
            return None
        return config.get("image_token_id") is not None

    def module_names(self) -> frozenset[str] | None:
        """The dotted names of the language model's modules that hold weights, read from the
        safetensors headers (their index, or the file's JSON header) without loading a weight;
        None when they cannot be read on this host. What LoRA ``target_modules`` may name; the
        vision tower is left out, since LoRA adapts the language model only."""
        root = self.resolved_path()
        try:
            config = json.loads((root / "config.json").read_text())
            index = root / "model.safetensors.index.json"
            if index.is_file():
                tensors = list(json.loads(index.read_text())["weight_map"])
            else:
                tensors = list(_safetensors_header(root / "model.safetensors"))
        except (OSError, ValueError, KeyError, TypeError):
            return None
        names = {
            name.rsplit(".", 1)[0]
            for name in tensors
            if "." in name and "visual" not in name.split(".")[:2]
        }
        if config.get("tie_word_embeddings"):
            # A tied output head shares the embedding's weight, which is all the file stores;
            # the module is there all the same, under the name transformers gives it.
            names.add("lm_head")
        return frozenset(names)

    def longest_token_bytes(self) -> int | None:
        """The most UTF-8 bytes one token of the tokenizer spells (an upper bound: byte-level
        vocabularies spell a byte with a character of up to two), read from tokenizer.json;
        None when it cannot be read here. A text of more than this times the context cannot
        fit in it, which the web process can tell without tokenizing it."""
        path = self.resolved_path() / "tokenizer.json"
        try:
            return _longest_token_bytes(str(path), path.stat().st_mtime_ns)
        except (OSError, ValueError, KeyError, TypeError, AttributeError):
            return None


@functools.lru_cache(maxsize=32)
def _longest_token_bytes(path: str, _mtime_ns: int) -> int | None:
    data = json.loads(Path(path).read_text())
    vocab = data["model"]["vocab"]
    # BPE and WordPiece: {piece: id}; Unigram: [[piece, score], ...].
    pieces = list(vocab) if isinstance(vocab, dict) else [entry[0] for entry in vocab]
    pieces += [t["content"] for t in data.get("added_tokens") or []]
    return max((len(p.encode("utf-8")) for p in pieces), default=0) or None


# A safetensors file starts with the length of its JSON header (8 bytes, little endian). Real
# headers are kilobytes to a few megabytes: a larger length means a corrupt file, not a header
# worth reading into the web process.
MAX_SAFETENSORS_HEADER = 100 * 1024**2


def _safetensors_header(path: Path) -> dict[str, Any]:
    with path.open("rb") as f:
        size = int.from_bytes(f.read(8), "little")
        if not 0 < size <= MAX_SAFETENSORS_HEADER:
            raise ValueError(f"{path} has no safetensors header")
        header = json.loads(f.read(size))
    if not isinstance(header, dict):
        raise ValueError(f"{path} has no safetensors header")
    header.pop("__metadata__", None)
    return header
