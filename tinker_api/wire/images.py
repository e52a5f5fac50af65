"""Images in a ``ModelInput``: ``ImageChunk`` (bytes) and ``ImageAssetPointerChunk`` (a
location), as the tinker SDK sends them for vision-language models.

An image chunk stands for as many positions as the base model's image processor gives the
image (``expected_tokens`` is the client's count; ``ModelInput.length`` and the loss inputs
count them). Decoding keeps the text tokens and, for each image, where it goes; `expand` then
puts the model's image placeholder token there that many times, once the count is known: in
the web process from the image's size and the model's ``preprocessor_config.json``
(`ImageGeometry`, the processor's own resize rule), in the model worker from the processor
itself. A client count that differs is refused naming the chunk, before anything runs.
"""

from __future__ import annotations

import base64
import binascii
import io
import json
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tinker_api.wire.media import WireError

FORMATS = frozenset({"png", "jpeg"})


@dataclass
class WireImage:
    """One image chunk of a model input."""

    chunk: int
    """Its index among the model input's chunks (errors name it)."""
    at: int
    """Where its placeholders start: before `expand`, the number of text tokens before it;
    after, its position in the expanded tokens."""
    format: str
    expected_tokens: int | None
    data: bytes | None = None
    location: str | None = None
    """Of an asset pointer chunk: resolved to `data` by the server before counting."""
    tokens: int | None = None
    """The positions it fills, once counted."""

    def to_json(self) -> dict[str, Any]:
        """What a queued op carries (the bytes as base64)."""
        assert self.data is not None and self.tokens is not None
        return {
            "chunk": self.chunk,
            "at": self.at,
            "tokens": self.tokens,
            "data": base64.b64encode(self.data).decode("ascii"),
        }


def image_chunk(chunk: int, at: int, fields: Any, *, pointer: bool) -> WireImage:
    """A WireImage from an ``image`` or ``image_asset_pointer`` chunk's fields (a protobuf
    message or a parsed JSON chunk)."""
    where = f"chunks[{chunk}]"
    fmt = str(getattr(fields, "format", "") or "")
    if fmt not in FORMATS:
        raise WireError(f"{where}: image format must be 'png' or 'jpeg', got {fmt!r}")
    expected = getattr(fields, "expected_tokens", None)
    if expected is not None and int(expected) < 1:
        raise WireError(f"{where}: expected_tokens must be at least 1, got {expected}")
    image = WireImage(chunk, at, fmt, None if expected is None else int(expected))
    if pointer:
        location = str(getattr(fields, "location", "") or "")
        if not location:
            raise WireError(f"{where}: an image asset pointer needs a location")
        image.location = location
    else:
        data = getattr(fields, "data", b"")
        if isinstance(data, str):
            try:
                data = base64.b64decode(data, validate=True)
            except (binascii.Error, ValueError) as exc:
                raise WireError(f"{where}: image data is not valid base64: {exc}") from None
        if not data:
            raise WireError(f"{where}: the image has no data")
        image.data = bytes(data)
    return image


def image_size(data: bytes, where: str) -> tuple[int, int]:
    """(width, height) from the image's header; WireError when it is not a PNG or JPEG."""
    from PIL import Image, UnidentifiedImageError

    try:
        with Image.open(io.BytesIO(data)) as image:
            if image.format not in ("PNG", "JPEG"):
                raise WireError(f"{where}: the image is {image.format}, not PNG or JPEG")
            return int(image.width), int(image.height)
    except (UnidentifiedImageError, OSError) as exc:
        raise WireError(f"{where}: the image cannot be read: {exc}") from None


@dataclass(frozen=True)
class ImageGeometry:
    """How a Qwen2-VL-family processor turns an image into tokens: resized to multiples of
    patch x merge pixels within [min_pixels, max_pixels], one token per merge x merge
    patches."""

    patch_size: int
    merge_size: int
    min_pixels: int
    max_pixels: int
    image_token_id: int

    @classmethod
    def of_model(cls, directory: Path) -> ImageGeometry | None:
        """The geometry of a model directory; None for a text-only model."""
        try:
            config = json.loads((directory / "config.json").read_text())
            processor = json.loads((directory / "preprocessor_config.json").read_text())
        except (OSError, ValueError):
            return None
        token = config.get("image_token_id")
        if token is None:
            return None
        size = processor.get("size") or {}
        return cls(
            patch_size=int(processor.get("patch_size", 14)),
            merge_size=int(processor.get("merge_size", 2)),
            min_pixels=int(size.get("shortest_edge") or processor.get("min_pixels") or 56 * 56),
            max_pixels=int(
                size.get("longest_edge") or processor.get("max_pixels") or 28 * 28 * 1280
            ),
            image_token_id=int(token),
        )

    def tokens(self, width: int, height: int) -> int:
        """The processor's resize rule (`smart_resize`), then patches / merge^2."""
        if max(width, height) / min(width, height) > 200:
            raise ValueError("the image's aspect ratio is over 200")
        factor = self.patch_size * self.merge_size
        h = round(height / factor) * factor
        w = round(width / factor) * factor
        if h * w > self.max_pixels:
            beta = math.sqrt(height * width / self.max_pixels)
            h = max(factor, math.floor(height / beta / factor) * factor)
            w = max(factor, math.floor(width / beta / factor) * factor)
        elif h * w < self.min_pixels:
            beta = math.sqrt(self.min_pixels / (height * width))
            h = math.ceil(height * beta / factor) * factor
            w = math.ceil(width * beta / factor) * factor
        return (h // self.patch_size) * (w // self.patch_size) // self.merge_size**2


def expand(
    text_tokens: Sequence[int],
    images: list[WireImage],
    count: Callable[[WireImage], int],
    image_token_id: int,
    where: str,
) -> list[int]:
    """The model input's tokens with each image's placeholders in place; sets each image's
    `tokens` and final `at`. Refuses an image whose count differs from `expected_tokens`."""
    out: list[int] = []
    taken = 0
    for image in images:
        out.extend(text_tokens[taken : image.at])
        taken = image.at
        label = f"{where}.chunks[{image.chunk}]"
        try:
            n = count(image)
        except WireError:
            raise
        except ValueError as exc:
            raise WireError(f"{label}: {exc}") from None
        if image.expected_tokens is not None and image.expected_tokens != n:
            raise WireError(
                f"{label}: expected_tokens is {image.expected_tokens}, but this model's "
                f"image processor gives the image {n} tokens"
            )
        image.tokens, image.at = n, len(out)
        out.extend([image_token_id] * n)
    out.extend(text_tokens[taken:])
    return out


def counter(geometry: ImageGeometry, where: str) -> Callable[[WireImage], int]:
    """Count an image's tokens from its header and the model's processor geometry."""

    def count(image: WireImage) -> int:
        assert image.data is not None
        width, height = image_size(image.data, f"{where}.chunks[{image.chunk}]")
        return geometry.tokens(width, height)

    return count
