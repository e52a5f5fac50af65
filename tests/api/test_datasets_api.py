"""/api/v1/datasets: multipart upload, list, retrieve, delete; bad rows, size limit and
partial-file cleanup through real HTTP parsing; the team scope."""

from __future__ import annotations

import hashlib

import pytest
from django.core.files.uploadedfile import SimpleUploadedFile
from rest_framework.test import APIClient

from jobs import views
from jobs.models import Dataset
from tests.fixtures.accounts import MATH_ROWS, jsonl_bytes, leftovers, parquet_bytes

pytestmark = pytest.mark.django_db

DATASETS = "/api/v1/datasets"
CSRF_SECRET = "c" * 32


def upload(client: APIClient, content: bytes, filename: str = "rows.jsonl", **fields):
    body = {"name": "arith", "env": "math", **fields}
    body["file"] = SimpleUploadedFile(filename, content)
    return client.post(DATASETS, body, format="multipart")


def test_it_uploads_and_describes_a_dataset(owner_client, data_dir, team):
    content = jsonl_bytes(MATH_ROWS)
    response = upload(owner_client, content)
    assert response.status_code == 201, response.json()
    body = response.json()
    assert body["team"] == "acme" and body["created_by"] == "olivia"
    assert (body["name"], body["env"], body["format"], body["rows"]) == (
        "arith",
        "math",
        "jsonl",
        3,
    )
    assert body["sha256"] == hashlib.sha256(content).hexdigest()
    assert body["size_bytes"] == len(content) and body["ref"] == f"dataset:{body['id']}"
    assert "path" not in body  # server layout is not the client's business
    assert leftovers(data_dir) == [f"datasets/{team.pk}/{body['id']}.jsonl"]
    assert owner_client.get(f"{DATASETS}/{body['id']}").json() == body


def test_it_uploads_parquet_with_an_explicit_format(owner_client, data_dir):
    content = parquet_bytes([{"question": "1+1?", "answer": 2}] * 4)
    response = upload(owner_client, content, filename="upload.bin", format="parquet")
    assert response.status_code == 201, response.json()
    assert (response.json()["format"], response.json()["rows"]) == ("parquet", 4)


def test_it_reports_the_first_bad_rows(owner_client, data_dir):
    rows = [{"question": "q", "answer": "1"}, {"question": "q", "answer": "2"}, {"question": "q"}]
    response = upload(owner_client, jsonl_bytes(rows))
    assert response.status_code == 400
    body = response.json()
    assert body["errors"] == [{"row": 3, "field": "answer", "reason": "missing"}]
    assert "row 3" in body["detail"] and "answer" in body["detail"]
    assert leftovers(data_dir) == [] and not Dataset.objects.exists()


@pytest.mark.parametrize(
    "line, field, reason",
    [
        (b'{"question": "x", "answer": NaN}', "answer", "NaN is not allowed"),
        (b'{"question": "\\ud800", "answer": "1"}', "question", "surrogate characters"),
        # Column names are stored in PostgreSQL's jsonb, which holds no NUL.
        (b'{"question": "x", "answer": "1", "n\\u0000": 1}', "row", "a column name: null"),
        (
            b'{"question": ' + b"[" * 100_000 + b"]" * 100_000 + b', "answer": "1"}',
            "row",
            "nested too deeply",
        ),
    ],
)
def test_it_refuses_rows_it_cannot_store_faithfully(owner_client, data_dir, line, field, reason):
    content = jsonl_bytes(MATH_ROWS[:1]) + line + b"\n"
    response = upload(owner_client, content)
    assert response.status_code == 400, response.content
    [error] = response.json()["errors"]
    assert (error["row"], error["field"]) == (2, field) and reason in error["reason"]
    assert leftovers(data_dir) == [] and not Dataset.objects.exists()


