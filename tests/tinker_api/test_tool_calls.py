"""Tool calls in chat answers: `<tool_call>` blocks (the Hermes format of Qwen-style chat
templates) become OpenAI's `message.tool_calls` in whole answers and in streams, in shapes the
official `openai` client's own types accept; anything malformed stays text."""

from __future__ import annotations

import json
from typing import Any

import pytest
from openai.types.chat import ChatCompletion, ChatCompletionChunk

from tinker_api.serving.replies import Answer
from tinker_api.serving.toolcalls import held_back, parse

CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'


def test_it_parses_blocks_into_calls_and_leaves_anything_malformed_as_text() -> None:
    parsed = parse("Let me check.\n" + CALL)
    assert parsed is not None and parsed.content == "Let me check."
    (call,) = parsed.calls
    assert call["type"] == "function" and call["id"].startswith("call_")
    assert call["function"] == {"name": "get_weather", "arguments": '{"city": "Paris"}'}
    two = parse(CALL + "\n" + CALL.replace("Paris", "Oslo"))
    assert two is not None and two.content is None and len(two.calls) == 2
    assert len({c["id"] for c in two.calls}) == 2
    raw = parse('<tool_call>{"name": "f", "arguments": "{\\"x\\": 1}"}</tool_call>')
    assert raw is not None and raw.calls[0]["function"]["arguments"] == '{"x": 1}'
    for text in (
        "no call here",
        "<tool_call>{not json}</tool_call>",
        '<tool_call>{"arguments": {}}</tool_call>',  # no name
        CALL + " and then some prose",
        '<tool_call>{"name": "f"',  # never closed
    ):
        assert parse(text) is None, text


def test_it_holds_back_what_may_still_become_a_block() -> None:
    assert held_back("hello") == 5
    assert held_back("hello <tool") == 6
    assert held_back("hello <") == 6
    assert held_back("a <tool_call> {") == 2
    assert held_back("a < b") == 5


def events(tools: bool, pieces: list[str], finish: str = "stop") -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = [{"t": "start", "prompt_tokens": 12, "tools": tools}]
    out += [{"t": "delta", "c": [{"i": 0, "text": p, "lp": []}]} for p in pieces[:-1]]
    out.append({"t": "end", "i": 0, "text": pieces[-1], "lp": [], "finish_reason": finish})
    usage = {"prompt_tokens": 12, "completion_tokens": 30, "total_tokens": 42}
    out.append({"t": "done", "usage": usage})
    return out


def streamed(tools: bool, pieces: list[str], finish: str = "stop") -> list[dict[str, Any]]:
    answer = Answer("chat", "req-1", "tiny", 1, logprobs=False)
    chunks = [c for e in events(tools, pieces, finish) for c in answer.chunks(e)]
    for chunk in chunks:
        ChatCompletionChunk.model_validate(chunk)  # the official client reads this shape
    return chunks


def whole(tools: bool, pieces: list[str], finish: str = "stop") -> dict[str, Any]:
    answer = Answer("chat", "req-1", "tiny", 1, logprobs=False)
    for event in events(tools, pieces, finish):
        answer.absorb(event)
    body = answer.body()
    ChatCompletion.model_validate(body)
    return body


# The block arrives split across deltas, its marker too.
FULL = "Let me check.\n" + CALL
PIECES = [FULL[:7], FULL[7:17], FULL[17:40], FULL[40:], ""]


def test_a_stream_sends_the_text_before_a_call_and_then_the_call() -> None:
    assert PIECES[1].endswith("<to")
    chunks = streamed(True, PIECES)
    deltas = [c["choices"][0]["delta"] for c in chunks]
    text = "".join(d.get("content") or "" for d in deltas)
    assert text == "Let me check.\n"
    calls = [d["tool_calls"] for d in deltas if "tool_calls" in d]
    assert len(calls) == 1 and calls[0][0]["index"] == 0
    assert calls[0][0]["function"] == {"name": "get_weather", "arguments": '{"city": "Paris"}'}
    assert chunks[-1]["choices"][0]["finish_reason"] == "tool_calls"
    # No content chunk ever carries a piece of the block.
    assert all("<" not in (d.get("content") or "") for d in deltas)


@pytest.mark.parametrize(
    "tools, pieces, finish",
    [
        (False, PIECES, "stop"),  # the template has no tool support: text, as before
        (True, ["I think <to", "o much> is fine"], "stop"),  # a held tail that was not a call
        (True, ['<tool_call>{"name": "f", ', '"arguments": {}}'], "length"),  # cut short
    ],
)
def test_a_stream_without_a_whole_call_is_all_text(
    tools: bool, pieces: list[str], finish: str
) -> None:
    chunks = streamed(tools, pieces, finish)
    deltas = [c["choices"][0]["delta"] for c in chunks]
    assert "".join(d.get("content") or "" for d in deltas) == "".join(pieces)
    assert not any("tool_calls" in d for d in deltas)
    assert chunks[-1]["choices"][0]["finish_reason"] == finish


def test_a_whole_answer_carries_the_calls_in_its_message() -> None:
    body = whole(True, PIECES)
    (choice,) = body["choices"]
    assert choice["finish_reason"] == "tool_calls"
    assert choice["message"]["content"] == "Let me check."
    (call,) = choice["message"]["tool_calls"]
    assert json.loads(call["function"]["arguments"]) == {"city": "Paris"}
    plain = whole(False, PIECES)["choices"][0]
    assert plain["message"]["content"] == "".join(PIECES) and "tool_calls" not in plain["message"]
    assert plain["finish_reason"] == "stop"
