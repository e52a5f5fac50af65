"""OpenAPI description of the API key scheme for drf-spectacular."""

from __future__ import annotations

from typing import Any

from drf_spectacular.extensions import OpenApiAuthenticationExtension


class ApiKeyAuthenticationScheme(OpenApiAuthenticationExtension):
    target_class = "accounts.authentication.ApiKeyAuthentication"
    name = ["bearerAuth", "apiKeyHeader"]

    def get_security_definition(self, auto_schema: Any) -> list[dict[str, str]]:
        return [
            {"type": "http", "scheme": "bearer", "bearerFormat": "otk_<prefix>_<secret>"},
            {"type": "apiKey", "in": "header", "name": "X-API-Key"},
        ]
