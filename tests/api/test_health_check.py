"""``/healthz`` answers JSON whatever the method: load balancers and scripts parse it."""

from __future__ import annotations

import pytest
from django.test import Client

pytestmark = pytest.mark.django_db


@pytest.mark.parametrize("method", ["post", "put", "delete"])
def test_it_answers_405_json_to_a_method_other_than_get(method: str) -> None:
    # No CSRF token, as a script sends none: the answer is still the JSON 405.
    response = getattr(Client(enforce_csrf_checks=True), method)("/healthz")
    assert response.status_code == 405
    assert response["Content-Type"] == "application/json"
    assert response.json() == {"detail": f'Method "{method.upper()}" not allowed.'}
    assert response["Allow"] == "GET, HEAD"


def test_it_answers_get_and_head() -> None:
    client = Client(enforce_csrf_checks=True)
    assert client.get("/healthz").json() == {"status": "ok"}
    assert client.head("/healthz").status_code == 200
