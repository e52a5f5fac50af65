"""Bad input is a 400 naming what is wrong: JSON nested too deep, fields the endpoint does not
have, names with control or bidi characters or nothing visible. And a key in X-API-Key counts
even when a proxy adds its own Authorization header."""

from __future__ import annotations

import base64
import json

import pytest

from accounts.models import ApiKey
from jobs.models import Job

pytestmark = pytest.mark.django_db

JOBS = "/api/v1/jobs"
KEYS = "/api/v1/keys"


def _nested(depth: int) -> object:
    value: object = 1
    for _ in range(depth):
        value = {"a": value}
    return value


def _post_raw(client, url: str, body: str):
    return client.post(url, data=body, content_type="application/json")


@pytest.mark.parametrize("url", [JOBS, KEYS])
def test_it_refuses_json_nested_thousands_deep(owner_client, url):
    response = _post_raw(owner_client, url, "[" * 5000 + "]" * 5000)
    assert response.status_code == 400
    assert "nested deeper than 64 levels" in response.json()["detail"]


def test_it_refuses_a_deep_env_config_inside_a_spec(owner_client):
    spec = {"method": "rl", "env": "bandit", "env_config": _nested(200)}
    response = _post_raw(owner_client, JOBS, json.dumps({"spec": spec}))
    assert response.status_code == 400
    assert "nested deeper" in response.json()["detail"]
    assert not Job.objects.exists()


def test_it_accepts_ordinary_nesting(owner_client):
    response = owner_client.post(JOBS, {"spec": {"method": "smoke"}, "name": "ok"}, format="json")
    assert response.status_code == 201, response.json()


@pytest.mark.parametrize(
    "url, body",
    [
        (JOBS, {"spec": {"method": "smoke"}, "priorty": 5}),
        (KEYS, {"name": "laptop", "expires": "tomorrow"}),
    ],
)
def test_it_refuses_unknown_top_level_fields_naming_them(owner_client, url, body):
    response = owner_client.post(url, body, format="json")
    assert response.status_code == 400
    unknown = next(k for k in body if k not in {"spec", "name"})
    assert "unknown field" in response.json()[unknown][0]
    assert not Job.objects.exists()


@pytest.mark.parametrize(
    "name, reason",
    [
        ("invoice\u202egpj.exe", "bidirectional"),
        ("\x1b[31mred", "control characters"),
        ("two\nlines", "control characters"),
        ("\u200b\u200b", "visible character"),
    ],
)
@pytest.mark.parametrize("url", [JOBS, KEYS])
def test_it_refuses_names_that_hide_or_forge_text(owner_client, url, name, reason):
    body = {"name": name, "spec": {"method": "smoke"}} if url == JOBS else {"name": name}
    response = owner_client.post(url, body, format="json")
    assert response.status_code == 400
    assert reason in response.json()["name"][0]


def test_it_keeps_names_in_any_script(owner_client):
    body = {"name": "训练 — تجربة 👩\u200d🔬", "spec": {"method": "smoke"}}
    assert owner_client.post(JOBS, body, format="json").status_code == 201


def test_it_takes_the_x_api_key_beside_a_proxys_basic_credentials(anon_client, owner_key):
    basic = base64.b64encode(b"proxy:secret").decode()
    response = anon_client.get(
        "/api/v1/me", HTTP_AUTHORIZATION=f"Basic {basic}", HTTP_X_API_KEY=owner_key[1]
    )
    assert response.status_code == 200


def _cursor(query: str) -> str:
    return base64.b64encode(query.encode()).decode()


@pytest.mark.parametrize(
    "cursor",
    [
        "cD0yMDI2",  # base64 of "p=2026": a position that is no timestamp
        _cursor("p=2026-13-45 10:00:00+00:00"),
        _cursor("p=2026-01-01 10:00:00"),  # no time zone: never one this API wrote
        _cursor("p=9999-12-31 23:59:59-14:00"),
        _cursor("o=1&r=1&p=" + "x" * 300),
        "abc",  # not base64 at all
    ],
)
def test_it_refuses_a_tampered_cursor_on_every_list(owner_client, cursor):
    job = owner_client.post(JOBS, {"spec": {"method": "smoke"}}, format="json").json()
    for url in (JOBS, KEYS, "/api/v1/datasets", f"{JOBS}/{job['id']}/events"):
        response = owner_client.get(url, {"cursor": cursor})
        assert response.status_code == 400, (url, response.content)
        assert response.json() == {"cursor": ["invalid cursor"]}


