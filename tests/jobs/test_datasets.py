"""Dataset storage through jobs.datasets: validation per environment, atomic placement, no
leftovers after a refusal, deletion guarded by unfinished jobs, references for runners."""

from __future__ import annotations

import hashlib
import json

import pytest

from jobs import datasets, services
from jobs.datasets import (
    DatasetConflict,
    DatasetRejected,
    DatasetTooLarge,
    find_team_dataset,
    resolve_dataset_ref,
    store_dataset,
)
from jobs.models import Dataset
from tests.fixtures.accounts import MATH_ROWS, jsonl_bytes, leftovers, parquet_bytes

pytestmark = pytest.mark.django_db


def store(team, owner, content: bytes, *, name="arith", env="math", filename="rows.jsonl"):
    return store_dataset(
        team=team, user=owner, name=name, env=env, filename=filename, chunks=[content]
    )


def test_it_stores_a_valid_jsonl_file_with_row_count_and_checksum(team, owner, data_dir):
    content = jsonl_bytes(MATH_ROWS)
    dataset = store(team, owner, content)
    assert (dataset.rows, dataset.format, dataset.env) == (3, "jsonl", "math")
    assert dataset.sha256 == hashlib.sha256(content).hexdigest()
    assert dataset.size_bytes == len(content)
    assert {"question", "answer", "source"} <= set(dataset.columns)
    assert dataset.path == f"datasets/{team.pk}/{dataset.pk}.jsonl"
    assert dataset.file_path().read_bytes() == content
    assert leftovers(data_dir) == [dataset.path]


def test_it_stores_parquet_streamed_in_chunks(team, owner, data_dir):
    content = parquet_bytes([{"question": f"{i} + 1?", "answer": i + 1} for i in range(50)])
    chunks = [content[i : i + 100] for i in range(0, len(content), 100)]
    dataset = store_dataset(
        team=team, user=owner, name="p", env="math_code", filename="x.parquet", chunks=chunks
    )
    assert (dataset.rows, dataset.format) == (50, "parquet")
    assert dataset.file_path().read_bytes() == content


def test_it_reports_the_first_bad_rows_by_number_and_column(team, owner, data_dir):
    rows = [
        {"question": "ok?", "answer": "1"},
        {"question": "ok?", "answer": "2"},
        {"question": "where is the answer?"},
        {"question": "   ", "answer": True},
    ]
    content = jsonl_bytes(rows) + b"{not json\n"
    with pytest.raises(DatasetRejected) as exc:
        store(team, owner, content)
    assert exc.value.status_code == 400
    assert exc.value.errors[:3] == [
        {"row": 3, "field": "answer", "reason": "missing"},
        {"row": 4, "field": "question", "reason": "empty"},
        {"row": 4, "field": "answer", "reason": "expected str or number, got bool"},
    ]
    assert exc.value.errors[3]["row"] == 5 and "JSON" in exc.value.errors[3]["reason"]
    assert "3 of 5 rows are bad" in exc.value.detail and "row 3" in exc.value.detail
    assert leftovers(data_dir) == [] and not Dataset.objects.exists()


@pytest.mark.parametrize(
    "content, filename",
    [
        (b"", "empty.jsonl"),
        (b"\x00\x01garbage", "broken.parquet"),
        (b'["a list", "not an object"]\n', "list.jsonl"),
    ],
)
def test_it_refuses_malformed_files_without_leftovers(team, owner, data_dir, content, filename):
    with pytest.raises(DatasetRejected) as exc:
        store(team, owner, content, filename=filename)
    assert exc.value.errors and all(e["reason"] for e in exc.value.errors)
    assert leftovers(data_dir) == [] and not Dataset.objects.exists()


def test_it_refuses_parquet_with_corrupt_data_pages(team, owner, data_dir):
    rows = [{"question": f"question {i} " * 10, "answer": str(i)} for i in range(300)]
    content = bytearray(parquet_bytes(rows))
    middle = len(content) // 2
    content[middle : middle + 400] = b"\xff" * 400  # the footer stays readable
    with pytest.raises(DatasetRejected) as exc:
        store(team, owner, bytes(content), filename="c.parquet")
    assert exc.value.errors[0]["field"] == "file"
    assert exc.value.detail.startswith("could not read the file")
    assert leftovers(data_dir) == [] and not Dataset.objects.exists()


