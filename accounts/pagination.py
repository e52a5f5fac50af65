"""Cursor pagination on ``-created``: stable under inserts, no COUNT(*) on big tables."""

from __future__ import annotations

from typing import Any

from rest_framework.exceptions import ValidationError
from rest_framework.pagination import CursorPagination
from rest_framework.request import Request


class CreatedCursorPagination(CursorPagination):
    ordering = "-created"
    page_size = 50
    page_size_query_param = "limit"
    max_page_size = 500

    def get_page_size(self, request: Request) -> int:
        """``limit`` once, an integer in [1, 500]; anything else is a 400, not silently the
        default (a client that asked for 1000 rows must learn it gets at most 500)."""
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
