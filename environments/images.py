"""Images inside chat messages: how environments show a vision-language policy a picture.

A message's ``content`` is a string, or a list of parts in the form chat templates and
OpenAI's API share: ``{"type": "text", "text": ...}`` and ``{"type": "image", "image":
"data:image/png;base64,..."}``. An image travels as a data URI so that messages stay plain
JSON: they are pickled to env workers, written to evaluation transcripts (which the web UI
shows with their images) and rendered by the base model's chat template, which writes one
image placeholder per image part. The renderer then repeats each placeholder as many times
as the model's image processor says the image fills (`Renderer(image_tokens=...)`).
"""

from __future__ import annotations

import base64
import binascii
from typing import Any

FORMATS = {"png": "image/png", "jpeg": "image/jpeg", "jpg": "image/jpeg"}
# The magic bytes of the formats a model's processor reads here.
_MAGIC = {b"\x89PNG\r\n\x1a\n": "image/png", b"\xff\xd8\xff": "image/jpeg"}
MAX_IMAGE_BYTES = 8 * 1024 * 1024


class ImageError(ValueError):
    pass


def media_type(data: bytes) -> str:
    """The media type of PNG or JPEG bytes; ImageError for anything else."""
    for magic, kind in _MAGIC.items():
        if data.startswith(magic):
            return kind
    raise ImageError("an image must be PNG or JPEG")


def data_uri(data: bytes) -> str:
    if len(data) > MAX_IMAGE_BYTES:
        raise ImageError(f"an image must be at most {MAX_IMAGE_BYTES} bytes, got {len(data)}")
    return f"data:{media_type(data)};base64,{base64.b64encode(data).decode('ascii')}"


def from_data_uri(uri: str) -> bytes:
    head, sep, payload = uri.partition(",")
    if not sep or not head.startswith("data:image/") or not head.endswith(";base64"):
        raise ImageError("an image must be a data:image/png or data:image/jpeg base64 URI")
    try:
        data = base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError) as exc:
        raise ImageError(f"the image's base64 is invalid: {exc}") from None
    media_type(data)
    return data


def image_part(data: bytes) -> dict[str, str]:
    return {"type": "image", "image": data_uri(data)}


def text_part(text: str) -> dict[str, str]:
    return {"type": "text", "text": text}


def _parts(message: Any) -> list[Any]:
    content = message.get("content") if isinstance(message, dict) else None
    return content if isinstance(content, list) else []


def images_in(messages: list[Any]) -> list[bytes]:
    """The images of ``messages``, in the order a chat template writes them."""
    return [
        from_data_uri(str(part.get("image") or part.get("image_url", {}).get("url", "")))
        for message in messages
        for part in _parts(message)
        if isinstance(part, dict) and part.get("type") in ("image", "image_url")
    ]


def text_of(message: Any) -> str:
    """A message's text, its image parts left out (transcripts, grading, logs)."""
    content = message.get("content", "") if isinstance(message, dict) else ""
    if isinstance(content, str):
        return content
    return "".join(str(part.get("text", "")) for part in content if isinstance(part, dict))
