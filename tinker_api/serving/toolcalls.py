"""Tool calls in a chat answer: the `<tool_call>` blocks of the Hermes format that Qwen2.5,
Qwen3 and other chat templates teach (a JSON object with `name` and `arguments` between
`<tool_call>` and `</tool_call>`), turned into OpenAI's `message.tool_calls`.

All or nothing: an answer whose blocks do not all parse stays text, as it is for a template
with no tool support.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass
from typing import Any

TOOL_CALL_OPEN = "<tool_call>"
_BLOCK = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.DOTALL)


@dataclass(frozen=True)
class Parsed:
    content: str | None
    """The text before the first block (None when there is none)."""
    calls: list[dict[str, Any]]
    """OpenAI tool call objects: {id, type: function, function: {name, arguments (JSON)}}."""


def parse(text: str) -> Parsed | None:
    """The content and tool calls of `text`, or None when it holds no well-formed call."""
    start = text.find(TOOL_CALL_OPEN)
    if start < 0:
        return None
    rest = text[start:]
    blocks = list(_BLOCK.finditer(rest))
    # Nothing but blocks and whitespace may follow the first one.
    if not blocks or _BLOCK.sub("", rest).strip():
        return None
    calls = []
    for block in blocks:
        try:
            body = json.loads(block.group(1))
        except json.JSONDecodeError:
            return None
        if not isinstance(body, dict) or not isinstance(body.get("name"), str):
            return None
        arguments = body.get("arguments", {})
        if not isinstance(arguments, str):
            arguments = json.dumps(arguments, ensure_ascii=False)
        calls.append(
            {
                "id": f"call_{uuid.uuid4().hex[:24]}",
                "type": "function",
                "function": {"name": body["name"], "arguments": arguments},
            }
        )
    content = text[:start].strip()
    return Parsed(content or None, calls)


def held_back(text: str) -> int:
    """Where `text` must stop streaming as content: at a `<tool_call>`, or at a tail that
    could still become one."""
    at = text.find(TOOL_CALL_OPEN)
    if at >= 0:
        return at
    for size in range(min(len(TOOL_CALL_OPEN) - 1, len(text)), 0, -1):
        if TOOL_CALL_OPEN.startswith(text[-size:]):
            return len(text) - size
    return len(text)
