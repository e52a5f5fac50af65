"""Query parameters of the API's lists: a parameter a list does not take is a 400, never
ignored (every list of the API, through ``DEFAULT_FILTER_BACKENDS``)."""

from __future__ import annotations

from typing import Any

from django.db.models import QuerySet
from django_filters.rest_framework import DjangoFilterBackend
from rest_framework.exceptions import ValidationError
from rest_framework.request import Request
from rest_framework.settings import api_settings


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
