"""Error answers outside the API views: unknown paths, oversized bodies, server errors.

DRF answers its own errors as ``{"detail": ...}``; these handlers give everything Django
answers itself (a path no view matches, a body over ``DATA_UPLOAD_MAX_MEMORY_SIZE``, an
exception no view caught) the same shape under ``/api/``, where clients parse JSON (the
``tinker`` SDK prints the body of an error inside its exception), and OpenAI's shape under
``/v1/``, whose clients read ``{"error": {...}}`` (docs/serving.md). Pages keep Django's plain
error pages, which never show a traceback with DEBUG off.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import redis
from django.conf import settings
from django.core.exceptions import RequestDataTooBig
from django.http import HttpRequest, HttpResponse, JsonResponse
from django.views import defaults
from kombu.exceptions import OperationalError

from tinker_api.serving.errors import ApiError

log = logging.getLogger(__name__)

OPENAI_PREFIX = "/v1/"
API_PREFIXES = ("/api/", "/healthz", OPENAI_PREFIX)


def wants_json(request: HttpRequest) -> bool:
    return request.path.startswith(API_PREFIXES)


def _answer(request: HttpRequest, status: int, detail: str) -> JsonResponse:
    if request.path.startswith(OPENAI_PREFIX):
        return ApiError(status, detail).response()
    return JsonResponse({"detail": detail}, status=status)


# Seconds a client told that Redis is unreachable waits before it retries: a restart or a
# failover takes seconds, and the SDKs retry a 503 on their own.
REDIS_RETRY_AFTER_SECONDS = 5


class RedisUnavailableMiddleware:
    """Answers a request that Redis (the futures, the GPU lock table, the Celery broker)
    could not serve with a 503 that says so, instead of a 500: the fault is the
    dependency's, it passes, and a client that retries then succeeds. The web process needs
    no restart afterwards: redis-py reconnects on the next call."""

    def __init__(self, get_response: Callable[[HttpRequest], HttpResponse]) -> None:
        self.get_response = get_response

    def __call__(self, request: HttpRequest) -> HttpResponse:
        return self.get_response(request)

    def process_exception(self, request: HttpRequest, exception: Exception) -> HttpResponse | None:
        # A ResponseError is a bug of ours (a wrong command), not an outage: it stays a 500.
        if not isinstance(
            exception, redis.ConnectionError | redis.TimeoutError | OperationalError
        ) or not wants_json(request):
            return None
        log.warning("%s %s: Redis unreachable: %s", request.method, request.path, exception)
        detail = (
            f"the service's Redis is unreachable ({type(exception).__name__}); retry in "
            f"{REDIS_RETRY_AFTER_SECONDS} s"
        )
        response = _answer(request, 503, detail)
        response["Retry-After"] = str(REDIS_RETRY_AFTER_SECONDS)
        return response


def bad_request(request: HttpRequest, exception: Exception) -> HttpResponse:
    if isinstance(exception, RequestDataTooBig):
        limit = settings.DATA_UPLOAD_MAX_MEMORY_SIZE
        if wants_json(request):
            return _answer(request, 413, f"request body too large: the limit is {limit} bytes")
        return HttpResponse("Request body too large.", status=413, content_type="text/plain")
    if wants_json(request):
        return _answer(request, 400, "bad request")
    return defaults.bad_request(request, exception)


def permission_denied(request: HttpRequest, exception: Exception) -> HttpResponse:
    if wants_json(request):
        return _answer(request, 403, "permission denied")
    return defaults.permission_denied(request, exception)


def page_not_found(request: HttpRequest, exception: Exception) -> HttpResponse:
    if wants_json(request):
        return _answer(request, 404, f"no endpoint {request.method} {request.path}")
    return defaults.page_not_found(request, exception)


def server_error(request: HttpRequest) -> HttpResponse:
    if wants_json(request):
        # What failed is in the server's log; the answer says no more than that it failed.
        return _answer(request, 500, "internal server error")
    return defaults.server_error(request)
