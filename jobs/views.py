"""API v1: jobs (submit, list, cancel, events, metrics), the team quota, datasets and the
base-model list."""

from __future__ import annotations

import math
from collections import defaultdict
from types import SimpleNamespace

from django.core.files.uploadhandler import FileUploadHandler, SkipFile
from django.db.models import QuerySet
from django.http import HttpRequest
from django.http.response import HttpResponseBase
from drf_spectacular.types import OpenApiTypes
from drf_spectacular.utils import OpenApiParameter, OpenApiResponse, extend_schema
from rest_framework import mixins, status, viewsets
from rest_framework.decorators import action
from rest_framework.exceptions import NotFound, ValidationError
from rest_framework.negotiation import DefaultContentNegotiation
from rest_framework.parsers import FormParser, MultiPartParser
from rest_framework.request import Request
from rest_framework.response import Response
from rest_framework.views import APIView

from accounts.exceptions import Conflict
from accounts.filters import refuse_unknown_params
from accounts.models import Quota
from accounts.pagination import CheckedCursorPagination
from accounts.scoping import resolve_team, team_ids_for

from . import artifacts, datasets, downloads, sampling, services
from .filters import DatasetFilter, JobFilter
from .models import BaseModel, Dataset, Job, JobEvent, JobMetric
from .quotas import BudgetSpent
from .serializers import (
    ArtifactSerializer,
    BaseModelSerializer,
    CheckpointSerializer,
    DatasetSerializer,
    DatasetUploadSerializer,
    JobCreateSerializer,
    JobEventSerializer,
    JobSerializer,
    MetricSeriesSerializer,
    QuotaSerializer,
    SampleRequestSerializer,
    SampleResponseSerializer,
)
from .spec import SpecError

# What an artifact file is, by suffix: the schema promises these types (mimetypes knows no
# jsonl and would guess differently per platform).
FILE_TYPES = {".json": "application/json", ".jsonl": "application/jsonl"}


class EventCursorPagination(CheckedCursorPagination):
    # Events read as a log: oldest first.
    ordering = ("created", "id")
    page_size = 100
    page_size_query_param = "limit"
    max_page_size = 1000


# Files and zipped directories take one byte range (jobs.downloads): a broken download of a
# multi-gigabyte checkpoint continues where it stopped.
RANGE_RESPONSES = {
    (206, "application/octet-stream"): OpenApiResponse(
        OpenApiTypes.BINARY,
        description="the bytes the Range header asked for (Content-Range says which)",
    ),
    (416, "application/json"): OpenApiResponse(
        OpenApiTypes.OBJECT,
        description="{detail, range, size}: the range starts past the end of the file",
    ),
}
RANGE_HEADERS = [
    OpenApiParameter(
        "Range",
        str,
        OpenApiParameter.HEADER,
        description="One range, bytes=START-[END] or bytes=-SUFFIX; more than one gets the "
        "whole file.",
    ),
    OpenApiParameter(
        "If-Range",
        str,
        OpenApiParameter.HEADER,
        description="The ETag of an earlier answer: the range only if the file is unchanged.",
    ),
]


def spec_error_response(errors: list[dict[str, str]]) -> Response:
    return Response(
        {"detail": "invalid job spec", "errors": errors}, status=status.HTTP_400_BAD_REQUEST
    )


