"""Downloads of a job's files: byte ranges (a broken download continues), HEAD without a
body, validators, and metrics streamed from the database rather than built in memory."""

from __future__ import annotations

import json
import os
import tracemalloc
import zipfile
from io import BytesIO
from pathlib import Path

import pytest
from rest_framework.test import APIClient

from jobs import artifacts
from jobs.models import Job, JobMetric

pytestmark = pytest.mark.django_db

JOBS = "/api/v1/jobs"
CHECKPOINT = "step-000002"


def body(response) -> bytes:
    return b"".join(response.streaming_content) if response.streaming else response.content


@pytest.fixture
def job_files(owner_client: APIClient, data_dir: Path) -> tuple[str, bytes]:
    """A job whose workdir holds what the native runner leaves: a checkpoint of a few MiB
    (more than one read block), a summary and an adapter directory."""
    job_id = owner_client.post(JOBS, {"spec": {"method": "smoke"}}, format="json").json()["id"]
    root = artifacts.workdir(job_id)
    state = os.urandom(3 * (1 << 20) + 123)
    (root / "checkpoints" / CHECKPOINT).mkdir(parents=True)
    (root / "checkpoints" / CHECKPOINT / "state.pt").write_bytes(state)
    index = {"name": CHECKPOINT, "step": 2, "created": 1.0, "extra": {"step": 2, "attempt": 1}}
    (root / "checkpoints" / "checkpoints.jsonl").write_text(json.dumps(index) + "\n")
    (root / "summary.json").write_text(json.dumps({"steps": 2}))
    (root / "adapter").mkdir()
    (root / "adapter" / "adapter_config.json").write_text("{}")
    return job_id, state


def test_it_serves_a_byte_range_of_a_checkpoint(owner_client, job_files):
    job_id, state = job_files
    url = f"{JOBS}/{job_id}/checkpoints/{CHECKPOINT}"
    whole = owner_client.get(url)
    assert whole.status_code == 200 and whole["Accept-Ranges"] == "bytes"
    assert int(whole["Content-Length"]) == len(state) and body(whole) == state

    # A download broken after 1 MiB + 5 bytes continues from there.
    start = (1 << 20) + 5
    rest = owner_client.get(url, HTTP_RANGE=f"bytes={start}-")
    assert rest.status_code == 206
    assert rest["Content-Range"] == f"bytes {start}-{len(state) - 1}/{len(state)}"
    assert int(rest["Content-Length"]) == len(state) - start
    assert body(rest) == state[start:]

    middle = owner_client.get(url, HTTP_RANGE="bytes=10-19")
    assert middle.status_code == 206 and body(middle) == state[10:20]
    tail = owner_client.get(url, HTTP_RANGE="bytes=-7")
    assert tail.status_code == 206 and body(tail) == state[-7:]
    past_end = owner_client.get(url, HTTP_RANGE=f"bytes=5-{len(state) * 2}")
    assert past_end.status_code == 206 and body(past_end) == state[5:]


def test_it_answers_416_in_json_for_a_range_past_the_end(owner_client, job_files):
    job_id, state = job_files
    url = f"{JOBS}/{job_id}/checkpoints/{CHECKPOINT}"
    response = owner_client.get(url, HTTP_RANGE=f"bytes={len(state)}-")
    assert response.status_code == 416
    assert response["Content-Range"] == f"bytes */{len(state)}"
    assert response.json()["size"] == len(state) and "not satisfiable" in response.json()["detail"]


def test_it_sends_the_whole_file_for_ranges_it_does_not_take(owner_client, job_files):
    job_id, state = job_files
    url = f"{JOBS}/{job_id}/checkpoints/{CHECKPOINT}"
    for header in ("bytes=0-1,5-6", "bytes=9-3", "items=0-1", "bytes=-"):
        response = owner_client.get(url, HTTP_RANGE=header)
        assert response.status_code == 200, header
        assert body(response) == state


def test_it_sends_the_whole_file_when_if_range_is_stale(owner_client, job_files):
    job_id, state = job_files
    url = f"{JOBS}/{job_id}/checkpoints/{CHECKPOINT}"
    etag = owner_client.get(url)["ETag"]
    fresh = owner_client.get(url, HTTP_RANGE="bytes=0-3", HTTP_IF_RANGE=etag)
    assert fresh.status_code == 206 and body(fresh) == state[:4]
    # A resumed run saved the checkpoint again: a piece of the new file must not be spliced
    # onto the start of the old one.
    stale = owner_client.get(url, HTTP_RANGE="bytes=0-3", HTTP_IF_RANGE='"0-0"')
    assert stale.status_code == 200 and body(stale) == state