def test_it_refuses_oversize_uploads_midway_without_leftovers(team, owner, data_dir, settings):
    settings.OPENTINKER_MAX_DATASET_BYTES = 1000
    produced = []

    def chunks():
        for i in range(100):
            produced.append(i)
            yield jsonl_bytes(MATH_ROWS)  # ~150 bytes a chunk

    with pytest.raises(DatasetTooLarge) as exc:
        store_dataset(
            team=team, user=owner, name="big", env="math", filename="b.jsonl", chunks=chunks()
        )
    assert exc.value.status_code == 413 and "1000 bytes" in exc.value.detail
    assert len(produced) < 10  # stopped at the limit, did not read the whole stream
    assert leftovers(data_dir) == [] and not Dataset.objects.exists()


@pytest.mark.parametrize(
    "kwargs, field",
    [
        ({"env": "bandit"}, "env"),
        ({"env": "chess"}, "env"),
        ({"name": ""}, "name"),
        ({"name": "has space"}, "name"),
        ({"name": "builtin:arith_train"}, "name"),
        ({"name": "0b8f6c2e-4a43-4c5e-9c55-3f1b0d6f9f10"}, "name"),
        ({"filename": "rows.csv"}, "file"),
    ],
)
def test_it_names_the_bad_request_field(team, owner, data_dir, kwargs, field):
    with pytest.raises(DatasetRejected) as exc:
        store(team, owner, jsonl_bytes(MATH_ROWS), **kwargs)
    assert [e["field"] for e in exc.value.errors] == [field]
    assert leftovers(data_dir) == []


def test_it_keeps_names_unique_per_team(team, other_team, owner, outsider, data_dir):
    first = store(team, owner, jsonl_bytes(MATH_ROWS))
    with pytest.raises(DatasetConflict) as exc:
        store(team, owner, jsonl_bytes(MATH_ROWS[:1]))
    assert exc.value.status_code == 409 and "already has a dataset named 'arith'" in str(exc.value)
    # Another team may use the same name.
    theirs = store(other_team, outsider, jsonl_bytes(MATH_ROWS))
    assert leftovers(data_dir) == sorted([first.path, theirs.path])


def test_it_leaves_no_file_when_the_name_is_taken_concurrently(team, owner, data_dir, monkeypatch):
    # The name is taken between the friendly pre-check and the insert (a concurrent upload).
    real_filter = Dataset.objects.filter
    monkeypatch.setattr(datasets.Dataset.objects, "filter", lambda *a, **k: real_filter(pk=None))
    store(team, owner, jsonl_bytes(MATH_ROWS))
    with pytest.raises(DatasetConflict):
        store(team, owner, jsonl_bytes(MATH_ROWS))
    monkeypatch.undo()
    assert len(leftovers(data_dir)) == 1 and Dataset.objects.count() == 1


def test_it_deletes_the_row_and_then_the_file(
    make_dataset, data_dir, django_capture_on_commit_callbacks
):
    dataset = make_dataset()
    with django_capture_on_commit_callbacks(execute=True):
        datasets.delete_dataset(dataset)
    assert not Dataset.objects.exists() and leftovers(data_dir) == []


def test_it_refuses_to_delete_a_dataset_an_unfinished_job_reads(
    make_dataset, team, owner, data_dir, django_capture_on_commit_callbacks
):
    dataset = make_dataset()
    job = services.submit_job(
        team=team, user=owner, spec={"method": "rl", "env": "math", "dataset": "arith"}, name="j"
    )
    with pytest.raises(DatasetConflict) as exc:
        datasets.delete_dataset(dataset)
    assert str(job.pk) in exc.value.detail
    assert dataset.file_path().is_file()
    services.cancel_job(job)
    with django_capture_on_commit_callbacks(execute=True):
        datasets.delete_dataset(dataset)
    assert leftovers(data_dir) == []


def test_it_finds_datasets_by_name_id_or_reference_within_the_team(make_dataset, other_team):
    dataset = make_dataset()
    for ref in ["arith", str(dataset.pk), dataset.ref]:
        assert find_team_dataset(dataset.team_id, ref) == dataset
    assert find_team_dataset(other_team.pk, "arith") is None
    assert find_team_dataset(other_team.pk, dataset.ref) is None


def test_it_resolves_references_to_files_for_runners(make_dataset):
    dataset = make_dataset()
    path = resolve_dataset_ref(dataset.ref)
    assert [json.loads(line) for line in path.read_text().splitlines()] == MATH_ROWS
    assert resolve_dataset_ref("builtin:arith_train").is_file()
    for bad in ["builtin:nope", "dataset:not-a-uuid", "arith", f"dataset:{dataset.team_id}"]:
        with pytest.raises(LookupError):
            resolve_dataset_ref(bad)
    dataset.file_path().unlink()
    with pytest.raises(LookupError, match="missing"):
        resolve_dataset_ref(dataset.ref)
