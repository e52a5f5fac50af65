"""What Django answers itself under /api/ (no view matched, a body too large, an exception no
view caught) is JSON in DRF's shape, never an HTML page or a traceback."""

from __future__ import annotations

import pytest
from django.test import Client

pytestmark = pytest.mark.django_db


def _json_error(response, status: int) -> str:
    assert response.status_code == status
    assert response["Content-Type"].startswith("application/json")
    body = response.json()
    assert set(body) == {"detail"}
    return body["detail"]


def test_it_answers_an_unknown_api_path_with_json_404(owner_client):
    detail = _json_error(owner_client.get("/api/v1/no-such-thing"), 404)
    assert detail == "no endpoint GET /api/v1/no-such-thing"


def test_it_answers_an_unknown_tinker_endpoint_with_json_404(owner_client):
    response = owner_client.post("/api/v1/no_such_tinker_call", {}, format="json")
    assert "no_such_tinker_call" in _json_error(response, 404)


def test_it_answers_an_uncaught_exception_with_json_500_and_no_traceback(owner_client, monkeypatch):
    from jobs.views import JobViewSet

    def explode(self, request, *args, **kwargs):
        raise RuntimeError("secret internals at /srv/venv/lib/site.py line 7")

    monkeypatch.setattr(JobViewSet, "list", explode)
    owner_client.raise_request_exception = False
    response = owner_client.get("/api/v1/jobs")
    assert _json_error(response, 500) == "internal server error"
    assert b"secret internals" not in response.content


def test_it_answers_an_oversized_form_body_with_json_413(settings):
    settings.DATA_UPLOAD_MAX_MEMORY_SIZE = 1000
    response = Client().post(
        "/api/auth/login/",
        data=b"username=" + b"a" * 5000,
        content_type="application/x-www-form-urlencoded",
    )
    assert "too large" in _json_error(response, 413)


def test_it_keeps_plain_pages_for_the_web_ui():
    response = Client().get("/no-such-page/")
    assert response.status_code == 404
    assert response["Content-Type"].startswith("text/html")
    assert b"Traceback" not in response.content


@pytest.mark.parametrize("method", ["get", "post"])
def test_it_answers_the_bare_api_prefix_with_json_404_not_a_redirect(owner_client, method):
    response = getattr(owner_client, method)("/api/v1")
    assert _json_error(response, 404) == f"no endpoint {method.upper()} /api/v1"
