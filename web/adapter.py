"""allauth adapter: the administrators' switch for self sign-up."""

from __future__ import annotations

from allauth.account.adapter import DefaultAccountAdapter
from django.conf import settings
from django.http import HttpRequest


class AccountAdapter(DefaultAccountAdapter):
    def is_open_for_signup(self, request: HttpRequest) -> bool:
        # Read per request so that tests and a settings reload take effect without a restart.
        return bool(getattr(settings, "OPENTINKER_ALLOW_SIGNUP", True))
