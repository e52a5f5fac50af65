"""OpenAPI 3 schema and the API reference pages."""

from __future__ import annotations

import io
import json

import pytest
from django.conf import settings
from django.core.management import call_command
from drf_spectacular.validation import validate_schema

pytestmark = pytest.mark.django_db

DOCUMENTED_PATHS = {
    "/api/v1/jobs",
    "/api/v1/jobs/{id}",
    "/api/v1/jobs/{id}/cancel",
    "/api/v1/jobs/{id}/events",
    "/api/v1/jobs/{id}/metrics",
    "/api/v1/keys",
    "/api/v1/keys/{id}/rotate",
    "/api/v1/keys/{id}/revoke",
    "/api/v1/teams",
    "/api/v1/quota",
}


def test_it_serves_a_valid_openapi_schema(anon_client):
    response = anon_client.get("/api/schema/", HTTP_ACCEPT="application/vnd.oai.openapi+json")
    assert response.status_code == 200
    schema = json.loads(response.content)
    assert schema["openapi"].startswith("3.")
    validate_schema(schema)
    assert set(schema["paths"]) >= DOCUMENTED_PATHS
    schemes = schema["components"]["securitySchemes"]
    assert schemes["bearerAuth"]["scheme"] == "bearer"
    assert schemes["apiKeyHeader"]["name"] == "X-API-Key"


def test_it_generates_the_schema_without_warnings(tmp_path):
    # --fail-on-warn turns every guess drf-spectacular had to make into an error.
    call_command(
        "spectacular",
        "--validate",
        "--fail-on-warn",
        "--file",
        str(tmp_path / "schema.yml"),
        stderr=io.StringIO(),
    )
    assert "/api/v1/jobs/{id}/cancel" in (tmp_path / "schema.yml").read_text()


def test_it_serves_the_api_reference_without_a_cdn(anon_client):
    response = anon_client.get("/api/docs/")
    assert response.status_code == 200
    page = response.content.decode()
    assert "swagger" in page.lower()
    if settings.SPECTACULAR_SIDECAR:
        assert "cdn.jsdelivr.net" not in page
        assert "/static/drf_spectacular_sidecar/" in page


def test_it_answers_the_health_check(anon_client):
    response = anon_client.get("/healthz")
    assert response.status_code == 200 and response.json() == {"status": "ok"}
