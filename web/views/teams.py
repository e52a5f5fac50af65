"""The team page: members and roles, invitations, quota usage, and the team switcher.

Owner-only checks stay here (they answer 403); the writes and the last-owner rule are
``accounts.teams``', whose refusals come back as messages on the page.
"""

from __future__ import annotations

from django.contrib import messages
from django.contrib.auth.decorators import login_required
from django.core.exceptions import PermissionDenied
from django.http import Http404, HttpRequest, HttpResponse
from django.shortcuts import redirect, render
from django.urls import reverse
from django.utils.http import url_has_allowed_host_and_scheme
from django.views.decorators.http import require_POST

from accounts import teams
from accounts.models import Invitation, Membership
from web import actions
from web.forms import InviteForm, RoleForm
from web.teams import current_team, is_owner, member_team, page_team, set_current_team

from .common import acted_on, no_team, usage_bars


@login_required
@require_POST
def switch_team(request: HttpRequest) -> HttpResponse:
    team = member_team(request.user, request.POST.get("team", ""))
    if team is None:
        raise Http404("no such team")
    set_current_team(request, team)
    messages.info(request, f"Now working in team {team.name}.")
    target = request.POST.get("next") or reverse("web:jobs")
    # A path of this site only: browsers read "/\\host" as "//host", another site.
    if not target.startswith("/") or not url_has_allowed_host_and_scheme(target, None):
        target = reverse("web:jobs")
    return redirect(target)


@login_required
def team_page(request: HttpRequest) -> HttpResponse:
    team = current_team(request)
    if team is None:
        return no_team(request)
    owner = is_owner(team, request.user)
    members = team.memberships.select_related("user").order_by("user__username")
    invites = Invitation.objects.filter(team=team, accepted__isnull=True) if owner else []
    return render(
        request,
        "web/team.html",
        {
            "team": team,
            "members": members,
            "is_owner": owner,
            "invite_form": InviteForm(),
            "invites": invites,
            "usage": usage_bars(team),
            "roles": Membership.Role.choices,
        },
    )


@login_required
@require_POST
def team_invite(request: HttpRequest) -> HttpResponse:
    team = page_team(request)
    if team is None:
        return no_team(request)
    if not is_owner(team, request.user):
        raise PermissionDenied("only team owners may invite")
    form = InviteForm(request.POST)
    if not form.is_valid():
        for field, errs in form.errors.items():
            messages.error(request, f"{field}: {' '.join(errs)}")
        return redirect("web:team")
    email = form.cleaned_data["email"].lower()
    invited = actions.invite_and_notify(
        team,
        email=email,
        role=form.cleaned_data["role"],
        invited_by=request.user,
        jobs_url=request.build_absolute_uri(reverse("web:jobs")),
        signup_url=request.build_absolute_uri(reverse("account_signup")),
    )
    if invited.user is None:
        messages.success(request, f"Invitation sent to {email}.")
    elif invited.joined:
        messages.success(request, f"{invited.user} joined {team.name}.")
    else:
        messages.info(request, f"{invited.user} is already a member.")
    return redirect("web:team")


@login_required
@require_POST
def team_remove(request: HttpRequest, pk: int) -> HttpResponse:
    membership = acted_on(request, Membership.objects.select_related("user"), pk)
    team = membership.team
    leaving = membership.user_id == request.user.pk
    if not leaving and not is_owner(team, request.user):
        raise PermissionDenied("only team owners may remove members")
    try:
        if leaving:
            teams.leave_team(team, request.user)
        else:
            teams.remove_member(membership)
    except teams.TeamRefused as exc:
        messages.error(request, str(exc))
        return redirect("web:team")
    if leaving:
        messages.success(request, f"You left {team.name}.")
        return redirect("web:jobs")
    messages.success(request, f"{membership.user} was removed from {team.name}.")
    return redirect("web:team")


@login_required
@require_POST
def team_role(request: HttpRequest, pk: int) -> HttpResponse:
    membership = acted_on(request, Membership.objects.select_related("user"), pk)
    if not is_owner(membership.team, request.user):
        raise PermissionDenied("only team owners may change roles")
    form = RoleForm(request.POST)
    if not form.is_valid():
        for errs in form.errors.values():
            messages.error(request, f"Role of {membership.user}: {' '.join(errs)}")
        return redirect("web:team")
    role = form.cleaned_data["role"]
    try:
        teams.change_role(membership, role)
    except teams.TeamRefused as exc:
        messages.error(request, str(exc))
    else:
        messages.success(request, f"{membership.user} is now {role}.")
    return redirect("web:team")


@login_required
@require_POST
def invite_cancel(request: HttpRequest, pk: int) -> HttpResponse:
    invitation = acted_on(request, Invitation.objects.all(), pk)
    if not is_owner(invitation.team, request.user):
        raise PermissionDenied("only team owners may withdraw invitations")
    teams.withdraw_invitation(invitation)
    return redirect("web:team")
