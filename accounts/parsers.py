"""The API's JSON parser: DRF's, with a bound on nesting.

Python's json module recurses once per level: a body nested a few thousand deep raises
RecursionError, which no view expects (a 500). No request of this API needs more than a few
levels; 64 leaves room for any JobSpec and environment config.
"""

from __future__ import annotations

from typing import Any

from rest_framework.exceptions import ParseError
from rest_framework.parsers import JSONParser

MAX_JSON_DEPTH = 64


def json_depth(value: Any) -> int:
    """Nesting depth of a parsed JSON value (a scalar is 0), without recursion."""
    deepest = 0
    stack = [(value, 1)]
    while stack:
        item, depth = stack.pop()
        if isinstance(item, dict):
            children = item.values()
        elif isinstance(item, list):
            children = item
        else:
            continue
        deepest = max(deepest, depth)
        stack.extend((child, depth + 1) for child in children)
    return deepest


class DepthLimitedJSONParser(JSONParser):
    def parse(self, stream: Any, media_type: str | None = None, parser_context: Any = None) -> Any:
        too_deep = f"JSON parse error - nested deeper than {MAX_JSON_DEPTH} levels"
        try:
            data = super().parse(stream, media_type, parser_context)
        except RecursionError:
            raise ParseError(too_deep) from None
        if json_depth(data) > MAX_JSON_DEPTH:
            raise ParseError(too_deep)
        return data


__all__ = ["MAX_JSON_DEPTH", "DepthLimitedJSONParser", "json_depth"]
