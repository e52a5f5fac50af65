"""Admin pages for accounts load, never show a key's hash, and revoke through the service."""

from __future__ import annotations

import pytest
from django.contrib.auth import get_user_model
from django.test import Client

from accounts.models import ApiKey

pytestmark = pytest.mark.django_db


@pytest.fixture
def admin_client_() -> Client:
    user = get_user_model().objects.create_superuser("root", "root@example.org", "pw")
    client = Client()
    client.force_login(user)
    return client


def test_it_lists_and_shows_every_accounts_model(admin_client_, team, owner_key):
    key, plaintext = owner_key
    for url in (
        "/admin/accounts/team/",
        f"/admin/accounts/team/{team.pk}/change/",
        "/admin/accounts/membership/",
        "/admin/accounts/quota/",
        f"/admin/accounts/quota/{team.quota.pk}/change/",
        "/admin/accounts/apikey/",
        f"/admin/accounts/apikey/{key.pk}/change/",
        "/admin/auth/user/",
    ):
        response = admin_client_.get(url)
        assert response.status_code == 200, url
        page = response.content.decode()
        assert key.secret_hash not in page
        # The secret is everything after "otk_<prefix>_"; it may itself contain "_".
        assert plaintext.split("_", 2)[2] not in page
    assert admin_client_.get("/admin/accounts/apikey/add/").status_code == 403


def test_it_revokes_keys_from_the_admin(admin_client_, owner_key):
    key, _ = owner_key
    response = admin_client_.post(
        "/admin/accounts/apikey/",
        {"action": "revoke_selected", "_selected_action": [key.pk]},
    )
    assert response.status_code == 302
    assert not ApiKey.objects.get(pk=key.pk).is_live()
