"""Where the images of Tinker requests come from, and how many positions each fills.

An ``ImageAssetPointerChunk`` names its image by location: a ``data:image/...;base64`` URI,
or a file (a path or ``file://`` URL) inside one of the directories the operator lists in
``OPENTINKER_IMAGE_ASSET_ROOTS`` (none by default). Anything else, a URL on the network
included, is refused: the server fetches nothing and reads no file a team was not given.
Both the web process (which counts an image's positions from its size to check the request)
and the model worker (which runs the image processor) resolve pointers the same way.
"""

from __future__ import annotations

import base64
import binascii
import functools
from collections.abc import Callable
from pathlib import Path
from urllib.parse import unquote, urlparse

from tinker_api import wire
from workers import conf

MAX_IMAGE_BYTES = 16 * 1024 * 1024


def resolve_pointer(image: wire.WireImage, where: str) -> None:
    """Give an asset pointer's image its bytes (`image.data`); WireError naming the chunk."""
    if image.data is not None or image.location is None:
        return
    label = f"{where}.chunks[{image.chunk}]"
    location = image.location
    if location.startswith("data:"):
        head, _, payload = location.partition(",")
        if not head.startswith("data:image/") or not head.endswith(";base64"):
            raise wire.WireError(f"{label}: a data location must be data:image/...;base64,...")
        try:
            image.data = base64.b64decode(payload, validate=True)
        except (binascii.Error, ValueError) as exc:
            raise wire.WireError(f"{label}: the data URI's base64 is invalid: {exc}") from None
        return
    parsed = urlparse(location)
    if parsed.scheme not in ("", "file"):
        raise wire.WireError(
            f"{label}: location {location!r}: this server fetches no URLs; send the image as "
            "an ImageChunk, a data: URI, or a file under OPENTINKER_IMAGE_ASSET_ROOTS"
        )
    path = Path(unquote(parsed.path) if parsed.scheme == "file" else location).resolve()
    roots: list[Path] = conf.setting("OPENTINKER_IMAGE_ASSET_ROOTS")
    if not any(path.is_relative_to(root) for root in roots):
        raise wire.WireError(
            f"{label}: location {location!r} is outside the directories this server reads "
            "images from (OPENTINKER_IMAGE_ASSET_ROOTS)"
        )
    try:
        if path.stat().st_size > MAX_IMAGE_BYTES:
            raise wire.WireError(f"{label}: the image is over {MAX_IMAGE_BYTES} bytes")
        image.data = path.read_bytes()
    except OSError as exc:
        raise wire.WireError(f"{label}: cannot read {location!r}: {exc.strerror}") from None


def resolve_pointers(images: list[wire.WireImage], where: str) -> None:
    for image in images:
        resolve_pointer(image, where)


def counter_for(
    directory: Path,
) -> tuple[Callable[[wire.WireImage, str], int] | None, int | None]:
    """(count, image token id) of a base model for `wire.expand_images`: an image's
    positions from its size and the model's processor geometry, its asset pointer resolved
    first. (None, None) for a text-only model."""
    shape = geometry(directory)
    if shape is None:
        return None, None

    def count(image: wire.WireImage, where: str) -> int:
        resolve_pointer(image, where)
        return wire.counter(shape, where)(image)

    return count, shape.image_token_id


def geometry(directory: Path) -> wire.ImageGeometry | None:
    """A base model's image geometry (None: text-only), cached per file version."""
    try:
        stamp = (directory / "preprocessor_config.json").stat().st_mtime_ns
    except OSError:
        return None
    return _geometry(str(directory), stamp)


@functools.lru_cache(maxsize=32)
def _geometry(directory: str, _stamp: int) -> wire.ImageGeometry | None:
    return wire.ImageGeometry.of_model(Path(directory))
