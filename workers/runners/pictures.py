"""Images of a vision-language job: from the environments' messages to the engine's inputs.

Environments put images in their messages as data URIs (`environments.images`); the
renderer repeats each image's placeholder as many times as the base model's image processor
says it fills, and the rollout, the training datums and the KL reference hand the engine the
processed images in the same order (`training.vision.ImageInput`, cached by content in the
engine).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from environments.images import images_in
from environments.renderer import Renderer
from training.engine import Engine
from training.vision import ImageInput


def renderer_for(engine: Engine) -> Renderer:
    """The job's renderer: the base model's chat template, and its image processor's counts."""
    counts = engine.image_tokens if engine.processor is not None else None
    return Renderer(engine.tokenizer, image_tokens=counts)


def images_of(engine: Engine, messages: Sequence[Any]) -> tuple[ImageInput, ...]:
    """The processed images of `messages`, in the order their placeholders appear."""
    return tuple(engine.encode_image(data) for data in images_in(list(messages)))


def encode_all(engine: Engine, pictures: Sequence[bytes]) -> tuple[ImageInput, ...]:
    return tuple(engine.encode_image(data) for data in pictures)
