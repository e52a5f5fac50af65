"""Media types, body compression and JSON request parsing: what every endpoint shares.

The 0.38 SDK sends forward/backward bodies as protobuf (``Content-Type:
application/x-protobuf``), zstd-compressed when the server's client config sets
``proto_compress_fwdbwd`` (``Content-Encoding: zstd``); older clients and curl send JSON.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Literal, TypeVar

import zstandard
from pydantic import BaseModel, ValidationError

from accounts.json_checks import unstorable_text_at

PROTOBUF = "application/x-protobuf"
JSON = "application/json"
# Bodies are limited after decompression too: a small zstd frame can expand enormously.
DEFAULT_MAX_DECODED_BYTES = 256 * 1024 * 1024


class WireError(ValueError):
    """A request body the server cannot accept. ``status`` is the HTTP status to answer
    with at submission (400 malformed, 413 too large, 415 unknown media type); the SDK
    shows the message to the user and does not retry a 4xx other than 408/409/429."""

    category: Literal["user"] = "user"

    def __init__(self, message: str, *, status: int = 400) -> None:
        super().__init__(message)
        self.status = status

    def body(self) -> dict[str, str]:
        return {"detail": str(self)}


@dataclass(frozen=True)
class EncodedBody:
    content: bytes
    content_type: str


def media_type(header: str | None) -> str:
    return (header or "").split(";", 1)[0].strip().lower()


def wants_protobuf(accept: str | None) -> bool:
    """True when the ``Accept`` header names the protobuf media type."""
    return any(media_type(part) == PROTOBUF for part in (accept or "").split(","))


def decompress(
    body: bytes, content_encoding: str | None, *, max_bytes: int = DEFAULT_MAX_DECODED_BYTES
) -> bytes:
    """Undo ``Content-Encoding`` (identity or zstd), refusing output over ``max_bytes``."""
    encoding = (content_encoding or "identity").strip().lower()
    if encoding in ("", "identity"):
        raw = body
    elif encoding == "zstd":
        try:
            size = zstandard.frame_content_size(body)
        except zstandard.ZstdError as exc:
            raise WireError(f"body is not a zstd frame: {exc}") from None
        if size > max_bytes:
            raise WireError(
                f"body expands to {size} bytes, over the {max_bytes}-byte limit", status=413
            )
        try:
            raw = zstandard.ZstdDecompressor().decompress(body, max_output_size=max_bytes)
        except zstandard.ZstdError as exc:
            # A frame that does not state its size stops at max_bytes with the same error
            # as a truncated one: inflate it again, no further than one byte past the limit.
            if size < 0 and _inflates_past(body, max_bytes):
                raise WireError(
                    f"body expands past the {max_bytes}-byte limit", status=413
                ) from None
            raise WireError(f"body is not valid zstd: {exc}") from None
    else:
        raise WireError(
            f"Content-Encoding {encoding!r} is not supported (use zstd or none)", status=415
        )
    if len(raw) > max_bytes:
        raise WireError(f"body is {len(raw)} bytes, over the {max_bytes}-byte limit", status=413)
    return raw


def _inflates_past(body: bytes, max_bytes: int) -> bool:
    try:
        with zstandard.ZstdDecompressor().stream_reader(body) as reader:
            return len(reader.read(max_bytes + 1)) > max_bytes
    except zstandard.ZstdError:
        return False


ModelT = TypeVar("ModelT", bound=BaseModel)


def parse_json(model: type[ModelT], body: bytes) -> ModelT:
    """Validate a JSON request body, turning pydantic's errors into a 400 ``WireError``."""
    try:
        parsed = model.model_validate_json(body)
    except ValidationError as exc:
        raise WireError(f"invalid {model.__name__}: {_first_errors(exc)}") from None
    # Ids are looked up and names stored in PostgreSQL, whose text holds no NUL. JSON can
    # spell one only as an escape, so a body without that escape needs no second parse.
    if b"\\u0000" in body:
        data = json.loads(body)
        if isinstance(data, dict):
            # Generation parameters (stop strings) go to the model worker, never to the
            # database: a NUL there is text like any other.
            data = {k: v for k, v in data.items() if k != "sampling_params"}
        found = unstorable_text_at(data)
        if found is not None:
            where, reason = found
            raise WireError(f"invalid {model.__name__}: {where or '(body)'}: {reason}")
    return parsed


def json_position(body: bytes) -> tuple[str, int] | None:
    """``(model_id, seq_id)`` of a JSON body that failed validation, when both can be read:
    the client has spent that seq_id even though the server refused the request."""
    try:
        data = json.loads(body)
    except (ValueError, RecursionError):
        return None
    if not isinstance(data, dict):
        return None
    model_id, seq = data.get("model_id"), data.get("seq_id")
    # bool is an int to Python, never a seq_id to the SDK.
    if not isinstance(model_id, str) or not known_id(model_id) or type(seq) is not int:
        return None
    return model_id, seq


def known_id(model_id: str) -> bool:
    """Whether ``model_id`` could name a model: not empty, and no NUL (which PostgreSQL's
    text cannot hold, so no row has one and a query for it would fail)."""
    return bool(model_id) and "\x00" not in model_id


def _first_errors(exc: ValidationError, limit: int = 3) -> str:
    parts = []
    for err in exc.errors()[:limit]:
        loc = ".".join(str(p) for p in err["loc"]) or "(body)"
        parts.append(f"{loc}: {err['msg']}")
    return "; ".join(parts)
