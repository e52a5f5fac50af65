"""GET /api/v1/environments: what a JobSpec's `env`, `env_config` and `dataset` may say."""

from __future__ import annotations

import pytest

pytestmark = pytest.mark.django_db

URL = "/api/v1/environments"


def test_it_lists_every_registered_environment_with_its_cell(owner_client):
    response = owner_client.get(URL)
    assert response.status_code == 200
    body = {env["name"]: env for env in response.json()}
    assert set(body) >= {"math", "math_code", "bandit", "gomoku", "gomoku_selfplay"}
    assert body["math"]["data_source"] == "dataset"
    assert body["math_code"]["interaction"] == "multi_turn"
    assert body["bandit"]["dataset_columns"] is None


def test_it_names_the_dataset_columns_a_dataset_environment_needs(owner_client):
    math = owner_client.get(f"{URL}/math").json()
    columns = {c["name"]: c for c in math["dataset_columns"]}
    assert set(columns) == {"question", "answer", "context", "completion"}
    assert columns["question"]["type"] == "str"
    assert columns["answer"]["type"] == "str or number"
    assert [c["required"] for c in columns.values()] == [True, True, False, False]


def test_it_gives_the_config_schema_with_defaults_and_field_docs(owner_client):
    schema = owner_client.get(f"{URL}/math").json()["config_schema"]
    fmt = schema["properties"]["format_reward"]
    assert fmt["type"] == "number" and fmt["default"] == 0.0
    assert "boxed" in fmt["description"]
    # Nested settings (the sandbox limits of math_code) are described too.
    code = owner_client.get(f"{URL}/math_code").json()["config_schema"]
    assert "SandboxLimits" in code.get("$defs", {})


def test_it_answers_404_json_for_an_unknown_environment(owner_client):
    response = owner_client.get(f"{URL}/chess")
    assert response.status_code == 404
    assert "unknown environment 'chess'" in response.json()["detail"]


def test_it_refuses_anonymous_callers(anon_client):
    assert anon_client.get(URL).status_code in (401, 403)


def test_it_is_in_the_openapi_schema(owner_client):
    paths = owner_client.get("/api/schema/", HTTP_ACCEPT="application/json").json()["paths"]
    assert "/api/v1/environments" in paths and "/api/v1/environments/{name}" in paths
