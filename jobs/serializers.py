"""Serializers validate input and shape output; transitions live in ``jobs.services``."""

from __future__ import annotations

import base64
import binascii

from drf_spectacular.utils import extend_schema_field
from rest_framework import serializers

from accounts.validators import RefuseUnknownFields, validate_display_name

from .models import BaseModel, Dataset, DatasetFormat, Job, JobEvent, JobKind
from .sampling import MAX_SAMPLE_IMAGE_BYTES


class JobSerializer(serializers.ModelSerializer):
    team = serializers.SlugRelatedField(slug_field="slug", read_only=True)
    created_by = serializers.SlugRelatedField(slug_field="username", read_only=True)

    class Meta:
        model = Job
        fields = [
            "id",
            "team",
            "created_by",
            "name",
            "kind",
            "spec",
            "spec_version",
            "state",
            "priority",
            "gpus_requested",
            "gpus_held",
            "node",
            "attempt",
            "cancel_requested",
            "created",
            "started",
            "finished",
            "heartbeat",
            "current_step",
            "gpu_seconds",
            "error_code",
            "error_message",
            "queue_note",
        ]
        read_only_fields = fields


@extend_schema_field({"type": "object", "additionalProperties": True})
class JsonObjectField(serializers.JSONField):
    """A JSON object (documented as one: the JobSpec's own schema is served by the client)."""


class JobCreateSerializer(RefuseUnknownFields, serializers.Serializer):
    name = serializers.CharField(
        max_length=200,
        required=False,
        allow_blank=True,
        default="",
        validators=[validate_display_name],
    )
    kind = serializers.ChoiceField(choices=JobKind.choices, default=JobKind.TRAIN)
    spec = JsonObjectField(help_text="A JobSpec (see jobs/spec.py); validated server-side.")
    team = serializers.SlugField(
        required=False, help_text="Team slug; needed only when you belong to several teams."
    )

    def validate_spec(self, value: object) -> object:
        if not isinstance(value, dict):
            raise serializers.ValidationError("must be a JSON object.")
        return value


class JobEventSerializer(serializers.ModelSerializer):
    class Meta:
        model = JobEvent
        fields = ["id", "created", "kind", "from_state", "to_state", "message", "data"]
        read_only_fields = fields


class MetricSeriesSerializer(serializers.Serializer):
    series = serializers.DictField(
        child=serializers.ListField(child=serializers.ListField(child=serializers.FloatField())),
        help_text='{"reward/mean": [[step, value], ...]}, ordered by step.',
    )


class CheckpointSerializer(serializers.Serializer):
    name = serializers.CharField(help_text="e.g. 'step-000020' (native), 'global_step_20' (verl).")
    kind = serializers.CharField(
        help_text="'native': the native runner's state.pt; 'verl': verl's checkpoint directory."
    )
    format = serializers.CharField(help_text="How the download comes: 'pt' (torch.load) or 'zip'.")
    step = serializers.IntegerField(help_text="Training steps done when it was saved.")
    created = serializers.FloatField(help_text="Unix time of the save.")
    attempt = serializers.IntegerField(allow_null=True)
    eval = serializers.DictField(child=serializers.FloatField(), help_text="Last eval metrics.")
    size_bytes = serializers.IntegerField()
    download = serializers.URLField()


class ArtifactSerializer(serializers.Serializer):
    name = serializers.CharField(help_text="'adapter', 'model', 'summary.json' or 'eval/...'.")
    kind = serializers.CharField(help_text="adapter | model | summary | eval")
    format = serializers.CharField(help_text="How the download comes: zip, json or jsonl.")
    files = serializers.ListField(child=serializers.CharField())
    size_bytes = serializers.IntegerField()
    download = serializers.URLField()


class QuotaLimitsSerializer(serializers.Serializer):
    max_gpus = serializers.IntegerField()
    max_queued_jobs = serializers.IntegerField()
    gpu_hours_per_month = serializers.FloatField()
    openai_requests_per_minute = serializers.IntegerField(help_text="/v1 requests; 0: no limit.")
    openai_tokens_per_minute = serializers.IntegerField(help_text="/v1 tokens; 0: no limit.")


class QuotaUsageSerializer(serializers.Serializer):
    gpus_in_use = serializers.IntegerField()
    queued_jobs = serializers.IntegerField()
    gpu_hours_this_month = serializers.FloatField(
        help_text="Jobs' GPU time this month (UTC) plus the model workers' on the team's requests."
    )
    serving_gpu_hours_this_month = serializers.FloatField(
        help_text="The shared model workers' part: Tinker, /v1 and job-sample requests."
    )


