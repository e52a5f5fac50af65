"""Root URLs: admin, API v1, OpenAI-compatible /v1, OpenAPI schema and docs, health check,
sign-in and web pages."""

from __future__ import annotations

from django.contrib import admin
from django.db import connection
from django.http import Http404, HttpRequest, HttpResponse, JsonResponse
from django.urls import include, path
from django.views.decorators.csrf import csrf_exempt
from drf_spectacular.views import SpectacularAPIView, SpectacularRedocView, SpectacularSwaggerView

from opentinker_site.errors import page_not_found


# Exempt so that a POST gets the JSON 405 below, not the CSRF check's HTML 403 page.
@csrf_exempt
def healthz(request: HttpRequest) -> JsonResponse:
    """Liveness plus a database round trip, for load balancers and docker-compose."""
    if request.method not in ("GET", "HEAD"):
        response = JsonResponse({"detail": f'Method "{request.method}" not allowed.'}, status=405)
        response["Allow"] = "GET, HEAD"
        return response
    with connection.cursor() as cursor:
        cursor.execute("SELECT 1")
    return JsonResponse({"status": "ok"})


@csrf_exempt
def api_prefix(request: HttpRequest) -> HttpResponse:
    """The bare prefix serves nothing: its JSON 404 here, where APPEND_SLASH would answer an
    HTML redirect to "/api/v1/", which serves nothing either."""
    return page_not_found(request, Http404())


handler400 = "opentinker_site.errors.bad_request"
handler403 = "opentinker_site.errors.permission_denied"
handler404 = "opentinker_site.errors.page_not_found"
handler500 = "opentinker_site.errors.server_error"

urlpatterns = [
    path("admin/", admin.site.urls),
    path("api/v1", api_prefix),
    path("api/v1/", include("opentinker_site.api")),
    # The Tinker protocol: paths fixed by the tinker SDK (create_session, asample, ...).
    path("api/v1/", include("tinker_api.urls")),
    # OpenAI-compatible serving of every trained policy (docs/serving.md).
    path("v1/", include("tinker_api.serving.urls")),
    path("api/auth/", include("rest_framework.urls")),
    path("api/schema/", SpectacularAPIView.as_view(), name="schema"),
    path("api/docs/", SpectacularSwaggerView.as_view(url_name="schema"), name="api-docs"),
    path("api/redoc/", SpectacularRedocView.as_view(url_name="schema"), name="api-redoc"),
    path("healthz", healthz, name="healthz"),
    # Web UI: allauth's sign-in pages, then the team pages at the root.
    path("accounts/", include("allauth.urls")),
    path("", include("web.urls")),
]
