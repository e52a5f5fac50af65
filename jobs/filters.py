from __future__ import annotations

from typing import Any

import django_filters
from django.db.models import QuerySet
from django_filters.rest_framework import DjangoFilterBackend
from rest_framework.exceptions import ValidationError
from rest_framework.request import Request
from rest_framework.settings import api_settings

from .models import Dataset, DatasetFormat, Job, JobKind, JobState


class JobFilter(django_filters.FilterSet):
    state = django_filters.MultipleChoiceFilter(choices=JobState.choices)
    kind = django_filters.ChoiceFilter(choices=JobKind.choices)
    name = django_filters.CharFilter(lookup_expr="icontains")
    creator = django_filters.CharFilter(
        field_name="created_by__username", help_text="Username of the job's creator."
    )
    team = django_filters.CharFilter(
        field_name="team__slug", help_text="Slug of one of the caller's teams."
    )

    class Meta:
        model = Job
        fields = ["state", "kind", "name", "creator", "team"]


class DatasetFilter(django_filters.FilterSet):
    env = django_filters.CharFilter()
    format = django_filters.ChoiceFilter(choices=DatasetFormat.choices)
    name = django_filters.CharFilter(lookup_expr="icontains")
    team = django_filters.CharFilter(
        field_name="team__slug", help_text="Slug of one of the caller's teams."
    )

    class Meta:
        model = Dataset
        fields = ["env", "format", "name", "team"]


class StrictFilterBackend(DjangoFilterBackend):
    """django-filter's backend for lists only, refusing query parameters a list does not take.

    An unknown parameter used to be ignored: ``?status=RUNNING`` (for ``state``) or
    ``?ordering=name`` listed every job, newest first, and a script that cancelled what it
    listed would have cancelled them all. One object (detail, cancel, delete) is found by its
    id alone: DRF's ``get_object`` filters too, and ``POST /jobs/{id}/cancel?state=RUNNING``
    on a queued job answered 404.
    """

    def filter_queryset(self, request: Request, queryset: QuerySet[Any], view: Any) -> Any:
        if getattr(view, "action", None) != "list":
            return queryset
        filterset_class = self.get_filterset_class(view, queryset)
        known = set(filterset_class.base_filters) if filterset_class else set()
        refuse_unknown_params(request, known, getattr(view, "paginator", None))
        return super().filter_queryset(request, queryset, view)


def refuse_unknown_params(request: Request, known: set[str], paginator: Any = None) -> None:
    """A 400 naming each query parameter not in ``known`` (plus the paginator's and DRF's
    ``format``): a misspelt filter must not answer as if it were not there."""
    known = set(known)
    for attr in ("cursor_query_param", "page_size_query_param"):
        if getattr(paginator, attr, None):
            known.add(getattr(paginator, attr))
    if api_settings.URL_FORMAT_OVERRIDE:
        known.add(api_settings.URL_FORMAT_OVERRIDE)
    unknown = sorted(set(request.query_params) - known)
    if unknown:
        names = ", ".join(sorted(known))
        raise ValidationError(
            {name: [f"unknown query parameter; known: {names}."] for name in unknown}
        )
