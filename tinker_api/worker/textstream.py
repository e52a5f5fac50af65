"""Text of a sequence as it is decoded, token by token, cut at the first stop string.

A delta is only released once it is final: a trailing partial UTF-8 character (the byte-level
decoder shows it as U+FFFD) waits for its next byte, and a tail that could still become a stop
string waits until it either does (and is cut, as OpenAI's ``stop`` removes it) or cannot.

Decoding is incremental: each token decodes a window of the few tokens before it and itself,
not the whole sequence again (a row allowed the rest of a long context would otherwise cost
a decode of thousands of tokens at every step). The window is what makes the new text right
where a tokenizer spells a token by its neighbours (SentencePiece's leading space).
"""

from __future__ import annotations

from typing import Any

REPLACEMENT = "\ufffd"


class TextStream:
    def __init__(self, tokenizer: Any, stop: tuple[str, ...] = ()) -> None:
        self.tokenizer = tokenizer
        self.stop = tuple(s for s in stop if s)
        self.special = set(getattr(tokenizer, "all_special_ids", None) or ())
        self.tokens: list[int] = []
        self.text = ""
        """The text of ``tokens[:read]``: whole characters only."""
        self._prefix = 0
        self._read = 0
        self.sent = 0
        self.stopped = False
        """A stop string appeared: nothing after it is text."""
        self.covered = 0
        """How many leading tokens the released text spells in full: their logprob entries
        may go out (a token whose text is held back, or lies past a stop string, waits or
        never goes)."""

    def push(self, token: int) -> str:
        """Add one token; the text that became final with it."""
        self.tokens.append(int(token))
        return self._advance(final=False)

    def finish(self) -> str:
        """The sequence ended: whatever was held back."""
        return self._advance(final=True)

    def _decode(self, *, final: bool) -> None:
        """Extend ``text`` with what the tokens past ``_read`` spell, once they spell whole
        characters (or the sequence ended)."""
        if self._read == len(self.tokens):
            return
        decode = self.tokenizer.decode
        known = decode(self.tokens[self._prefix : self._read], skip_special_tokens=True)
        window = decode(self.tokens[self._prefix :], skip_special_tokens=True)
        spelled = len(window) > len(known) and not window.endswith(REPLACEMENT)
        # Special tokens spell nothing (they are skipped): read at once, not held for text.
        silent = all(t in self.special for t in self.tokens[self._read :])
        if final or spelled or silent:
            self.text += window[len(known) :]
            self._prefix, self._read = self._read, len(self.tokens)

    def _advance(self, *, final: bool) -> str:
        if self.stopped:
            return ""
        self._decode(final=final)
        text = self.text
        # A stop string cannot begin in text already released (it would have been held).
        cuts = [i for i in (text.find(s, self.sent) for s in self.stop) if i >= 0]
        if cuts:
            self.stopped = True
            end = min(cuts)
            self.covered = max(self.covered, self._tokens_for(end))
        else:
            end = len(text)
            if not final:
                end -= self._held(text[:end])
            if end == len(text):
                self.covered = self._read
        if end <= self.sent:
            return ""
        delta = text[self.sent : end]
        self.sent = end
        return delta

    def _tokens_for(self, chars: int) -> int:
        """The fewest leading tokens whose text holds its first ``chars`` characters (a stop
        string spans few tokens: this decodes only as many prefixes)."""
        k = len(self.tokens)
        while k > 0:
            if len(self.tokenizer.decode(self.tokens[: k - 1], skip_special_tokens=True)) < chars:
                break
            k -= 1
        return k

    def _held(self, text: str) -> int:
        """Length of the longest tail of ``text`` that begins some stop string."""
        longest = 0
        for stop in self.stop:
            for k in range(min(len(stop) - 1, len(text)), longest, -1):
                if text.endswith(stop[:k]):
                    longest = k
                    break
        return longest
