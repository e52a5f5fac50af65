"""Issue an API key from the command line (for bootstrapping a fresh install).

    manage.py issue_api_key --user demo --team demo --name cli [--create]

With ``--create`` the user (no usable password), the team and an owner membership are made
when missing. The plaintext key is printed once on stdout and never stored.
"""

from __future__ import annotations

from typing import Any

from django.contrib.auth import get_user_model
from django.core.management.base import BaseCommand, CommandError, CommandParser
from django.db import transaction
from django.utils.text import slugify

from accounts import teams
from accounts.keys import issue_key
from accounts.models import Membership, Team


class Command(BaseCommand):
    help = "Issue an API key for a user in a team and print it once."

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument("--user", required=True, help="username")
        parser.add_argument("--team", required=True, help="team slug")
        parser.add_argument("--name", default="cli", help="key name")
        parser.add_argument(
            "--create", action="store_true", help="create user, team and membership if missing"
        )

    def handle(self, *args: Any, **opts: Any) -> None:
        User = get_user_model()
        slug = slugify(opts["team"])
        if not slug:
            raise CommandError("--team must contain letters or digits")
        with transaction.atomic():
            if opts["create"]:
                user, created = User.objects.get_or_create(username=opts["user"])
                if created:
                    user.set_unusable_password()
                    user.save()
                team = Team.objects.filter(slug=slug).first()
                if team is None:
                    team = teams.create_team(name=opts["team"], slug=slug, owner=user)
                else:
                    teams.add_member(team, user, Membership.Role.OWNER)
            else:
                try:
                    user = User.objects.get(username=opts["user"])
                    team = Team.objects.get(slug=slug)
                except (User.DoesNotExist, Team.DoesNotExist) as exc:
                    raise CommandError(f"{exc} (use --create to make it)") from exc
                if not Membership.objects.filter(user=user, team=team).exists():
                    raise CommandError(f"{user} is not a member of team {slug}")
            _, plaintext = issue_key(team, user, opts["name"])
        self.stdout.write(plaintext)
