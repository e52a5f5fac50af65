"""Cursor pagination on ``-created``: stable under inserts, no COUNT(*) on big tables."""

from __future__ import annotations

from rest_framework.pagination import CursorPagination


class CreatedCursorPagination(CursorPagination):
    ordering = "-created"
    page_size = 50
    page_size_query_param = "limit"
    max_page_size = 500
