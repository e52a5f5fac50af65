"""The API's JSON parser: DRF's, with a bound on nesting and no lone surrogates.

Python's json module recurses once per level: a body nested a few thousand deep raises
RecursionError, which no view expects (a 500). No request of this API needs more than a few
levels; 64 leaves room for any JobSpec and environment config.

JSON may spell a lone UTF-16 surrogate (``"\\ud800"``), which Python reads into a ``str``
that has no UTF-8 form: pydantic, PostgreSQL and every UTF-8 answer that echoes it fail on it.
"""

from __future__ import annotations

import re
from typing import Any

from rest_framework.exceptions import ParseError
from rest_framework.parsers import JSONParser

MAX_JSON_DEPTH = 64
SURROGATE_REASON = "surrogate characters are not allowed (a lone \\ud800-\\udfff escape)"
_SURROGATE = re.compile("[\ud800-\udfff]")


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


def surrogate_at(value: Any) -> tuple[str, str] | None:
    """``(path, reason)`` of the first string, key or value, that holds a lone surrogate:
    ``path`` dots the keys and list positions down to it ("" for the top level; for a key,
    its mapping's, since the key itself cannot be printed). None when there is none.
    Iterative: a value may be deeply nested."""
    stack: list[tuple[Any, str]] = [(value, "")]
    while stack:
        item, path = stack.pop()
        if isinstance(item, str):
            if _SURROGATE.search(item):
                return path, SURROGATE_REASON
        elif isinstance(item, dict):
            for key, child in item.items():
                if isinstance(key, str) and _SURROGATE.search(key):
                    return path, f"a key: {SURROGATE_REASON}"
                stack.append((child, f"{path}.{key}" if path else str(key)))
        elif isinstance(item, list):
            stack.extend((child, f"{path}.{i}" if path else str(i)) for i, child in enumerate(item))
    return None


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
