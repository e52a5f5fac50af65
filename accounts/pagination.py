"""Cursor pagination on ``-created``: stable under inserts, no COUNT(*) on big tables."""

from __future__ import annotations

from datetime import UTC
from typing import Any

from django.utils.dateparse import parse_datetime
from rest_framework.exceptions import NotFound, ValidationError
from rest_framework.pagination import Cursor, CursorPagination
from rest_framework.request import Request

INVALID_CURSOR = {"cursor": ["invalid cursor"]}


class CheckedCursorPagination(CursorPagination):
    """Cursor pagination on a ``created`` timestamp that answers a bad ``cursor`` with a 400.

    A cursor is only base64 of ``o=<offset>&r=<reverse>&p=<position>``: a client can write any
    position, and DRF filters on it unchecked (a position that is not a timestamp was a 500).
    """

    def decode_cursor(self, request: Request) -> Cursor | None:
        try:
            cursor = super().decode_cursor(request)
        except NotFound:
            raise ValidationError(INVALID_CURSOR) from None
        if (
            cursor is not None
            and cursor.position is not None
            and not _is_timestamp(cursor.position)
        ):
            raise ValidationError(INVALID_CURSOR)
        return cursor

    def get_page_size(self, request: Request) -> int:
        """``limit`` once, an integer in [1, max_page_size]; anything else is a 400, not
        silently the default (a client that asked for more rows than a page holds must learn
        it gets fewer)."""
        values = request.query_params.getlist(self.page_size_query_param)
        if not values:
            return self.page_size
        bounds = f"an integer in [1, {self.max_page_size}]"
        if len(values) > 1:
            raise ValidationError({"limit": [f"give limit once ({bounds})."]})
        try:
            size = int(values[0])
        except ValueError:
            raise ValidationError({"limit": [f"must be {bounds}."]}) from None
        if not 1 <= size <= self.max_page_size:
            raise ValidationError({"limit": [f"must be {bounds}."]})
        return size

    def get_schema_operation_parameters(self, view: Any) -> list[dict[str, Any]]:
        parameters: list[dict[str, Any]] = super().get_schema_operation_parameters(view)
        for parameter in parameters:
            if parameter["name"] == self.page_size_query_param:
                parameter["schema"].update(minimum=1, maximum=self.max_page_size)
        return parameters


def _is_timestamp(position: str) -> bool:
    """What this pagination writes as a position: an aware datetime the database can hold."""
    try:
        when = parse_datetime(position)
        # A date at the edge of the calendar overflows once moved to UTC for the query.
        return when is not None and when.tzinfo is not None and bool(when.astimezone(UTC))
    except (ValueError, OverflowError):  # well-formed but impossible, e.g. month 13
        return False


class CreatedCursorPagination(CheckedCursorPagination):
    ordering = "-created"
    page_size = 50
    page_size_query_param = "limit"
    max_page_size = 500
