"""geometry3k-style uploads as a zip: one JSONL file of rows and the image files they name,
stored as JSONL with every image inline; bad archives refused with nothing left behind."""

from __future__ import annotations

import base64
import io
import json
import random
import zipfile
from typing import Any

import pytest

from jobs.datasets import DatasetRejected, store_dataset
from jobs.models import Dataset
from tests.fixtures.accounts import leftovers
from training import geometry

pytestmark = pytest.mark.django_db


def _zip(members: dict[str, bytes]) -> bytes:
    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w", zipfile.ZIP_DEFLATED) as archive:
        for name, data in members.items():
            archive.writestr(name, data)
    return buffer.getvalue()


def _jsonl(rows: list[dict[str, Any]]) -> bytes:
    return b"".join(json.dumps(r).encode() + b"\n" for r in rows)


def _pictures(n: int) -> list[bytes]:
    rng = random.Random(3)
    return [geometry.shape_picture(rng)[0] for _ in range(n)]


def store(team: Any, owner: Any, content: bytes, name: str = "geo") -> Dataset:
    return store_dataset(
        team=team, user=owner, name=name, env="geometry", filename="geo3k.zip", chunks=[content]
    )


def test_it_inlines_the_images_a_zipped_jsonl_names(team, owner, data_dir):
    pictures = _pictures(3)
    rows = [
        {"images": ["imgs/0.png"], "problem": "<image>Find x.", "answer": "3"},
        # Relative to the archive's root as well as to the JSONL's folder.
        {"images": ["geo3k/imgs/1.png", "imgs/2.png"], "problem": "Find y.", "answer": "4"},
        # Already inline: left as it is.
        {"images": [base64.b64encode(pictures[0]).decode()], "problem": "z?", "answer": 5},
    ]
    content = _zip(
        {
            "geo3k/train.jsonl": _jsonl(rows),
            **{f"geo3k/imgs/{i}.png": p for i, p in enumerate(pictures)},
        }
    )
    dataset = store(team, owner, content)
    assert (dataset.rows, dataset.format) == (3, "jsonl")
    assert dataset.path.endswith(".jsonl")
    stored = [json.loads(line) for line in dataset.file_path().read_text().splitlines()]
    assert [[base64.b64decode(i) for i in r["images"]] for r in stored] == [
        [pictures[0]],
        [pictures[1], pictures[2]],
        [pictures[0]],
    ]
    assert [r["problem"] for r in stored] == [r["problem"] for r in rows]
    assert leftovers(data_dir) == [dataset.path]


@pytest.mark.parametrize(
    "members, words",
    [
        ({"a.jsonl": b"{}\n", "b.jsonl": b"{}\n"}, "exactly one .jsonl file"),
        ({"img.png": b"x"}, "exactly one .jsonl file"),
    ],
)
def test_it_refuses_an_archive_without_one_jsonl_file(team, owner, data_dir, members, words):
    with pytest.raises(DatasetRejected) as exc:
        store(team, owner, _zip(members))
    assert words in exc.value.detail
    assert exc.value.errors[0]["field"] == "file"
    assert leftovers(data_dir) == [] and not Dataset.objects.exists()


def test_it_refuses_a_file_that_is_not_a_zip(team, owner, data_dir):
    with pytest.raises(DatasetRejected) as exc:
        store(team, owner, b"PK\x03\x04 not really")
    assert "not a readable zip archive" in exc.value.detail
    assert leftovers(data_dir) == []


def test_it_names_the_row_whose_image_is_missing(team, owner, data_dir):
    (picture,) = _pictures(1)
    rows = [
        {"images": ["a.png"], "problem": "x?", "answer": "1"},
        {"images": ["missing.png"], "problem": "y?", "answer": "2"},
    ]
    content = _zip({"rows.jsonl": _jsonl(rows), "a.png": picture})
    with pytest.raises(DatasetRejected) as exc:
        store(team, owner, content)
    first = exc.value.errors[0]
    assert (first["row"], first["field"]) == (2, "images"), exc.value.errors
    assert leftovers(data_dir) == [] and not Dataset.objects.exists()


def test_it_stops_reading_an_archive_that_unpacks_past_the_limit(team, owner, data_dir, settings):
    settings.OPENTINKER_MAX_DATASET_BYTES = 20_000
    rows = [{"images": ["big.png"], "problem": "x?", "answer": "1"}]
    # A megabyte of zeros deflates to about a kilobyte: small upload, large contents.
    content = _zip({"rows.jsonl": _jsonl(rows), "big.png": bytes(1_000_000)})
    assert len(content) < 20_000
    with pytest.raises(DatasetRejected) as exc:
        store(team, owner, content)
    assert "more than the dataset limit" in exc.value.detail
    assert leftovers(data_dir) == [] and not Dataset.objects.exists()


@pytest.mark.parametrize(
    "line, reason",
    [
        (b'{"problem": ' + b"[" * 100_000 + b"]" * 100_000 + b"}", "nested too deeply"),
        (b'{"problem": "x?", "answer": ' + b"9" * 5000 + b"}", "more than 4300 digits"),
    ],
)
def test_it_names_a_zipped_row_it_cannot_read_as_the_plain_jsonl_path_does(
    team, owner, data_dir, line, reason
):
    (picture,) = _pictures(1)
    rows = _jsonl([{"images": ["a.png"], "problem": "x?", "answer": "1"}]) + line + b"\n"
    with pytest.raises(DatasetRejected) as exc:
        store(team, owner, _zip({"rows.jsonl": rows, "a.png": picture}))
    first = exc.value.errors[0]
    assert first["row"] == 2 and reason in first["reason"], exc.value.errors
    assert leftovers(data_dir) == [] and not Dataset.objects.exists()
