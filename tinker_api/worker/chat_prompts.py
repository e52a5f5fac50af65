"""The prompts of the OpenAI-style requests, as the model worker renders them: the base model's
chat template (or the completion prompts as given), its tokenizer, the images a message
carries, and the checks only the worker can make (the prompt's tokens against the context).

An image part of a message is rendered by the template as its placeholder (Qwen2-VL's
``<|vision_start|><|image_pad|><|vision_end|>``); the one ``<|image_pad|>`` token then becomes
as many as the image fills, as the model's own processor lays a prompt out, so that the prompt
is the one the vision tower and the 3-D rotary positions expect.
"""

from __future__ import annotations

import base64
from dataclasses import dataclass
from typing import Any

from tinker_api.worker.requests import Op, RequestError
from training import vision
from training.engine import Engine
from workers import conf

CONTEXT_EXCEEDED = "context_length_exceeded"
# A request without max_tokens, on a model whose config names no context length.
FALLBACK_MAX_TOKENS = 4096


class BadRequest(RequestError):
    """A request the client must change: answered 400 naming ``param``."""

    def __init__(self, message: str, param: str | None, code: str | None = None) -> None:
        super().__init__(message)
        self.param = param
        self.code = code


@dataclass
class Prompts:
    """A request's prompts as token ids, and the images of each (in placeholder order)."""

    tokens: list[list[int]]
    images: list[tuple[vision.ImageInput, ...]]


class PromptRenderer:
    def __init__(self, base: str, engine: Engine) -> None:
        self.base = base
        self.engine = engine
        self.tokenizer: Any = engine.tokenizer

    def _text_config(self) -> Any:
        # A vision-language config keeps the decoder's sizes in its text config; a text-only
        # config returns itself.
        return self.engine.model.config.get_text_config()

    def context(self, op: Op) -> int:
        model_config = self._text_config()
        limit = int(op.fields.get("max_context") or 0)
        positions = int(getattr(model_config, "max_position_embeddings", 0) or 0)
        return min(x for x in (limit, positions) if x) if (limit or positions) else 0

    def prompts(self, op: Op) -> Prompts:
        f = op.fields
        vocab = int(self._text_config().vocab_size)
        images: list[tuple[vision.ImageInput, ...]] = []
        if f["mode"] == "chat":
            prompts = [self._chat(op)]
            images = [self._images(op)]
            if images[0]:
                prompts = [self._expand(prompts[0], images[0])]
            where = "messages"
        else:
            prompts = []
            for p in f["prompts"]:
                if isinstance(p, str):
                    # An empty text is continued from the start of a document, as OpenAI
                    # does (its <|endoftext|>): the tokenizer's BOS, else its EOS.
                    prompts.append(list(self.tokenizer.encode(p)) or self._document_start())
                else:
                    ids = [int(t) for t in p]
                    if any(not 0 <= t < vocab for t in ids):
                        raise BadRequest(f"token ids must lie in [0, {vocab})", "prompt")
                    prompts.append(ids)
            images = [()] * len(prompts)
            where = "prompt"
        if any(not p for p in prompts):
            raise BadRequest("the prompt renders to no tokens", where)
        self._check_context(op, prompts, where)
        return Prompts(prompts, images)

    def _chat(self, op: Op) -> list[int]:
        f = op.fields
        if not getattr(self.tokenizer, "chat_template", None):
            raise BadRequest(
                f"base model {self.base} has no chat template; use /v1/completions", "model"
            )
        try:
            text = self.tokenizer.apply_chat_template(
                f["messages"],
                tools=f.get("tools") or None,
                add_generation_prompt=True,
                tokenize=False,
            )
        except Exception as exc:
            raise BadRequest(f"the chat template refused the messages: {exc}", "messages") from exc
        return list(self.tokenizer.encode(text, add_special_tokens=False))

    def _images(self, op: Op) -> tuple[vision.ImageInput, ...]:
        out = []
        for entry in op.fields.get("images") or []:
            where = str(entry["where"])
            if self.engine.processor is None:
                raise BadRequest(f"{where}: base model {self.base} takes no images", where)
            try:
                out.append(self.engine.encode_image(base64.b64decode(entry["data"])))
            except Exception as exc:
                raise BadRequest(f"{where}: the image cannot be read: {exc}", where) from exc
        return tuple(out)

    def _expand(self, prompt: list[int], images: tuple[vision.ImageInput, ...]) -> list[int]:
        """Each image's one placeholder token as the many its image fills."""
        spec = vision.spec_of(self.engine.model)
        assert spec is not None  # a model with an image processor has a vision tower
        try:
            return vision.expand_placeholders(prompt, images, spec.image_token_id)
        except ValueError as exc:
            raise BadRequest(
                f"base model {self.base}'s chat template does not place the images: {exc}",
                "messages",
            ) from exc

    def _check_context(self, op: Op, prompts: list[list[int]], where: str) -> None:
        context = self.context(op)
        asked = op.fields["params"].get("max_tokens")
        for p in prompts:
            room = context - len(p) if context else None
            # OpenAI's wording ("maximum context length") and code: what clients that trim
            # and retry look for.
            if room is not None and room < 1:
                raise BadRequest(
                    f"{self.base}'s maximum context length is {context} tokens; the prompt "
                    f"has {len(p)}",
                    where,
                    CONTEXT_EXCEEDED,
                )
            if asked is not None and room is not None and asked > room:
                raise BadRequest(
                    f"{self.base}'s maximum context length is {context} tokens; the prompt "
                    f"({len(p)} tokens) and max_tokens ({asked}) ask for {len(p) + asked}",
                    "max_tokens",
                    CONTEXT_EXCEEDED,
                )

    def _document_start(self) -> list[int]:
        for token in (self.tokenizer.bos_token_id, self.tokenizer.eos_token_id):
            if token is not None:
                return [int(token)]
        return []

    def max_tokens(self, op: Op, prompt: list[int]) -> int:
        asked = op.fields["params"].get("max_tokens")
        if asked is not None:
            return int(asked)
        # OpenAI's default is the rest of the context; an operator of long-context models may
        # cap it (a row decoding to 128k tokens holds a batch's slot for a long time).
        cap = conf.int_setting("OPENTINKER_OPENAI_DEFAULT_MAX_TOKENS", minimum=0)
        context = self.context(op)
        room = context - len(prompt) if context else (cap or FALLBACK_MAX_TOKENS)
        return max(1, min(room, cap) if cap else room)
