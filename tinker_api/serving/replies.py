"""OpenAI response bodies and stream chunks, built from a request's worker events.

Events (``tinker_api.worker.chat``): ``start`` (prompt tokens), ``delta`` (new text and
logprob entries of some choices), ``end`` (a choice's last text and its finish reason),
``done`` (usage) and ``error``. One ``Answer`` turns them either into the chunks of a stream
(``chunks``) or, absorbed one by one, into the single JSON body of a request that does not
stream (``body``). Where the start event says so, `<tool_call>` blocks become ``tool_calls``
(``toolcalls``): a stream holds back the text from where a block may begin.
"""

from __future__ import annotations

import json
import time
from typing import Any, Literal

from tinker_api.serving.toolcalls import held_back, parse

Kind = Literal["chat", "completion"]


def sse(data: dict[str, Any] | str) -> bytes:
    text = data if isinstance(data, str) else json.dumps(data, separators=(",", ":"))
    return f"data: {text}\n\n".encode()


def _top(entry: dict[str, Any]) -> dict[str, float] | None:
    """The legacy form's alternatives: up to logprobs + 1 of them, the chosen token always
    among them (as OpenAI answers); None for an echoed prompt's first token."""
    if entry["top_logprobs"] is None:
        return None
    top = {t["token"]: t["logprob"] for t in entry["top_logprobs"]}
    if entry["top_logprobs"] and entry["token"] not in top:
        top[entry["token"]] = entry["logprob"]
    return top