@pytest.mark.parametrize(
    "fields, filename, field",
    [
        ({"env": "bandit"}, "rows.jsonl", "env"),
        ({"env": "nope"}, "rows.jsonl", "env"),
        ({"name": "a/b"}, "rows.jsonl", "name"),
        ({}, "rows.txt", "file"),
    ],
)
def test_it_names_bad_fields(owner_client, data_dir, fields, filename, field):
    response = upload(owner_client, jsonl_bytes(MATH_ROWS), filename, **fields)
    assert response.status_code == 400
    assert [e["field"] for e in response.json()["errors"]] == [field]
    assert leftovers(data_dir) == []


def test_it_requires_file_name_and_env(owner_client, data_dir):
    response = owner_client.post(DATASETS, {"name": "x"}, format="multipart")
    assert response.status_code == 400 and {"file", "env"} <= set(response.json())
    response = owner_client.post(DATASETS, {"name": "x", "env": "math"}, format="json")
    assert response.status_code == 415


def test_it_answers_409_for_a_taken_name(owner_client, teammate_client, data_dir):
    assert upload(owner_client, jsonl_bytes(MATH_ROWS)).status_code == 201
    response = upload(teammate_client, jsonl_bytes(MATH_ROWS[:1]))
    assert (
        response.status_code == 409 and "already has a dataset named" in response.json()["detail"]
    )
    assert len(leftovers(data_dir)) == 1


def test_it_refuses_oversize_uploads_with_413_and_no_leftovers(owner_client, data_dir, settings):
    settings.OPENTINKER_MAX_DATASET_BYTES = 200
    content = jsonl_bytes(MATH_ROWS * 2)
    assert len(content) > 200
    response = upload(owner_client, content)
    assert response.status_code == 413
    assert "limit of 200 bytes" in response.json()["detail"]
    # A declared body far over the limit is refused before it is read at all.
    response = upload(owner_client, b"x" * (2 << 20))
    assert response.status_code == 413
    assert leftovers(data_dir) == [] and not Dataset.objects.exists()
    settings.OPENTINKER_MAX_DATASET_BYTES = len(content)
    assert upload(owner_client, content).status_code == 201


def test_it_limits_session_uploads_whose_csrf_check_reads_the_body(
    team, owner, data_dir, settings, monkeypatch
):
    client = APIClient(enforce_csrf_checks=True)
    client.force_login(owner)
    client.cookies["csrftoken"] = CSRF_SECRET
    settings.OPENTINKER_MAX_DATASET_BYTES = 200
    real_store = views.datasets.store_dataset

    def store_small_only(**kwargs):
        # The size-limit upload handler must already have dropped an oversize file.
        chunks = list(kwargs.pop("chunks"))
        assert sum(map(len, chunks)) <= 200, "an oversize file got past the upload handler"
        return real_store(chunks=chunks, **kwargs)

    monkeypatch.setattr(views.datasets, "store_dataset", store_small_only)
    body = {"name": "s", "env": "math", "file": SimpleUploadedFile("r.jsonl", b"x" * 300)}
    response = client.post(DATASETS, body, format="multipart", HTTP_X_CSRFTOKEN=CSRF_SECRET)
    assert response.status_code == 413, response.json()
    response = client.post(DATASETS, body, format="multipart")  # no CSRF token
    assert response.status_code == 403
    body["file"] = SimpleUploadedFile("r.jsonl", jsonl_bytes(MATH_ROWS[:1]))
    response = client.post(DATASETS, body, format="multipart", HTTP_X_CSRFTOKEN=CSRF_SECRET)
    assert response.status_code == 201, response.json()
    assert len(leftovers(data_dir)) == 1