def test_it_follows_the_cursors_it_wrote(owner_client):
    for _ in range(3):
        owner_client.post(JOBS, {"spec": {"method": "smoke"}}, format="json")
    first = owner_client.get(JOBS, {"limit": 2}).json()
    second = owner_client.get(first["next"])
    assert second.status_code == 200 and len(second.json()["results"]) == 1
    back = owner_client.get(second.json()["previous"])
    assert back.status_code == 200 and back.json()["results"] == first["results"]


def _surrogate_bodies(owner_client, owner_key) -> list[tuple[str, dict]]:
    job = owner_client.post(JOBS, {"spec": {"method": "smoke"}}, format="json").json()
    return [
        (JOBS, {"\ud800": 1, "spec": {"method": "smoke"}}),
        (JOBS, {"kind": "\ud800", "spec": {"method": "smoke"}}),
        (JOBS, {"spec": {"method": "rl", "env": "bandit", "env_config": {"\ud800": 1}}}),
        (JOBS, {"name": "a\udfffb", "spec": {"method": "smoke"}}),
        (f"{KEYS}/{owner_key[0].pk}/rotate", {"\ud800": 1}),
        (f"{JOBS}/{job['id']}/sample", {"messages": [{"role": "\ud800", "content": "x"}]}),
    ]


def test_it_answers_a_lone_surrogate_with_a_json_400_naming_where(owner_client, owner_key):
    expected = ["the body: a key", "kind", "spec.env_config: a key", "name", "the body", "role"]
    for (url, body), where in zip(_surrogate_bodies(owner_client, owner_key), expected):
        # json.dumps writes the surrogate as the \ud800 escape a client would send.
        response = _post_raw(owner_client, url, json.dumps(body))
        assert response.status_code == 400, (url, response.content)
        detail = response.content.decode("utf-8")
        assert where in detail and "surrogate" in detail, (url, detail)
    assert Job.objects.count() == 1
    assert ApiKey.objects.count() == 1 and ApiKey.objects.get().expires_at is None


@pytest.mark.parametrize(
    "spec, field",
    [
        ({"method": "smoke", "base_model": "tiny\x00"}, "base_model"),
        ({"method": "rl", "env": "math", "dataset": "dataset:\x00"}, "dataset"),
        ({"method": "rl", "env": "bandit", "env_config": {"arms\x00": 2}}, "env_config"),
    ],
)
def test_it_refuses_a_nul_in_a_spec_naming_where(owner_client, spec, field):
    # PostgreSQL's jsonb holds no NUL, nor its text: stored or looked up, the query failed.
    response = owner_client.post(JOBS, {"spec": spec}, format="json")
    assert response.status_code == 400, response.content
    (error,) = response.json()["errors"]
    assert error["field"] == field and "null characters" in error["reason"]
    assert not Job.objects.exists()


def test_it_answers_a_team_slug_with_a_nul_with_a_json_404(owner_client):
    response = owner_client.get("/api/v1/teams/acme%00")
    assert response.status_code == 404 and response["Content-Type"] == "application/json"
    assert owner_client.get("/api/v1/teams/acme").status_code == 200


@pytest.mark.parametrize("url", [KEYS, "/api/v1/teams", "/api/v1/base-models"])
def test_it_refuses_query_parameters_every_list_does_not_take(owner_client, url):
    # ?team= on the keys of a user in two teams listed both teams' keys.
    response = owner_client.get(url, {"team": "acme"})
    assert response.status_code == 400
    assert "unknown query parameter" in response.json()["team"][0]
    assert owner_client.get(url).status_code == 200


def test_it_renders_an_answer_that_echoes_a_lone_surrogate_as_json():
    from accounts.renderers import SurrogateSafeJSONRenderer

    rendered = SurrogateSafeJSONRenderer().render({"\ud800": ["unknown field"], "ok": "é"})
    assert json.loads(rendered) == {"\ud800": ["unknown field"], "ok": "é"}
    # Answers without one keep their characters unescaped.
    assert SurrogateSafeJSONRenderer().render({"ok": "é"}) == '{"ok":"é"}'.encode()


@pytest.mark.parametrize("limit", ["abc", "-1", "0", "100000", "1.5", ""])
def test_it_refuses_a_bad_limit_on_the_event_log_as_on_every_list(owner_client, limit):
    job = owner_client.post(JOBS, {"spec": {"method": "smoke"}}, format="json").json()
    for url, most in ((f"{JOBS}/{job['id']}/events", 1000), (JOBS, 500)):
        response = owner_client.get(url, {"limit": limit})
        assert response.status_code == 400, (url, response.content)
        assert response.json() == {"limit": [f"must be an integer in [1, {most}]."]}
    assert owner_client.get(f"{JOBS}/{job['id']}/events", {"limit": 1000}).status_code == 200
