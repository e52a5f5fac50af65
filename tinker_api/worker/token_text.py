"""What OpenAI's logprob entries say of a token: its text, its bytes, whether it is text at all.

A byte-level BPE token (GPT-2's scheme, Qwen's and Llama 3's) may hold part of a UTF-8
character; decoded alone it reads U+FFFD, and its ``bytes`` must then come from the token's
own bytes, which a client joins to rebuild the text. SentencePiece byte-fallback tokens
(``<0xE9>``) are one byte each. A special token (end of turn, padding) is no text of a
generated answer: its entry is marked so that ``text_offset`` does not count it.
"""

from __future__ import annotations

import re
from functools import cache
from typing import Any

_BYTE_TOKEN = re.compile(r"<0x([0-9A-Fa-f]{2})>")


@cache
def _byte_of_char() -> dict[str, int]:
    """The inverse of GPT-2's byte-to-character table: printable bytes stand for themselves,
    the others for the characters from U+0100 on, in byte order."""
    printable = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAC + 1), *range(0xAE, 0xFF + 1)]
    chars = {b: chr(b) for b in printable}
    extra = 0
    for b in range(256):
        if b not in chars:
            chars[b] = chr(256 + extra)
            extra += 1
    return {c: b for b, c in chars.items()}


def _is_byte_level(tokenizer: Any) -> bool:
    backend = getattr(tokenizer, "backend_tokenizer", None)
    decoder = getattr(backend, "decoder", None)
    return type(decoder).__name__ == "ByteLevel"


class TokenText:
    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self.byte_level = _is_byte_level(tokenizer)
        self.special = set(getattr(tokenizer, "all_special_ids", None) or ())
        self._texts: dict[int, str] = {}
        self._bytes: dict[int, list[int]] = {}

    def text(self, token: int) -> str:
        text = self._texts.get(token)
        if text is None:
            text = self.tokenizer.decode([token], skip_special_tokens=False)
            self._texts[token] = text
        return text

    def bytes(self, token: int) -> list[int]:
        found = self._bytes.get(token)
        if found is None:
            found = self._read_bytes(token)
            self._bytes[token] = found
        return found

    def _read_bytes(self, token: int) -> list[int]:
        piece = self.tokenizer.convert_ids_to_tokens(token)
        if isinstance(piece, str) and token not in self.special:
            if self.byte_level:
                table = _byte_of_char()
                if all(c in table for c in piece):
                    return [table[c] for c in piece]
            matched = _BYTE_TOKEN.fullmatch(piece)
            if matched:
                return [int(matched.group(1), 16)]
        return list(self.text(token).encode("utf-8"))

    def entry(
        self,
        token: int,
        logprob: float | None,
        top: list[tuple[int, float]] | None,
        *,
        in_text: bool = False,
    ) -> dict[str, Any]:
        """One logprob entry in OpenAI's chat shape; ``top`` None (the first token of an
        echoed prompt) stays None. ``in_text``: the token is part of the text even if special
        (an echoed prompt's own special tokens)."""
        entry: dict[str, Any] = {
            "token": self.text(token),
            "logprob": logprob,
            "bytes": self.bytes(token),
            "top_logprobs": None
            if top is None
            else [{"token": self.text(t), "logprob": lp, "bytes": self.bytes(t)} for t, lp in top],
        }
        if token in self.special and not in_text:
            entry["special"] = True
        return entry