class Answer:
    def __init__(
        self,
        kind: Kind,
        request_id: str,
        model: str,
        choices: int,
        *,
        logprobs: bool,
        include_usage: bool = False,
    ) -> None:
        self.kind = kind
        prefix = "chatcmpl-" if kind == "chat" else "cmpl-"
        self.id = prefix + request_id.removeprefix("req-")
        self.created = int(time.time())
        self.model = model
        self.choices = choices
        self.logprobs = logprobs
        self.include_usage = include_usage
        self.texts = [""] * choices
        self.entries: list[list[dict[str, Any]]] = [[] for _ in range(choices)]
        self.reasons: list[str | None] = [None] * choices
        self.offsets = [0] * choices
        self.usage: dict[str, int] | None = None
        # Tool calls (the worker's start event says whether to look for them): the text a
        # stream holds back per choice, from where a <tool_call> block begins or may begin.
        self.tools = False
        self.held = [""] * choices

    # ------------------------------------------------------------------ shapes

    def _object(self, stream: bool) -> str:
        if self.kind == "completion":
            return "text_completion"
        return "chat.completion.chunk" if stream else "chat.completion"

    def _envelope(self, choices: list[dict[str, Any]], stream: bool) -> dict[str, Any]:
        out: dict[str, Any] = {
            "id": self.id,
            "object": self._object(stream),
            "created": self.created,
            "model": self.model,
            "system_fingerprint": None,
            "choices": choices,
        }
        if stream and self.include_usage:
            out["usage"] = None
        return out

    def _completion_logprobs(self, index: int, entries: list[dict[str, Any]]) -> dict[str, Any]:
        offsets = []
        for e in entries:
            offsets.append(self.offsets[index])
            # A special token (generated through ignore_eos) is not in the text.
            if not e.get("special"):
                self.offsets[index] += len(e["token"])
        return {
            "tokens": [e["token"] for e in entries],
            "token_logprobs": [e["logprob"] for e in entries],
            "top_logprobs": [_top(e) for e in entries],
            "text_offset": offsets,
        }

    def _logprobs(self, index: int, entries: list[dict[str, Any]]) -> dict[str, Any] | None:
        if not self.logprobs:
            return None
        if self.kind == "completion":
            return self._completion_logprobs(index, entries)
        content = [{k: v for k, v in e.items() if k != "special"} for e in entries]
        return {"content": content, "refusal": None}

    def _chunk(
        self,
        index: int,
        text: str | None,
        entries: list[dict[str, Any]],
        finish: str | None = None,
        role: bool = False,
        tool_calls: list[dict[str, Any]] | None = None,
    ) -> dict[str, Any]:
        choice: dict[str, Any] = {"index": index}
        if self.kind == "chat":
            delta: dict[str, Any] = {"role": "assistant"} if role else {}
            if text is not None:
                delta["content"] = text
            if tool_calls:
                delta["tool_calls"] = [{"index": k, **call} for k, call in enumerate(tool_calls)]
            choice["delta"] = delta
        else:
            choice["text"] = text or ""
        choice["logprobs"] = self._logprobs(index, entries) if entries else None
        choice["finish_reason"] = finish
        return self._envelope([choice], stream=True)

    # ------------------------------------------------------------------ streams

    def _release(self, index: int, text: str) -> str:
        """What of a choice's new text streams as content now; the rest is held back."""
        if not self.tools:
            return text
        pending = self.held[index] + text
        cut = held_back(pending)
        self.held[index] = pending[cut:]
        return pending[:cut]

    def chunks(self, event: dict[str, Any]) -> list[dict[str, Any]]:
        """The stream chunks one event makes."""
        t = event["t"]
        if t == "start":
            self.tools = bool(event.get("tools"))
            if self.kind != "chat":
                return []
            return [self._chunk(i, "", [], role=True) for i in range(self.choices)]
        if t == "delta":
            out = []
            for c in event["c"]:
                text = self._release(c["i"], c["text"])
                if text or c["lp"]:
                    out.append(self._chunk(c["i"], text, c["lp"]))
            return out
        if t == "end":
            i = event["i"]
            out = []
            if self.kind == "chat":
                text, finish = event["text"], event["finish_reason"]
                calls = None
                if self.tools:
                    held, self.held[i] = self.held[i] + text, ""
                    parsed = parse(held)
                    if parsed is not None and finish == "stop":
                        text, calls, finish = parsed.content or "", parsed.calls, "tool_calls"
                    else:
                        text = held
                if text or event["lp"]:
                    out.append(self._chunk(i, text, event["lp"]))
                if calls:
                    out.append(self._chunk(i, None, [], tool_calls=calls))
                out.append(self._chunk(i, None, [], finish=finish))
            else:
                out.append(self._chunk(i, event["text"], event["lp"], event["finish_reason"]))
            return out
        if t == "done" and self.include_usage:
            usage = self._envelope([], stream=True)
            usage["usage"] = event["usage"]
            return [usage]
        return []

    # ------------------------------------------------------------------ one body

    def absorb(self, event: dict[str, Any]) -> None:
        t = event["t"]
        if t == "start":
            self.tools = bool(event.get("tools"))
        elif t == "delta":
            for c in event["c"]:
                self.texts[c["i"]] += c["text"]
                self.entries[c["i"]].extend(c["lp"])
        elif t == "end":
            i = event["i"]
            self.texts[i] += event["text"]
            self.entries[i].extend(event["lp"])
            self.reasons[i] = event["finish_reason"]
        elif t == "done":
            self.usage = event["usage"]

    def body(self) -> dict[str, Any]:
        choices = []
        for i in range(self.choices):
            choice: dict[str, Any] = {"index": i}
            finish = self.reasons[i] or "length"
            if self.kind == "chat":
                message: dict[str, Any] = {
                    "role": "assistant",
                    "content": self.texts[i],
                    "refusal": None,
                }
                parsed = parse(self.texts[i]) if self.tools and finish == "stop" else None
                if parsed is not None:
                    message["content"] = parsed.content
                    message["tool_calls"] = parsed.calls
                    finish = "tool_calls"
                choice["message"] = message
            else:
                choice["text"] = self.texts[i]
            choice["logprobs"] = self._logprobs(i, self.entries[i])
            choice["finish_reason"] = finish
            choices.append(choice)
        out = self._envelope(choices, stream=False)
        out["usage"] = self.usage
        return out
