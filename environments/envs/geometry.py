"""`geometry` (dataset x single turn): a diagram and a question; the reward checks the answer.

Rows have geometry3k's shape: ``images`` (one or more PNG or JPEG images, each as base64 or a
``data:image/...;base64,`` URI), ``problem`` (its text; ``<image>`` marks where an image goes,
as geometry3k writes it; images without a marker come before the text) and ``answer`` (a
number or an expression, compared for equivalence by `environments.grading`). The policy sees
one user message whose parts interleave text and images, rendered by a vision-language base
model's chat template (`environments.images`).

Reward: 1.0 when the last ``\\boxed{}`` (or, failing that, the last number) equals the answer,
else 0.0; plus ``format_reward`` when the answer is boxed. ``builtin:geometry_train`` and
``builtin:geometry_test`` hold synthetic geometry3k-style problems (`training.geometry`,
drawn by ``scripts/build_datasets.py`` from disjoint seeds).
"""

from __future__ import annotations

import base64
import binascii
from dataclasses import dataclass
from typing import Any

from pydantic import Field
from pydantic.dataclasses import dataclass as pydantic_dataclass

from environments import images
from environments.grading import answers_match, extract_answer, has_format
from environments.types import (
    STRICT_CONFIG,
    Episode,
    GroupBuilder,
    Message,
    StepResult,
    StopCondition,
)

IMAGE_MARK = "<image>"
MAX_IMAGES = 8


@pydantic_dataclass(frozen=True, config=STRICT_CONFIG)
class GeometryConfig:
    format_reward: float = 0.0
    """Added when the answer is inside \\boxed{} (0 disables the format reward)."""
    prompt_suffix: str = ""
    """Appended to the problem text, e.g. " Give the answer in \\boxed{}."."""
    system_prompt: str = ""
    max_tokens: int = Field(default=64, ge=1)


def image_bytes(value: Any) -> bytes:
    """One ``images`` item (base64 or a data URI) as PNG or JPEG bytes; ImageError if not."""
    if not isinstance(value, str) or not value:
        raise images.ImageError("an image must be a base64 string or a data:image/... URI")
    if value.startswith("data:"):
        return images.from_data_uri(value)
    try:
        data = base64.b64decode(value, validate=True)
    except (binascii.Error, ValueError) as exc:
        raise images.ImageError(f"not valid base64: {exc}") from None
    images.media_type(data)
    return data


def check_images(value: Any) -> str | None:
    """Why an ``images`` cell is not usable, or None (the dataset schema's check)."""
    if not isinstance(value, list) or not value:
        return "expected a non-empty list of images"
    if len(value) > MAX_IMAGES:
        return f"at most {MAX_IMAGES} images per row, got {len(value)}"
    for i, item in enumerate(value):
        try:
            image_bytes(item)
        except images.ImageError as exc:
            return f"image {i}: {exc}"
    return None


def user_content(problem: str, pictures: list[bytes]) -> list[dict[str, str]]:
    """The problem's text and images as message parts, each image where ``<image>`` marks it."""
    pieces = problem.split(IMAGE_MARK)
    marked = len(pieces) - 1
    if marked > len(pictures):
        raise ValueError(f"the problem marks {marked} images but the row has {len(pictures)}")
    parts: list[dict[str, str]] = [images.image_part(p) for p in pictures[marked:]]
    for i, piece in enumerate(pieces):
        if piece.strip():
            parts.append(images.text_part(piece))
        if i < marked:
            parts.append(images.image_part(pictures[i]))
    return parts


class GeometryEpisode(Episode):
    def __init__(self, problem: str, pictures: list[bytes], answer: str, config: GeometryConfig):
        super().__init__()
        self.problem = problem
        self.pictures = pictures
        self.answer = answer
        self.config = config

    def _initial(self) -> tuple[list[Message], StopCondition]:
        messages: list[Message] = []
        if self.config.system_prompt:
            messages.append({"role": "system", "content": self.config.system_prompt})
        content = user_content(self.problem + self.config.prompt_suffix, self.pictures)
        messages.append({"role": "user", "content": content})
        return messages, StopCondition(max_tokens=self.config.max_tokens)

    def _step(self, action: str) -> StepResult:
        given = extract_answer(action)
        correct = answers_match(given, self.answer)
        formatted = has_format(action)
        return StepResult(
            reward=float(correct) + (self.config.format_reward if formatted else 0.0),
            done=True,
            metrics={"correct": float(correct), "format": float(formatted)},
            error=None if given is not None else "no_answer",
            info={"given": given, "answer": self.answer},
        )


@dataclass
class GeometryGroupBuilder(GroupBuilder):
    problem: str
    pictures: list[bytes]
    answer: str
    group_size: int
    config: GeometryConfig
    env_name: str = "geometry"

    def make_episodes(self) -> list[Episode]:
        return [
            GeometryEpisode(self.problem, self.pictures, self.answer, self.config)
            for _ in range(self.group_size)
        ]


def make_builder(
    config: GeometryConfig, row: dict[str, Any], group_size: int
) -> GeometryGroupBuilder:
    reason = check_images(row.get("images"))
    if reason:
        raise ValueError(f"row.images: {reason}")
    pictures = [image_bytes(item) for item in row["images"]]
    problem = str(row["problem"])
    user_content(problem, pictures)  # refuse a row with more marks than images now
    return GeometryGroupBuilder(problem, pictures, str(row["answer"]), group_size, config)
