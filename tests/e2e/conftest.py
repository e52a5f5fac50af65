"""End-to-end fixtures: the project's tiny model, a data directory shared with the worker
subprocess, and a 2-digit addition dataset (what the tiny model was pre-trained on, so RL
starts with some right answers and a real gradient)."""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from tests.e2e.rows import addition_rows
from tests.fixtures.workers import WorkerProcess
from training.model import DEFAULT_BASE_MODEL, TINY_VL_MODEL


@pytest.fixture(scope="session")
def tiny_model_dir() -> Path:
    """The base model the jobs train: models/tiny-chat, or OPENTINKER_TEST_MODEL_DIR."""
    path = Path(os.environ.get("OPENTINKER_TEST_MODEL_DIR") or DEFAULT_BASE_MODEL)
    if not (path / "config.json").is_file():
        pytest.skip(f"no model at {path}: run `make model` (scripts/build_tiny_model.py)")
    return path


@pytest.fixture
def shared_data_dir(tmp_path: Path, settings: Any, monkeypatch: pytest.MonkeyPatch) -> Path:
    """One OPENTINKER_DATA_DIR for this process (the API) and the worker it starts next."""
    path = tmp_path / "data"
    path.mkdir()
    settings.OPENTINKER_DATA_DIR = path
    monkeypatch.setenv("OPENTINKER_DATA_DIR", str(path))
    # Each worker child keeps torch to one thread: two cores serve the test and the worker.
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    return path


@pytest.fixture
def trainer(
    tiny_model_dir: Path,
    tiny_base_model: Any,
    shared_data_dir: Path,
    start_worker: Callable[..., WorkerProcess],
) -> Callable[..., WorkerProcess]:
    """Factory for real Celery workers that see the tiny model and the shared data dir."""
    tiny_base_model.path = str(tiny_model_dir)
    tiny_base_model.save(update_fields=["path"])

    def start(**kwargs: Any) -> WorkerProcess:
        return start_worker(slots=1, **kwargs)

    return start


@pytest.fixture
def vl_trainer(
    shared_data_dir: Path, start_worker: Callable[..., WorkerProcess], tiny_base_model: Any
) -> Callable[..., WorkerProcess]:
    """Factory for real Celery workers that train the tiny vision-language model."""
    from jobs.models import BaseModel

    if not (Path(TINY_VL_MODEL) / "config.json").is_file():
        pytest.skip("no models/tiny-vl: run scripts/build_tiny_vl_model.py")
    BaseModel.objects.get_or_create(
        name="tiny-vl",
        defaults={"path": "models/tiny-vl", "max_lora_rank": 64, "max_context": 1024},
    )
    return lambda **kwargs: start_worker(slots=1, **kwargs)


@pytest.fixture
def addition_dataset(owner_client: Any, shared_data_dir: Path) -> str:
    """Uploaded through the API; returns its id."""
    body = b"".join(json.dumps(r).encode() + b"\n" for r in addition_rows(600))
    from django.core.files.uploadedfile import SimpleUploadedFile

    response = owner_client.post(
        "/api/v1/datasets",
        {
            "file": SimpleUploadedFile("add.jsonl", body, content_type="application/jsonl"),
            "name": "add2",
            "env": "math",
        },
        format="multipart",
    )
    assert response.status_code == 201, response.content
    return str(response.json()["id"])
