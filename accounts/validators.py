"""Input hygiene shared by the API and the pages: names people read, and request shapes.

A name (of a job, a key, a dataset) is shown in lists, terminals and mails. Control characters
(newlines, ANSI escapes) forge lines and colours there, bidirectional overrides make one name
read as another, and a name of invisible characters only is no name at all.
"""

from __future__ import annotations

import unicodedata
from collections.abc import Mapping
from typing import Any

from django.core.exceptions import ValidationError

# The explicit direction marks, embeddings, overrides and isolates of Unicode's bidi algorithm.
BIDI_CONTROLS = frozenset(
    "\u061c\u200e\u200f\u202a\u202b\u202c\u202d\u202e\u2066\u2067\u2068\u2069"
)


def validate_display_name(value: str) -> None:
    for char in value:
        if unicodedata.category(char) == "Cc":
            raise ValidationError(f"must not contain control characters (found U+{ord(char):04X}).")
        if char in BIDI_CONTROLS:
            raise ValidationError(
                f"must not contain bidirectional text controls (found U+{ord(char):04X})."
            )
    visible = [c for c in value if not c.isspace() and unicodedata.category(c) != "Cf"]
    if value and not visible:
        raise ValidationError("must contain a visible character.")


class RefuseUnknownFields:
    """A serializer mixin: a field the serializer does not declare is a 400 naming it, not a
    silently dropped value (a typo such as ``priorty`` would otherwise look accepted)."""

    fields: Mapping[str, Any]

    def to_internal_value(self, data: Any) -> Any:
        if isinstance(data, Mapping):
            unknown = sorted(set(data) - set(self.fields))
            if unknown:
                from rest_framework.exceptions import ValidationError as ApiValidationError

                known = ", ".join(sorted(self.fields))
                raise ApiValidationError(
                    {name: [f"unknown field; known: {known}."] for name in unknown}
                )
        return super().to_internal_value(data)  # type: ignore[misc]
