"""API keys of the current team: issue (the plaintext shown once), rotate, revoke."""

from __future__ import annotations

from datetime import timedelta

from django.conf import settings
from django.contrib import messages
from django.contrib.auth.decorators import login_required
from django.core.exceptions import PermissionDenied
from django.http import HttpRequest, HttpResponse
from django.shortcuts import redirect, render
from django.utils import timezone
from django.views.decorators.cache import never_cache
from django.views.decorators.http import require_POST

from accounts.keys import KeyRefused, issue_key, revoke_key, rotate_key
from accounts.models import ApiKey, Team
from web.forms import KeyForm
from web.teams import is_owner, page_team

from .common import acted_on, no_team


def _can_manage_key(request: HttpRequest, key: ApiKey) -> bool:
    return key.created_by_id == request.user.pk or is_owner(key.team, request.user)


def _keys_page(
    request: HttpRequest,
    team: Team,
    *,
    form: KeyForm | None = None,
    secret: str | None = None,
    secret_key: ApiKey | None = None,
) -> HttpResponse:
    keys = ApiKey.objects.filter(team=team).select_related("created_by").order_by("-created")
    now = timezone.now()
    rows = [{"key": k, "live": k.is_live(now), "manage": _can_manage_key(request, k)} for k in keys]
    response = render(
        request,
        "web/keys.html",
        {"rows": rows, "form": form or KeyForm(), "secret": secret, "secret_key": secret_key},
    )
    if secret:
        # The plaintext exists only in this response: keep it out of every cache.
        response["Cache-Control"] = "no-store"
    return response


@login_required
@never_cache
def keys(request: HttpRequest) -> HttpResponse:
    team = page_team(request)
    if team is None:
        return no_team(request)
    if request.method == "POST":
        form = KeyForm(request.POST)
        if form.is_valid():
            days = form.cleaned_data.get("expires_in_days")
            expires = timezone.now() + timedelta(days=days) if days else None
            try:
                key, secret = issue_key(team, request.user, form.cleaned_data["name"], expires)
            except (KeyRefused, ValueError) as exc:
                form.add_error(None, str(exc))
            else:
                return _keys_page(request, team, secret=secret, secret_key=key)
        return _keys_page(request, team, form=form)
    return _keys_page(request, team)


@login_required
@require_POST
@never_cache
def key_rotate(request: HttpRequest, pk: int) -> HttpResponse:
    key = acted_on(request, ApiKey.objects.all(), pk)
    if not _can_manage_key(request, key):
        raise PermissionDenied("only the key's creator or a team owner may rotate it")
    try:
        new, secret = rotate_key(key, user=request.user)
    except KeyRefused as exc:
        messages.error(request, str(exc))
        return redirect("web:keys")
    grace = settings.OPENTINKER_KEY_ROTATION_GRACE_HOURS
    messages.info(request, f"Rotated. The old key keeps working for {grace} h.")
    return _keys_page(request, key.team, secret=secret, secret_key=new)


@login_required
@require_POST
def key_revoke(request: HttpRequest, pk: int) -> HttpResponse:
    key = acted_on(request, ApiKey.objects.all(), pk)
    if not _can_manage_key(request, key):
        raise PermissionDenied("only the key's creator or a team owner may revoke it")
    if revoke_key(key):
        messages.success(request, f"Key {key.name} ({key.display_prefix}) revoked.")
    else:
        messages.info(request, "That key was already revoked.")
    return redirect("web:keys")
