"""ApiKeyAuthentication through real requests: Bearer, X-API-Key, tml- prefix, failures."""

from __future__ import annotations

from datetime import timedelta

import pytest
from django.utils import timezone
from rest_framework.test import APIClient

from accounts.keys import issue_key, revoke_key, rotate_key
from accounts.models import ApiKey

pytestmark = pytest.mark.django_db

URL = "/api/v1/teams"


def slugs(response) -> list[str]:
    return [t["slug"] for t in response.json()["results"]]


def test_it_accepts_a_bearer_key(owner_key):
    client = APIClient()
    client.credentials(HTTP_AUTHORIZATION=f"Bearer {owner_key[1]}")
    response = client.get(URL)
    assert response.status_code == 200
    assert slugs(response) == ["acme"]


def test_it_accepts_x_api_key_and_the_tinker_prefix(owner_key):
    client = APIClient()
    client.credentials(HTTP_X_API_KEY=owner_key[1])
    assert client.get(URL).status_code == 200
    client.credentials(HTTP_X_API_KEY="tml-" + owner_key[1])
    assert client.get(URL).status_code == 200
    client.credentials(HTTP_AUTHORIZATION="Bearer tml-" + owner_key[1])
    assert client.get(URL).status_code == 200


def test_it_answers_401_with_a_bearer_challenge(anon_client, owner_key):
    response = anon_client.get(URL)
    assert response.status_code == 401
    assert response["WWW-Authenticate"].startswith("Bearer")
    for header in (
        {"HTTP_AUTHORIZATION": "Bearer otk_nothing_here"},
        {"HTTP_AUTHORIZATION": "Bearer"},
        {"HTTP_AUTHORIZATION": f"Bearer {owner_key[1]} extra"},
        {"HTTP_X_API_KEY": owner_key[1] + "x"},
        {"HTTP_X_API_KEY": ""},
    ):
        client = APIClient()
        client.credentials(**header)
        response = client.get(URL)
        assert response.status_code == 401, header
        assert "detail" in response.json()


def test_it_refuses_a_revoked_key_on_the_next_request(owner_key):
    key, plaintext = owner_key
    client = APIClient()
    client.credentials(HTTP_AUTHORIZATION=f"Bearer {plaintext}")
    assert client.get(URL).status_code == 200
    revoke_key(key)
    response = client.get(URL)
    assert response.status_code == 401
    assert response.json()["detail"] == "Invalid, expired or revoked API key."


def test_it_refuses_an_expired_key(team, owner):
    key, plaintext = issue_key(team, owner, "short", expires_at=timezone.now() + timedelta(hours=1))
    ApiKey.objects.filter(pk=key.pk).update(expires_at=timezone.now() - timedelta(seconds=1))
    client = APIClient()
    client.credentials(HTTP_AUTHORIZATION=f"Bearer {plaintext}")
    assert client.get(URL).status_code == 401


def test_it_keeps_a_rotated_key_working_during_grace(owner_key, owner):
    key, plaintext = owner_key
    _, new_plain = rotate_key(key, user=owner)
    for value in (plaintext, new_plain):
        client = APIClient()
        client.credentials(HTTP_AUTHORIZATION=f"Bearer {value}")
        assert client.get(URL).status_code == 200
    rotate_key(ApiKey.objects.get(prefix=new_plain[4:16]), user=owner, grace=timedelta(0))
    client = APIClient()
    client.credentials(HTTP_AUTHORIZATION=f"Bearer {new_plain}")
    assert client.get(URL).status_code == 401


def test_it_records_last_used(owner_key):
    key, plaintext = owner_key
    client = APIClient()
    client.credentials(HTTP_AUTHORIZATION=f"Bearer {plaintext}")
    client.get(URL)
    key.refresh_from_db()
    assert key.last_used is not None


def test_it_scopes_a_key_to_its_team_and_a_session_to_all_memberships(
    make_team, owner, team, owner_client
):
    make_team("second", (owner, "member"))
    assert slugs(owner_client.get(URL)) == ["acme"]
    session = APIClient()
    session.force_login(owner)
    assert sorted(slugs(session.get(URL))) == ["acme", "second"]
