"""Conversations to tokens with the base model's own chat template.

Works with any Hugging Face tokenizer that has a chat template. In a multi-turn episode the
model's sampled tokens are kept exactly as sampled (never re-tokenized: the engine trains on
what the sampler produced), and each observation is rendered as the *difference* the template
adds after the model's turn: the end-of-turn glue, the new messages and the next generation
prompt. Those observation tokens are context only (mask 0).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from environments import images
from environments.types import Message

# The placeholder a Qwen2-VL-family chat template writes for an image part.
IMAGE_PLACEHOLDER = "<|image_pad|>"

# A string no conversation contains, used to find where an assistant turn's content sits in the
# rendered template.
_SENTINEL = "\u2063OPENTINKER_ACTION\u2063"


class RendererError(ValueError):
    pass


class Renderer:
    """Render chats for one tokenizer. `tokenizer` is a transformers tokenizer (fast or slow).

    `image_tokens` (a vision-language model) gives the number of placeholder tokens an image
    (PNG or JPEG bytes) fills: the template writes one placeholder per image part, and the
    renderer repeats it that many times. Without it, a message with an image is refused.
    """

    def __init__(self, tokenizer: Any, image_tokens: Callable[[bytes], int] | None = None) -> None:
        if not getattr(tokenizer, "chat_template", None):
            raise RendererError(
                "the tokenizer has no chat template; set tokenizer.chat_template to the base "
                "model's template"
            )
        self.tokenizer = tokenizer
        self.image_tokens = image_tokens
        self._turn_end = self._find_turn_end()

    def _render(self, messages: list[Message], *, generation_prompt: bool) -> str:
        text = self.tokenizer.apply_chat_template(
            list(messages), tokenize=False, add_generation_prompt=generation_prompt
        )
        if not isinstance(text, str):
            raise RendererError(f"chat template rendered {type(text).__name__}, expected str")
        return text

    def _find_turn_end(self) -> str:
        probe: list[Message] = [
            {"role": "user", "content": "x"},
            {"role": "assistant", "content": _SENTINEL},
        ]
        text = self._render(probe, generation_prompt=False)
        if _SENTINEL not in text:
            raise RendererError("the chat template drops assistant content; cannot render turns")
        return text.split(_SENTINEL, 1)[1]

    @property
    def turn_end_text(self) -> str:
        """What the template writes after an assistant message (e.g. "<|im_end|>\\n")."""
        return self._turn_end

    def encode(self, text: str) -> list[int]:
        return list(self.tokenizer(text, add_special_tokens=False)["input_ids"])

    def decode(self, tokens: list[int], *, skip_special_tokens: bool = True) -> str:
        return self.tokenizer.decode(tokens, skip_special_tokens=skip_special_tokens)

    def stop_token_ids(self) -> list[int]:
        """Token ids that end an assistant turn: eos and the template's end-of-turn token."""
        ids: set[int] = set()
        if self.tokenizer.eos_token_id is not None:
            ids.add(int(self.tokenizer.eos_token_id))
        stripped = self._turn_end.strip()
        if stripped:
            end = self.encode(stripped)
            if len(end) == 1:
                ids.add(end[0])
        return sorted(ids)

    def _with_images(self, tokens: list[int], messages: list[Message]) -> list[int]:
        """`tokens` with the placeholder of each image of `messages` repeated as many times
        as the image fills."""
        pictures = images.images_in(list(messages))
        if not pictures:
            return tokens
        if self.image_tokens is None:
            raise RendererError("this base model takes no images (it has no vision tower)")
        placeholder = self.tokenizer.convert_tokens_to_ids(IMAGE_PLACEHOLDER)
        counts = iter([self.image_tokens(p) for p in pictures])
        out: list[int] = []
        for token in tokens:
            if token == placeholder:
                count = next(counts, None)
                if count is None:
                    raise RendererError(
                        "the chat template wrote more image placeholders than images"
                    )
                out.extend([token] * count)
            else:
                out.append(token)
        if next(counts, None) is not None:
            raise RendererError(
                f"the chat template wrote no {IMAGE_PLACEHOLDER} for an image: it takes no images"
            )
        return out

    def prompt_tokens(self, messages: list[Message]) -> list[int]:
        """The whole conversation plus the generation prompt: the first observation."""
        tokens = self.encode(self._render(messages, generation_prompt=True))
        return self._with_images(tokens, messages)

    def action_text(self, action_tokens: list[int]) -> str:
        """The assistant message content for sampled tokens (end-of-turn token removed)."""
        text = self.decode(action_tokens, skip_special_tokens=False)
        for end in (self._turn_end, self._turn_end.strip()):
            if end and text.endswith(end):
                text = text[: -len(end)]
                break
        eos = self.tokenizer.eos_token
        if eos and text.endswith(eos):
            text = text[: -len(eos)]
        return text

    def observation_tokens(
        self,
        history: list[Message],
        new_messages: list[Message],
        action_tokens: list[int],
    ) -> list[int]:
        """Tokens between the model's last action and its next one.

        `history` is the conversation up to, not including, the assistant turn that produced
        `action_tokens`. The result closes that turn (unless the sampled tokens already did),
        renders `new_messages` and opens the next assistant turn.
        """
        convo = [*history, {"role": "assistant", "content": _SENTINEL}, *new_messages]
        full = self._render(convo, generation_prompt=True)
        if _SENTINEL not in full:
            raise RendererError("the chat template dropped the assistant turn")
        suffix = full.split(_SENTINEL, 1)[1]
        generated = self.decode(action_tokens, skip_special_tokens=False)
        # Drop the part of the end-of-turn glue the model already produced (its stop token).
        for piece in (self._turn_end, self._turn_end.strip()):
            if piece and generated.endswith(piece) and suffix.startswith(piece):
                suffix = suffix[len(piece) :]
                break
        return self._with_images(self.encode(suffix), new_messages)
