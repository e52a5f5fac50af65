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


ERROR_SCHEMA = {
    "type": "object",
    "description": 'DRF\'s error shape: {"detail": "..."}, or {"<field>": ["reason", ...]} for a '
    "bad field.",
    "additionalProperties": True,
    "properties": {"detail": {"type": "string"}},
}
ERRORS = {
    "400": "Bad input: a field named with its reason, or a malformed body.",
    "401": "No API key, or one that is invalid, expired or revoked.",
    "403": "The key may not do this (not a member, not an owner, a quota reached).",
    "404": "No such object in the caller's teams, no such team, or an invalid page cursor.",
    "409": "The request conflicts with the current state (a name taken, a key already rotated).",
    "413": "The request body is larger than the server accepts.",
    "429": "Too many requests or too many queued jobs: retry after a while.",
}
WRITE_METHODS = {"post", "put", "patch", "delete"}


def document_errors(
    result: dict[str, Any], generator: Any, request: Any, public: bool
) -> dict[str, Any]:
    """drf-spectacular postprocessing hook: every API operation lists the error answers it can
    give, in the one shape they all have, so that clients (and schemathesis) know them.

    Which codes apply follows from the operation: any call may answer 401, 403 and 404 (a
    key's scope names its team; an object or a page cursor may not exist); one that takes a
    body or query parameters, 400; a write, 409, 413 and 429. Codes an operation documents
    itself are kept."""
    components = result.setdefault("components", {}).setdefault("schemas", {})
    components.setdefault("Error", ERROR_SCHEMA)
    ref = {"$ref": "#/components/schemas/Error"}
    for item in result.get("paths", {}).values():
        for method, operation in item.items():
            if method not in {"get", "post", "put", "patch", "delete"}:
                continue
            params = operation.get("parameters", [])
            codes = {"401", "403", "404"}
            if "requestBody" in operation or any(p.get("in") == "query" for p in params):
                codes.add("400")
            if method in WRITE_METHODS:
                codes |= {"400", "409", "413", "429"}
            responses = operation.setdefault("responses", {})
            for code in sorted(codes):
                entry = responses.setdefault(code, {"description": ERRORS[code]})
                entry.setdefault("content", {"application/json": {"schema": ref}})
    return result
