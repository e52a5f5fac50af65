"""The API's JSON renderer: DRF's, safe for a lone surrogate in what it echoes.

With ``UNICODE_JSON`` (DRF's default) the answer is written as UTF-8, and a lone UTF-16
surrogate (a key of a refused body, ``{"\\ud800": 1}``, named in its 400) has no UTF-8 form:
the error answer itself failed with a 500. Only such an answer is written with ``\\uXXXX``
escapes; every other one keeps its characters as they are.
"""

from __future__ import annotations

from typing import Any

from rest_framework.renderers import JSONRenderer


class _AsciiJSONRenderer(JSONRenderer):
    ensure_ascii = True


class SurrogateSafeJSONRenderer(JSONRenderer):
    def render(
        self,
        data: Any,
        accepted_media_type: str | None = None,
        renderer_context: dict[str, Any] | None = None,
    ) -> bytes:
        try:
            return super().render(data, accepted_media_type, renderer_context)
        except UnicodeEncodeError:
            return _AsciiJSONRenderer().render(data, accepted_media_type, renderer_context)


__all__ = ["SurrogateSafeJSONRenderer"]
