"""Errors in OpenAI's shape: ``{"error": {"message", "type", "param", "code"}}``.

The ``type`` follows the status as OpenAI's clients map it (``openai.BadRequestError`` for
400, ``NotFoundError`` for 404 ...), and a 429 carries ``Retry-After``, which the official
clients wait for before they retry.
"""

from __future__ import annotations

import math
from typing import Any

from django.http import JsonResponse

TYPES = {
    400: "invalid_request_error",
    401: "invalid_request_error",
    403: "invalid_request_error",
    404: "invalid_request_error",
    405: "invalid_request_error",
    413: "invalid_request_error",
    # OpenAI's type for a limit on requests (its code is rate_limit_exceeded).
    429: "requests",
    500: "server_error",
    503: "server_error",
}
# Seconds a client told "queue full" waits before retrying.
RETRY_AFTER_SECONDS = 1


class ApiError(Exception):
    def __init__(
        self,
        status: int,
        message: str,
        param: str | None = None,
        code: str | None = None,
        *,
        retry_after: float = RETRY_AFTER_SECONDS,
        headers: dict[str, str] | None = None,
        error_type: str | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.retry_after = retry_after
        self.headers = dict(headers or {})
        self.error_type = error_type

    def body(self) -> dict[str, Any]:
        return {
            "error": {
                "message": self.message,
                "type": self.error_type or TYPES.get(self.status, "invalid_request_error"),
                "param": self.param,
                "code": self.code,
            }
        }

    def response(self) -> JsonResponse:
        response = JsonResponse(self.body(), status=self.status)
        if self.status == 429:
            response["Retry-After"] = str(max(1, math.ceil(self.retry_after)))
        for name, value in self.headers.items():
            response[name] = value
        return response


def model_not_found(name: str) -> ApiError:
    return ApiError(
        404,
        f"The model `{name}` does not exist or you do not have access to it.",
        "model",
        "model_not_found",
    )
