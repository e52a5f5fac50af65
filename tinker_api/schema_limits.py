"""Bounds on what a session, a model or a checkpoint stores for its client: metadata, tags,
names and TTLs. A Tinker body may be 64 MB (forward/backward batches), and without these a
client could store megabytes of metadata on every row it creates. Each sits well above what
the SDK and the cookbook send; PROTOCOL.md lists them.
"""

from __future__ import annotations

import json
from typing import Annotated, Any

from pydantic import Field

MAX_METADATA_KEYS = 64
MAX_METADATA_KEY_CHARS = 512
MAX_METADATA_VALUE_CHARS = 4096
MAX_TAGS = 64
MAX_TAG_CHARS = 256
MAX_NAME_CHARS = 256
# The SDK's documented range for a checkpoint's TTL: an hour to ten years. A TTL of seconds
# is a slip (minutes or hours meant) that would lose the checkpoint almost at once.
MIN_TTL_SECONDS = 3600
MAX_TTL_SECONDS = 10 * 365 * 24 * 3600
TtlSeconds = Annotated[int, Field(ge=MIN_TTL_SECONDS, le=MAX_TTL_SECONDS)]

# String values only: the SDK types user_metadata as dict[str, str] everywhere it reads it
# back, so a number or a list stored here would come back as its Python repr.
UserMetadata = Annotated[
    dict[
        Annotated[str, Field(max_length=MAX_METADATA_KEY_CHARS)],
        Annotated[str, Field(max_length=MAX_METADATA_VALUE_CHARS)],
    ],
    Field(max_length=MAX_METADATA_KEYS),
]
Tags = Annotated[list[Annotated[str, Field(max_length=MAX_TAG_CHARS)]], Field(max_length=MAX_TAGS)]
Name = Annotated[str, Field(max_length=MAX_NAME_CHARS)]


def metadata_out(stored: dict[str, Any] | None) -> dict[str, str] | None:
    """Stored metadata as the SDK reads it back: strings. Rows written before values had to be
    strings may hold numbers or lists; those come back as JSON, not as Python's repr."""
    if not stored:
        return None
    return {str(k): v if isinstance(v, str) else json.dumps(v) for k, v in stored.items()}
