"""OpenAI response bodies and stream chunks, built from a request's worker events.

Events (``tinker_api.worker.chat``): ``start`` (prompt tokens), ``delta`` (new text and
logprob entries of some choices), ``end`` (a choice's last text and its finish reason),
``done`` (usage) and ``error``. One ``Answer`` turns them either into the chunks of a stream
(``chunks``) or, absorbed one by one, into the single JSON body of a request that does not
stream (``body``).
"""

from __future__ import annotations

import json
import time
from typing import Any, Literal

Kind = Literal["chat", "completion"]


def sse(data: dict[str, Any] | str) -> bytes:
    text = data if isinstance(data, str) else json.dumps(data, separators=(",", ":"))
    return f"data: {text}\n\n".encode()


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
            self.offsets[index] += len(e["token"])
        return {
            "tokens": [e["token"] for e in entries],
            "token_logprobs": [e["logprob"] for e in entries],
            "top_logprobs": [
                {t["token"]: t["logprob"] for t in e["top_logprobs"]} for e in entries
            ],
            "text_offset": offsets,
        }

    def _logprobs(self, index: int, entries: list[dict[str, Any]]) -> dict[str, Any] | None:
        if not self.logprobs:
            return None
        if self.kind == "completion":
            return self._completion_logprobs(index, entries)
        return {"content": entries, "refusal": None}

    def _chunk(
        self,
        index: int,
        text: str | None,
        entries: list[dict[str, Any]],
        finish: str | None = None,
        role: bool = False,
    ) -> dict[str, Any]:
        choice: dict[str, Any] = {"index": index}
        if self.kind == "chat":
            delta: dict[str, Any] = {"role": "assistant"} if role else {}
            if text is not None:
                delta["content"] = text
            choice["delta"] = delta
        else:
            choice["text"] = text or ""
        choice["logprobs"] = self._logprobs(index, entries) if entries else None
        choice["finish_reason"] = finish
        return self._envelope([choice], stream=True)

    # ------------------------------------------------------------------ streams

    def chunks(self, event: dict[str, Any]) -> list[dict[str, Any]]:
        """The stream chunks one event makes."""
        t = event["t"]
        if t == "start":
            if self.kind != "chat":
                return []
            return [self._chunk(i, "", [], role=True) for i in range(self.choices)]
        if t == "delta":
            return [self._chunk(c["i"], c["text"], c["lp"]) for c in event["c"]]
        if t == "end":
            i = event["i"]
            out = []
            if self.kind == "chat":
                if event["text"] or event["lp"]:
                    out.append(self._chunk(i, event["text"], event["lp"]))
                out.append(self._chunk(i, None, [], finish=event["finish_reason"]))
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
        if t == "delta":
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
            if self.kind == "chat":
                choice["message"] = {"role": "assistant", "content": self.texts[i], "refusal": None}
            else:
                choice["text"] = self.texts[i]
            choice["logprobs"] = self._logprobs(i, self.entries[i])
            choice["finish_reason"] = self.reasons[i] or "length"
            choices.append(choice)
        out = self._envelope(choices, stream=False)
        out["usage"] = self.usage
        return out
