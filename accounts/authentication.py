"""DRF authentication by API key: ``Authorization: Bearer otk_...`` or ``X-API-Key: otk_...``."""

from __future__ import annotations

from typing import Any

from rest_framework.authentication import BaseAuthentication, get_authorization_header
from rest_framework.exceptions import AuthenticationFailed
from rest_framework.request import Request

from .models import ApiKey


class ApiKeyAuthentication(BaseAuthentication):
    """Sets ``request.user`` to the key's creator and ``request.auth`` to the ApiKey."""

    keyword = "Bearer"
    www_authenticate_realm = "api"

    def _raw_key(self, request: Request) -> str | None:
        header = get_authorization_header(request).split()
        # Another scheme (a proxy's Basic credentials, say) is not ours to judge: the key may
        # still come in X-API-Key, and otherwise the next authenticator decides.
        if header and header[0].lower() == self.keyword.lower().encode():
            if len(header) != 2:
                raise AuthenticationFailed("Malformed Authorization header: use 'Bearer <key>'.")
            try:
                return header[1].decode()
            except UnicodeDecodeError as exc:
                raise AuthenticationFailed("Invalid API key.") from exc
        value = request.META.get("HTTP_X_API_KEY")
        if value is None:
            return None
        value = value.strip()
        if not value:
            raise AuthenticationFailed("Empty X-API-Key header.")
        return value

    def authenticate(self, request: Request) -> tuple[Any, ApiKey] | None:
        raw = self._raw_key(request)
        if raw is None:
            return None
        key = ApiKey.objects.for_key(raw)
        if key is None:
            # One message for unknown, revoked and expired keys: no oracle for key state.
            raise AuthenticationFailed("Invalid, expired or revoked API key.")
        key.touch()
        return key.created_by, key

    def authenticate_header(self, request: Request) -> str:
        return f'{self.keyword} realm="{self.www_authenticate_realm}"'
