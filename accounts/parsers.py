"""The API's JSON parser: DRF's, with a bound on nesting and no lone surrogates.

Python's json module recurses once per level: a body nested a few thousand deep raises
RecursionError, which no view expects (a 500). No request of this API needs more than a few
levels; 64 leaves room for any JobSpec and environment config.

Lone UTF-16 surrogates are refused too (``accounts.json_checks``).
"""

from __future__ import annotations

from typing import Any

from rest_framework.exceptions import ParseError
from rest_framework.parsers import JSONParser

from accounts.json_checks import MAX_JSON_DEPTH, SURROGATE_REASON, json_depth, surrogate_at


class DepthLimitedJSONParser(JSONParser):
    def parse(self, stream: Any, media_type: str | None = None, parser_context: Any = None) -> Any:
        too_deep = f"JSON parse error - nested deeper than {MAX_JSON_DEPTH} levels"
        try:
            data = super().parse(stream, media_type, parser_context)
        except RecursionError:
            raise ParseError(too_deep) from None
        if json_depth(data) > MAX_JSON_DEPTH:
            raise ParseError(too_deep)
        found = surrogate_at(data)
        if found is not None:
            where, reason = found
            raise ParseError(f"JSON parse error - {where or 'the body'}: {reason}")
        return data


__all__ = [
    "MAX_JSON_DEPTH",
    "SURROGATE_REASON",
    "DepthLimitedJSONParser",
    "json_depth",
    "surrogate_at",
]