class JobViewSet(
    mixins.CreateModelMixin,
    mixins.ListModelMixin,
    mixins.RetrieveModelMixin,
    viewsets.GenericViewSet,
):
    """Jobs of the caller's teams. Another team's job answers 404."""

    serializer_class = JobSerializer
    filterset_class = JobFilter

    def get_queryset(self) -> QuerySet[Job]:
        return Job.objects.filter(team_id__in=team_ids_for(self.request)).select_related(
            "team", "created_by"
        )

    @extend_schema(request=JobCreateSerializer, responses={201: JobSerializer})
    def create(self, request: Request, *args: object, **kwargs: object) -> Response:
        data = JobCreateSerializer(data=request.data)
        data.is_valid(raise_exception=True)
        team = resolve_team(request, data.validated_data.get("team"))
        try:
            job = services.submit_job(
                team=team,
                user=request.user,
                spec=data.validated_data["spec"],
                name=data.validated_data["name"],
                kind=data.validated_data["kind"],
            )
        except SpecError as exc:
            return spec_error_response(exc.errors)
        except services.GpuRequestTooLarge as exc:
            return spec_error_response([{"field": exc.field, "reason": str(exc)}])
        except services.QuotaExceeded as exc:
            return Response(
                {
                    "detail": str(exc),
                    "quota": exc.quota,
                    "limit": exc.limit,
                    "current": exc.current,
                },
                status=(
                    status.HTTP_429_TOO_MANY_REQUESTS
                    if exc.retryable
                    else status.HTTP_403_FORBIDDEN
                ),
            )
        return Response(
            JobSerializer(job, context={"request": request}).data, status=status.HTTP_201_CREATED
        )

    @extend_schema(request=None, responses={200: JobSerializer})
    @action(detail=True, methods=["post"])
    def cancel(self, request: Request, pk: str | None = None) -> Response:
        """Cancel: a queued job at once, a running one cooperatively (GPUs freed in seconds)."""
        job = self.get_object()
        try:
            job = services.cancel_job(job, by=request.user)
        except services.IllegalTransition as exc:
            raise Conflict(str(exc)) from exc
        return Response(JobSerializer(job, context={"request": request}).data)

    @extend_schema(responses={200: JobEventSerializer(many=True)})
    @action(
        detail=True, methods=["get"], pagination_class=EventCursorPagination, filterset_class=None
    )
    def events(self, request: Request, pk: str | None = None) -> Response:
        """The job's event log, oldest first."""
        job = self.get_object()
        refuse_unknown_params(request, set(), self.paginator)
        page = self.paginate_queryset(JobEvent.objects.filter(job=job))
        return self.get_paginated_response(JobEventSerializer(page, many=True).data)

    @extend_schema(
        parameters=[
            OpenApiParameter("name", str, many=True, description="Only these metric names."),
            OpenApiParameter("since_step", int, description="Only steps >= this one."),
        ],
        responses={200: MetricSeriesSerializer},
    )
    @action(detail=True, methods=["get"], pagination_class=None, filterset_class=None)
    def metrics(self, request: Request, pk: str | None = None) -> Response:
        """Time series by metric name: ``{"series": {"reward/mean": [[step, value], ...]}}``."""
        job = self.get_object()
        refuse_unknown_params(request, {"name", "since_step"})
        rows = JobMetric.objects.filter(job=job)
        names = request.query_params.getlist("name")
        if any("\x00" in n for n in names):
            # PostgreSQL cannot compare text with a NUL in it: the query itself would fail.
            raise ValidationError({"name": ["Null characters are not allowed."]})
        if names:
            rows = rows.filter(name__in=names)
        since = request.query_params.get("since_step")
        if since is not None:
            try:
                rows = rows.filter(step__gte=int(since))
            except ValueError as exc:
                raise ValidationError({"since_step": ["must be an integer."]}) from exc
        series: dict[str, list[list[float]]] = defaultdict(list)
        for name, step, value in rows.order_by("name", "step").values_list("name", "step", "value"):
            series[name].append([step, value])
        return Response({"series": dict(series)})

    @extend_schema(responses={200: CheckpointSerializer(many=True)})
    @action(detail=True, methods=["get"], pagination_class=None, filterset_class=None)
    def checkpoints(self, request: Request, pk: str | None = None) -> Response:
        """Saved training states, oldest first; each downloads from its ``download`` URL."""
        job = self.get_object()
        rows = [
            {**c, "download": request.build_absolute_uri(f"checkpoints/{c['name']}")}
            for c in artifacts.checkpoints(job.pk)
        ]
        return Response(CheckpointSerializer(rows, many=True).data)

    @extend_schema(
        responses={
            (200, "application/octet-stream"): OpenApiResponse(
                OpenApiTypes.BINARY, description="a native checkpoint's state.pt"
            ),
            (200, "application/zip"): OpenApiResponse(
                OpenApiTypes.BINARY, description="a verl checkpoint directory"
            ),
            **RANGE_RESPONSES,
        },
        parameters=RANGE_HEADERS,
    )
    @action(
        detail=True,
        methods=["get"],
        url_path=r"checkpoints/(?P<name>[A-Za-z0-9_.-]+)",
        pagination_class=None,
        filterset_class=None,
    )
    def checkpoint_download(
        self, request: Request, pk: str | None = None, name: str = ""
    ) -> HttpResponseBase:
        """A native checkpoint's ``state.pt`` (weights, AdamW state, step, RNG; ``torch.load``;
        ``Range`` continues a broken download), or a verl checkpoint's ``global_step_N``
        directory as a zip."""
        job = self.get_object()
        path = artifacts.checkpoint_download(job.pk, name)
        if path is None:
            raise NotFound(f"job has no checkpoint {name!r}")
        if path.is_dir():
            return downloads.zip_response(
                request, job.pk, path, f"{job.pk}-{name}.zip", compress=False
            )
        return downloads.file_response(
            request,
            path,
            filename=f"{job.pk}-{name}-state.pt",
            content_type="application/octet-stream",
        )

    @extend_schema(responses={200: ArtifactSerializer(many=True)})
    @action(detail=True, methods=["get"], pagination_class=None, filterset_class=None)
    def artifacts(self, request: Request, pk: str | None = None) -> Response:
        """The final adapter (PEFT, as a zip), the run summary, the eval transcripts and the
        metrics (``metrics.jsonl``, one ``{"step", "name", "value"}`` per line)."""
        job = self.get_object()
        found = artifacts.artifacts(job.pk)
        metric_rows = JobMetric.objects.filter(job=job).count()
        if metric_rows:
            found.append(
                {
                    "name": artifacts.METRICS_ARTIFACT,
                    "kind": "metrics",
                    "format": "jsonl",
                    "files": [artifacts.METRICS_ARTIFACT],
                    "size_bytes": 0,  # written on download, from the job's metric rows
                }
            )
        rows = [
            {**a, "download": request.build_absolute_uri(f"artifacts/{a['name']}")} for a in found
        ]
        return Response(ArtifactSerializer(rows, many=True).data)

    @extend_schema(request=SampleRequestSerializer, responses={200: SampleResponseSerializer})
    @action(detail=True, methods=["post"], pagination_class=None, filterset_class=None)
    def sample(self, request: Request, pk: str | None = None) -> Response:
        """Generate from the job's final weights on the model worker of its base model
        (bounded: see jobs.sampling); 409 without one, 429 while the team or the queue is
        full, 403 once the team's GPU-hours this month are spent, 503 when no model worker
        answers."""
        job = self.get_object()
        params = SampleRequestSerializer(data=request.data)
        params.is_valid(raise_exception=True)
        data = params.validated_data
        try:
            samples = sampling.sample_from_job(
                job,
                prompt=data.get("prompt"),
                messages=[dict(m) for m in data["messages"]] if "messages" in data else None,
                max_tokens=data["max_tokens"],
                temperature=data["temperature"],
                n=data["n"],
                seed=data.get("seed"),
                image=data.get("image"),
            )
        except sampling.NoAdapter as exc:
            raise Conflict(str(exc)) from exc
        except sampling.BadSampleRequest as exc:
            raise ValidationError({exc.field: [exc.reason]}) from exc
        except sampling.SamplerBusy as exc:
            return Response(
                {"detail": str(exc)},
                status=status.HTTP_429_TOO_MANY_REQUESTS,
                # Whole seconds (RFC 9110), never less than the wait the message gives.
                headers={"Retry-After": str(max(1, math.ceil(exc.retry_after)))},
            )
        except sampling.SamplerUnavailable as exc:
            return Response({"detail": str(exc)}, status=status.HTTP_503_SERVICE_UNAVAILABLE)
        except BudgetSpent as exc:
            return Response(
                {
                    "detail": str(exc),
                    "quota": exc.quota,
                    "limit": exc.limit_hours,
                    "current": round(exc.used_hours, 4),
                },
                status=status.HTTP_403_FORBIDDEN,
            )
        return Response({"job": str(job.pk), "samples": samples})

    @extend_schema(
        responses={
            (200, "application/zip"): OpenApiResponse(
                OpenApiTypes.BINARY, description="a directory (adapter, model)"
            ),
            (200, "application/json"): OpenApiResponse(
                OpenApiTypes.OBJECT, description="the run summary"
            ),
            (200, "application/jsonl"): OpenApiResponse(
                OpenApiTypes.STR,
                description="metrics.jsonl (one {step, name, value} per line) and eval/*.jsonl",
            ),
            **RANGE_RESPONSES,
        },
        parameters=RANGE_HEADERS,
    )
    @action(
        detail=True,
        methods=["get"],
        url_path=r"artifacts/(?P<name>[A-Za-z0-9_.-]+(?:/[A-Za-z0-9_.-]+)?)",
        pagination_class=None,
        filterset_class=None,
    )
    def artifact_download(
        self, request: Request, pk: str | None = None, name: str = ""
    ) -> HttpResponseBase:
        """One artifact: a directory (``adapter``, ``model``) as a zip, a file as it is (``Range``
        continues a broken download)."""
        job = self.get_object()
        if name == artifacts.METRICS_ARTIFACT:
            rows = JobMetric.objects.filter(job=job).order_by("step", "name")
            return downloads.jsonl_response(
                (
                    {"step": step, "name": metric, "value": value}
                    for step, metric, value in rows.values_list("step", "name", "value").iterator(
                        chunk_size=2000
                    )
                ),
                filename=f"{job.pk}-metrics.jsonl",
            )
        path = artifacts.artifact_path(job.pk, name)
        if path is None:
            raise NotFound(f"job has no artifact {name!r}")
        if path.is_dir():
            return downloads.zip_response(request, job.pk, path, f"{job.pk}-{name}.zip")
        return downloads.file_response(
            request,
            path,
            filename=f"{job.pk}-{name.replace('/', '-')}",
            content_type=FILE_TYPES.get(path.suffix, "application/octet-stream"),
        )


