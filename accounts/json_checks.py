"""Checks of parsed JSON that need no web framework: nesting depth, lone surrogates.

Kept apart from the API's parser (``accounts.parsers``, which needs DRF) because job specs
are checked with them in every process that parses one, verl's trainer venv included.

JSON may spell a lone UTF-16 surrogate (``"\\ud800"``), which Python reads into a ``str``
that has no UTF-8 form: pydantic, PostgreSQL and every UTF-8 answer that echoes it fail on it.
"""

from __future__ import annotations

import re
from typing import Any

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


__all__ = ["MAX_JSON_DEPTH", "SURROGATE_REASON", "json_depth", "surrogate_at"]
