"""Checks of parsed JSON that need no web framework: nesting depth, lone surrogates, NULs.

Kept apart from the API's parser (``accounts.parsers``, which needs DRF) because job specs
are checked with them in every process that parses one, verl's trainer venv included.

JSON may spell a lone UTF-16 surrogate (``"\\ud800"``), which Python reads into a ``str``
that has no UTF-8 form: pydantic, PostgreSQL and every UTF-8 answer that echoes it fail on it.
It may spell a NUL (``"\\u0000"``) too, which PostgreSQL stores in neither text nor jsonb: a
value bound for the database, or looked up in it, must not hold one.
"""

from __future__ import annotations

import re
from typing import Any

MAX_JSON_DEPTH = 64
SURROGATE_REASON = "surrogate characters are not allowed (a lone \\ud800-\\udfff escape)"
NUL_REASON = "null characters are not allowed (a \\u0000 escape)"
_SURROGATE = re.compile("[\ud800-\udfff]")
_NUL_OR_SURROGATE = re.compile("[\x00\ud800-\udfff]")


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
    its mapping's, since the key itself cannot be printed). None when there is none."""
    return _text_at(value, _SURROGATE)


def unstorable_text_at(value: Any) -> tuple[str, str] | None:
    """``surrogate_at`` for a value the database stores or looks up: a NUL is refused too."""
    return _text_at(value, _NUL_OR_SURROGATE)


def _reason(found: re.Match[str]) -> str:
    return NUL_REASON if found.group() == "\x00" else SURROGATE_REASON


def _text_at(value: Any, pattern: re.Pattern[str]) -> tuple[str, str] | None:
    """Iterative: a value may be deeply nested."""
    stack: list[tuple[Any, str]] = [(value, "")]
    while stack:
        item, path = stack.pop()
        if isinstance(item, str):
            if found := pattern.search(item):
                return path, _reason(found)
        elif isinstance(item, dict):
            for key, child in item.items():
                if isinstance(key, str) and (found := pattern.search(key)):
                    return path, f"a key: {_reason(found)}"
                stack.append((child, f"{path}.{key}" if path else str(key)))
        elif isinstance(item, list):
            stack.extend((child, f"{path}.{i}" if path else str(i)) for i, child in enumerate(item))
    return None


__all__ = [
    "MAX_JSON_DEPTH",
    "NUL_REASON",
    "SURROGATE_REASON",
    "json_depth",
    "surrogate_at",
    "unstorable_text_at",
]