class QuotaView(APIView):
    """The team's quota limits and current usage.

    With an API key: the key's team. Otherwise ``?team=<slug>``, optional for members of
    exactly one team.
    """

    @extend_schema(
        parameters=[OpenApiParameter("team", str, description="Team slug.")],
        responses={200: QuotaSerializer},
    )
    def get(self, request: Request) -> Response:
        slug = request.query_params.get("team")
        try:
            team = resolve_team(request, slug)
        except ValidationError:
            if slug:
                # Reading another team's quota is a lookup of a foreign object: 404.
                raise NotFound("No such team.") from None
            raise
        quota = Quota.objects.for_team(team)
        return Response(
            {"team": team.slug, "limits": quota.limits(), "usage": services.quota_usage(team)}
        )


# Room for the multipart envelope and the form fields around the file.
MULTIPART_SLACK_BYTES = 1 << 20


class SizeLimitUploadHandler(FileUploadHandler):
    """Skips (and discards) an uploaded file once it passes ``limit`` bytes.

    Runs first in the chain, so the bytes past the limit never reach Django's temporary
    file; the view sees ``exceeded`` and answers 413.
    """

    def __init__(self, request: HttpRequest, limit: int) -> None:
        super().__init__(request)
        self.limit = limit
        self.exceeded = False

    def receive_data_chunk(self, raw_data: bytes, start: int) -> bytes:
        if start + len(raw_data) > self.limit:
            self.exceeded = True
            raise SkipFile
        return raw_data

    def file_complete(self, file_size: int) -> None:
        return None