class QuotaSerializer(serializers.Serializer):
    team = serializers.SlugField()
    limits = QuotaLimitsSerializer()
    usage = QuotaUsageSerializer()


class DatasetSerializer(serializers.ModelSerializer):
    team = serializers.SlugRelatedField(slug_field="slug", read_only=True)
    created_by = serializers.SlugRelatedField(slug_field="username", read_only=True)
    ref = serializers.CharField(
        read_only=True, help_text="What a submitted job's spec stores: 'dataset:<id>'."
    )

    class Meta:
        model = Dataset
        fields = [
            "id",
            "ref",
            "team",
            "created_by",
            "name",
            "env",
            "format",
            "rows",
            "columns",
            "sha256",
            "size_bytes",
            "created",
        ]
        read_only_fields = fields


class DatasetUploadSerializer(RefuseUnknownFields, serializers.Serializer):
    """Presence and shape only; ``jobs.datasets.store_dataset`` validates the content."""

    file = serializers.FileField(
        help_text="A .jsonl or .parquet file, or a .zip of one .jsonl file and the image files "
        "its rows name (stored as JSONL with the images inline)."
    )
    name = serializers.CharField(
        max_length=200, help_text="Unique within the team.", validators=[validate_display_name]
    )
    env = serializers.CharField(
        max_length=200, help_text="The environment whose dataset schema the file must follow."
    )
    format = serializers.ChoiceField(
        choices=[*DatasetFormat.choices, ("zip", "Zip of a JSONL file and its images")],
        required=False,
        help_text="Overrides the format guessed from the file name's extension.",
    )
    team = serializers.SlugField(
        required=False, help_text="Team slug; needed only when you belong to several teams."
    )


class BaseModelSerializer(serializers.ModelSerializer):
    class Meta:
        model = BaseModel
        fields = ["name", "max_lora_rank", "max_context", "description"]
        read_only_fields = fields


class SampleMessageSerializer(RefuseUnknownFields, serializers.Serializer):
    role = serializers.ChoiceField(choices=["system", "user", "assistant"])
    content = serializers.CharField(max_length=20_000, allow_blank=True, trim_whitespace=False)


class SampleRequestSerializer(RefuseUnknownFields, serializers.Serializer):
    """Bounded on purpose: quick looks at a policy, answered by a model worker between the
    requests it serves (``/v1/completions`` is the way to heavier generation)."""

    prompt = serializers.CharField(
        required=False, max_length=20_000, trim_whitespace=False, help_text="Raw text to continue."
    )
    messages = SampleMessageSerializer(
        many=True, required=False, help_text="A chat, rendered with the base model's template."
    )
    max_tokens = serializers.IntegerField(min_value=1, max_value=256, default=64)
    temperature = serializers.FloatField(min_value=0.0, max_value=2.0, default=1.0)
    n = serializers.IntegerField(min_value=1, max_value=8, default=1)
    seed = serializers.IntegerField(min_value=0, max_value=2**31 - 1, required=False)
    image = serializers.CharField(
        required=False,
        max_length=(MAX_SAMPLE_IMAGE_BYTES + 2) // 3 * 4 + 64,
        help_text=(
            "A picture (PNG or JPEG, base64 or a data:image/...;base64 URI) shown after the "
            "last message's text; vision-language base models only."
        ),
    )

    def validate_image(self, value: str) -> bytes:
        head, comma, payload = value.partition(",")
        if comma:
            if not (head.startswith("data:image/") and head.endswith(";base64")):
                raise serializers.ValidationError("a data URI must be data:image/...;base64,...")
        else:
            payload = value
        try:
            data = base64.b64decode(payload, validate=True)
        except (binascii.Error, ValueError) as exc:
            raise serializers.ValidationError(f"the base64 is invalid: {exc}") from None
        if not data.startswith((b"\x89PNG\r\n\x1a\n", b"\xff\xd8\xff")):
            raise serializers.ValidationError("must be a PNG or JPEG picture.")
        return data

    def validate(self, attrs: dict) -> dict:  # type: ignore[type-arg]
        if ("prompt" in attrs) == ("messages" in attrs):
            raise serializers.ValidationError("give exactly one of `prompt` or `messages`.")
        if "messages" in attrs and not attrs["messages"]:
            raise serializers.ValidationError({"messages": ["must not be empty."]})
        return attrs


class SampleSerializer(serializers.Serializer):
    text = serializers.CharField()
    tokens = serializers.ListField(child=serializers.IntegerField())
    stop_reason = serializers.CharField(help_text="'stop' or 'length'.")


class SampleResponseSerializer(serializers.Serializer):
    job = serializers.UUIDField()
    samples = SampleSerializer(many=True)
