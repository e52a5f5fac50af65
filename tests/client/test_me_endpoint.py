"""GET /api/v1/me, what `opentinker whoami` shows: the caller, their teams, the key in use."""

from __future__ import annotations

from typing import Any

from rest_framework.test import APIClient

from accounts.models import Membership


def test_it_shows_the_key_and_only_its_team_for_key_auth(
    owner_client: APIClient, owner_key: tuple[Any, str], make_team: Any, owner: Any
) -> None:
    make_team("side", (owner, Membership.Role.MEMBER))
    body = owner_client.get("/api/v1/me").json()
    assert body["username"] == "olivia"
    # A key acts for its own team only, whatever else its creator belongs to.
    assert [(t["slug"], t["role"]) for t in body["teams"]] == [("acme", "owner")]
    assert body["key"]["id"] == owner_key[0].pk and body["key"]["active"] is True
    assert "secret" not in str(body["key"]) and owner_key[1] not in str(body)


def test_it_lists_every_team_for_a_session(
    make_team: Any, owner: Any, team: Any, other_team: Any
) -> None:
    make_team("side", (owner, Membership.Role.MEMBER))
    client = APIClient()
    client.force_login(owner)
    body = client.get("/api/v1/me").json()
    assert body["key"] is None
    assert [(t["slug"], t["role"]) for t in body["teams"]] == [
        ("acme", "owner"),
        ("side", "member"),
    ]


def test_it_refuses_anonymous_callers(db: None) -> None:
    assert APIClient().get("/api/v1/me").status_code == 401