def test_it_answers_head_with_the_size_and_no_body(owner_client, job_files):
    job_id, state = job_files
    response = owner_client.head(f"{JOBS}/{job_id}/checkpoints/{CHECKPOINT}")
    assert response.status_code == 200
    assert int(response["Content-Length"]) == len(state) and body(response) == b""
    summary = owner_client.head(f"{JOBS}/{job_id}/artifacts/summary.json")
    assert summary.status_code == 200 and summary["Content-Type"] == "application/json"
    assert summary["Accept-Ranges"] == "bytes"


def test_it_takes_ranges_of_artifact_files_and_of_zipped_directories(owner_client, job_files):
    job_id, _ = job_files
    summary = owner_client.get(f"{JOBS}/{job_id}/artifacts/summary.json", HTTP_RANGE="bytes=0-0")
    assert summary.status_code == 206 and body(summary) == b"{"
    url = f"{JOBS}/{job_id}/artifacts/adapter"
    adapter_dir = artifacts.workdir(job_id) / "adapter"
    (adapter_dir / "adapter_model.safetensors").write_bytes(os.urandom(2 * (1 << 20) + 7))
    # Before any download a HEAD does not make the zip: no size yet, no body.
    head = owner_client.head(url)
    assert head.status_code == 200 and head["Content-Type"] == "application/zip"
    assert "Content-Length" not in head and body(head) == b""
    whole = owner_client.get(url)
    zipped = body(whole)
    assert whole.status_code == 200 and whole["Accept-Ranges"] == "bytes"
    with zipfile.ZipFile(BytesIO(zipped)) as zf:
        assert zf.namelist() == ["adapter_config.json", "adapter_model.safetensors"]
    # A download broken after 1 MiB continues from there; the bytes are the same zip's.
    rest = owner_client.get(url, HTTP_RANGE=f"bytes={1 << 20}-", HTTP_IF_RANGE=whole["ETag"])
    assert rest.status_code == 206 and body(rest) == zipped[1 << 20 :]
    assert int(owner_client.head(url)["Content-Length"]) == len(zipped)
    # Files written again (a resumed run exporting anew; dated 1970 here, before zip's epoch)
    # make another zip; a stale If-Range gets the whole new one, and the old zip is gone.
    (adapter_dir / "adapter_config.json").write_text('{"r": 8}')
    os.utime(adapter_dir / "adapter_config.json", ns=(1, 1))
    again = owner_client.get(url, HTTP_RANGE="bytes=5-", HTTP_IF_RANGE=whole["ETag"])
    assert again.status_code == 200 and again["ETag"] != whole["ETag"]
    with zipfile.ZipFile(BytesIO(body(again))) as zf:
        assert zf.read("adapter_config.json") == b'{"r": 8}'
    cached = list((artifacts.workdir(job_id) / artifacts.ZIP_CACHE).glob("adapter.*.zip"))
    assert len(cached) == 1
    # The zips made for downloads are not artifacts themselves.
    names = {a["name"] for a in owner_client.get(f"{JOBS}/{job_id}/artifacts").json()}
    assert not any(artifacts.ZIP_CACHE in n for n in names)


def test_it_does_not_serve_ranges_across_teams(outsider_client, job_files):
    job_id, _ = job_files
    response = outsider_client.get(
        f"{JOBS}/{job_id}/checkpoints/{CHECKPOINT}", HTTP_RANGE="bytes=0-3"
    )
    assert response.status_code == 404


def test_it_streams_metrics_jsonl_without_building_it_in_memory(owner_client, job_files):
    job_id, _ = job_files
    job = Job.objects.get(pk=job_id)
    steps = 20_000
    JobMetric.objects.bulk_create(
        [JobMetric(job=job, step=s, name=n, value=s / 7) for s in range(steps) for n in "ab"],
        batch_size=5000,
    )
    expected_bytes = 2 * steps * len(json.dumps({"step": 10_000, "name": "a", "value": 0.1}))
    tracemalloc.start()
    try:
        response = owner_client.get(f"{JOBS}/{job_id}/artifacts/{artifacts.METRICS_ARTIFACT}")
        _, peak_before_sending = tracemalloc.get_traced_memory()
        tracemalloc.reset_peak()
        size = 0
        first = None
        for chunk in response.streaming_content:
            size += len(chunk)
            first = first or chunk
        _, peak_while_sending = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert response.status_code == 200 and response["Content-Type"] == "application/jsonl"
    assert f"{job_id}-metrics.jsonl" in response["Content-Disposition"]
    assert json.loads(first.split(b"\n")[0]) == {"step": 0, "name": "a", "value": 0.0}
    assert size >= expected_bytes * 0.9
    # The answer is made while it is sent, a batch of rows at a time: no copy of it whole.
    assert peak_before_sending < expected_bytes / 4, (peak_before_sending, expected_bytes)
    assert peak_while_sending < expected_bytes / 2, (peak_while_sending, expected_bytes)
