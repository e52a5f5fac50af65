"""The keys API: list, create (secret shown once), rotate, revoke, and who may do what."""

from __future__ import annotations

import pytest
from rest_framework.test import APIClient

from accounts.models import ApiKey

pytestmark = pytest.mark.django_db

KEYS = "/api/v1/keys"


def bearer(plaintext: str) -> APIClient:
    client = APIClient()
    client.credentials(HTTP_AUTHORIZATION=f"Bearer {plaintext}")
    return client


def test_it_creates_a_key_and_shows_the_secret_once(owner_client):
    response = owner_client.post(KEYS, {"name": "laptop"}, format="json")
    assert response.status_code == 201
    body = response.json()
    assert body["key"].startswith("otk_") and body["prefix"] == body["key"][:16]
    assert body["team"] == "acme" and body["active"] is True
    assert bearer(body["key"]).get(KEYS).status_code == 200
    listing = owner_client.get(KEYS).json()["results"]
    assert {k["name"] for k in listing} == {"owner-key", "laptop"}
    assert all("key" not in k and "secret_hash" not in k for k in listing)
    detail = owner_client.get(f"{KEYS}/{body['id']}").json()
    assert "key" not in detail


def test_it_validates_key_creation(owner_client):
    assert "name" in owner_client.post(KEYS, {}, format="json").json()
    response = owner_client.post(
        KEYS, {"name": "old", "expires_at": "2001-01-01T00:00:00Z"}, format="json"
    )
    assert response.status_code == 400 and "expires_at" in response.json()


def test_it_rotates_with_grace(owner_client, owner_key):
    key, plaintext = owner_key
    response = owner_client.post(f"{KEYS}/{key.pk}/rotate", {}, format="json")
    assert response.status_code == 201
    new_plain = response.json()["key"]
    assert new_plain != plaintext
    assert bearer(plaintext).get(KEYS).status_code == 200  # still in its grace period
    assert bearer(new_plain).get(KEYS).status_code == 200
    key.refresh_from_db()
    assert key.rotated_to_id == response.json()["id"] and key.expires_at is not None
    again = bearer(new_plain).post(f"{KEYS}/{key.pk}/rotate", {}, format="json")
    assert again.status_code == 409


def test_it_rotates_with_zero_grace(owner_client, owner_key):
    key, plaintext = owner_key
    response = owner_client.post(f"{KEYS}/{key.pk}/rotate", {"grace_hours": 0}, format="json")
    assert response.status_code == 201
    assert bearer(plaintext).get(KEYS).status_code == 401
    too_long = bearer(response.json()["key"]).post(
        f"{KEYS}/{response.json()['id']}/rotate", {"grace_hours": 1000}, format="json"
    )
    assert too_long.status_code == 400 and "grace_hours" in too_long.json()


def test_it_revokes_effective_on_the_next_request(owner_client, teammate_key):
    key, plaintext = teammate_key
    response = owner_client.post(f"{KEYS}/{key.pk}/revoke")
    assert response.status_code == 200
    assert response.json()["active"] is False and response.json()["revoked_at"]
    assert bearer(plaintext).get(KEYS).status_code == 401
    assert owner_client.post(f"{KEYS}/{key.pk}/revoke").status_code == 200  # idempotent


def test_it_lets_members_manage_only_their_own_keys(teammate_client, owner_key, teammate_key):
    owners_key, _ = owner_key
    assert teammate_client.post(f"{KEYS}/{owners_key.pk}/revoke").status_code == 403
    assert (
        teammate_client.post(f"{KEYS}/{owners_key.pk}/rotate", {}, format="json").status_code == 403
    )
    assert ApiKey.objects.get(pk=owners_key.pk).is_live()
    own, _ = teammate_key
    assert teammate_client.post(f"{KEYS}/{own.pk}/revoke").status_code == 200


def test_it_lets_a_key_revoke_itself(owner_client, owner_key):
    key, _ = owner_key
    assert owner_client.post(f"{KEYS}/{key.pk}/revoke").status_code == 200
    assert owner_client.get(KEYS).status_code == 401