def test_it_lists_filters_and_deletes(
    owner_client, teammate_client, data_dir, django_capture_on_commit_callbacks
):
    for name, env in [("a", "math"), ("b", "math_code"), ("c", "math")]:
        assert upload(owner_client, jsonl_bytes(MATH_ROWS), name=name, env=env).status_code == 201
    listed = teammate_client.get(DATASETS).json()["results"]
    assert [d["name"] for d in listed] == ["c", "b", "a"]  # newest first
    filtered = teammate_client.get(DATASETS, {"env": "math_code"}).json()["results"]
    assert [d["name"] for d in filtered] == ["b"]
    victim = listed[0]
    with django_capture_on_commit_callbacks(execute=True):  # the file goes after the commit
        response = teammate_client.delete(f"{DATASETS}/{victim['id']}")
    assert response.status_code == 204
    assert teammate_client.get(f"{DATASETS}/{victim['id']}").status_code == 404
    assert not any(victim["id"] in path for path in leftovers(data_dir))
    assert len(leftovers(data_dir)) == 2


def test_it_filters_by_file_format(owner_client, data_dir):
    # `format` is the filter here, not DRF's renderer override (which answered 404 to it).
    assert upload(owner_client, jsonl_bytes(MATH_ROWS), name="rows").status_code == 201
    content = parquet_bytes([{"question": "1 + 1?", "answer": "2"}])
    assert upload(owner_client, content, "t.parquet", name="table").status_code == 201
    for fmt, names in [("jsonl", ["rows"]), ("parquet", ["table"])]:
        response = owner_client.get(DATASETS, {"format": fmt})
        assert response.status_code == 200, response.content
        assert [d["name"] for d in response.json()["results"]] == names
    response = owner_client.get(DATASETS, {"format": "csv"})
    assert response.status_code == 400 and "format" in response.json()
    response = owner_client.get(DATASETS, {"fromat": "jsonl"})
    assert response.status_code == 400 and "unknown query parameter" in response.json()["fromat"][0]


def test_it_refuses_to_delete_while_a_job_reads_it(owner_client, data_dir):
    dataset = upload(owner_client, jsonl_bytes(MATH_ROWS)).json()
    job = owner_client.post(
        "/api/v1/jobs",
        {"spec": {"method": "rl", "env": "math", "dataset": "arith"}},
        format="json",
    )
    assert job.status_code == 201, job.json()
    response = owner_client.delete(f"{DATASETS}/{dataset['id']}")
    assert response.status_code == 409 and job.json()["id"] in response.json()["detail"]
    owner_client.post(f"/api/v1/jobs/{job.json()['id']}/cancel")
    assert owner_client.delete(f"{DATASETS}/{dataset['id']}").status_code == 204


def test_it_keeps_datasets_inside_the_team(owner_client, outsider_client, data_dir):
    dataset = upload(owner_client, jsonl_bytes(MATH_ROWS), name="secret").json()
    assert outsider_client.get(DATASETS).json()["results"] == []
    assert outsider_client.get(f"{DATASETS}/{dataset['id']}").status_code == 404
    assert outsider_client.delete(f"{DATASETS}/{dataset['id']}").status_code == 404
    assert len(leftovers(data_dir)) == 1
    # Nor can the outsider upload into the team, or name its dataset in a job.
    response = upload(outsider_client, jsonl_bytes(MATH_ROWS), team="acme")
    assert response.status_code == 400 and "team" in response.json()
    response = outsider_client.post(
        "/api/v1/jobs",
        {"spec": {"method": "rl", "env": "math", "dataset": dataset["id"]}},
        format="json",
    )
    assert response.status_code == 400
    assert response.json()["errors"][0]["field"] == "dataset"
    # The outsider's own dataset of the same name is theirs alone.
    assert upload(outsider_client, jsonl_bytes(MATH_ROWS), name="secret").status_code == 201
    assert len(outsider_client.get(DATASETS).json()["results"]) == 1


def test_it_requires_authentication(anon_client, data_dir):
    assert anon_client.get(DATASETS).status_code in (401, 403)
    assert upload(anon_client, jsonl_bytes(MATH_ROWS)).status_code in (401, 403)
    assert leftovers(data_dir) == []