def dataset_error_response(exc: datasets.DatasetRejected) -> Response:
    body: dict[str, object] = {"detail": exc.detail}
    if exc.errors:
        body["errors"] = exc.errors
    return Response(body, status=exc.status_code)


class FormatIsAFilterNegotiation(DefaultContentNegotiation):
    """Content negotiation that leaves ``?format=`` alone: on datasets it is the filter by
    file format, which DRF's URL format override would otherwise take as a renderer name
    (``?format=jsonl`` answered 404, no renderer being called that)."""

    settings = SimpleNamespace(URL_FORMAT_OVERRIDE=None)


class DatasetViewSet(
    mixins.ListModelMixin,
    mixins.RetrieveModelMixin,
    mixins.DestroyModelMixin,
    viewsets.GenericViewSet,
):
    """Datasets of the caller's teams. Another team's dataset answers 404."""

    serializer_class = DatasetSerializer
    filterset_class = DatasetFilter
    parser_classes = [MultiPartParser, FormParser]
    content_negotiation_class = FormatIsAFilterNegotiation

    def get_queryset(self) -> QuerySet[Dataset]:
        return Dataset.objects.filter(team_id__in=team_ids_for(self.request)).select_related(
            "team", "created_by"
        )

    def initialize_request(self, request: HttpRequest, *args: object, **kwargs: object) -> Request:
        # Before authentication: the session CSRF check may already read the body.
        if request.method == "POST":
            self.size_limit = SizeLimitUploadHandler(request, datasets.max_dataset_bytes())
            request.upload_handlers.insert(0, self.size_limit)
        return super().initialize_request(request, *args, **kwargs)

    @extend_schema(
        request={"multipart/form-data": DatasetUploadSerializer},
        responses={
            201: DatasetSerializer,
            400: OpenApiResponse(description="Bad field or rows: {detail, errors[]}."),
            409: OpenApiResponse(description="The team already has a dataset of that name."),
            413: OpenApiResponse(description="Larger than OPENTINKER_MAX_DATASET_BYTES."),
        },
    )
    def create(self, request: Request, *args: object, **kwargs: object) -> Response:
        """Upload a JSONL or Parquet file, validated against the env's dataset schema."""
        limit = datasets.max_dataset_bytes()
        too_large = datasets.DatasetTooLarge(datasets.too_large_message(limit))
        try:
            declared = int(request.META.get("CONTENT_LENGTH") or 0)
        except ValueError:
            declared = 0
        if declared > limit + MULTIPART_SLACK_BYTES:
            return dataset_error_response(too_large)
        data = request.data  # parses the body, through the size-limit handler
        if self.size_limit.exceeded:
            return dataset_error_response(too_large)
        upload = DatasetUploadSerializer(data=data)
        upload.is_valid(raise_exception=True)
        fields = upload.validated_data
        team = resolve_team(request, fields.get("team"))
        try:
            dataset = datasets.store_dataset(
                team=team,
                user=request.user,
                name=fields["name"],
                env=fields["env"],
                filename=fields["file"].name,
                chunks=fields["file"].chunks(),
                fmt=fields.get("format"),
            )
        except datasets.DatasetRejected as exc:
            return dataset_error_response(exc)
        return Response(
            DatasetSerializer(dataset, context={"request": request}).data,
            status=status.HTTP_201_CREATED,
        )

    @extend_schema(
        responses={204: None, 409: OpenApiResponse(description="An unfinished job reads it.")}
    )
    def destroy(self, request: Request, *args: object, **kwargs: object) -> Response:
        """Delete the dataset and its file; refused while an unfinished job reads it."""
        dataset = self.get_object()
        try:
            datasets.delete_dataset(dataset)
        except datasets.DatasetRejected as exc:
            return dataset_error_response(exc)
        return Response(status=status.HTTP_204_NO_CONTENT)


class BaseModelViewSet(mixins.ListModelMixin, viewsets.GenericViewSet):
    """The enabled base models a JobSpec may name (managed by administrators)."""

    serializer_class = BaseModelSerializer
    pagination_class = None
    filterset_class = None

    def get_queryset(self) -> QuerySet[BaseModel]:
        return BaseModel.objects.enabled().order_by("name")
