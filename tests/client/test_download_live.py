"""Downloads through the live API: checkpoints byte for byte, the adapter unpacked, other
artifacts as files. The job's files are laid out as the runner writes them (see
``jobs.artifacts``), so this runs without the tiny model; ``test_training_live.py`` downloads
from a real RL run."""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from opentinker import Client
from opentinker.errors import NotFound

pytestmark = [pytest.mark.timeout(60), pytest.mark.django_db(transaction=True)]


def write_run_files(data_dir: Path, job_id: str) -> dict[str, bytes]:
    root = data_dir / "jobs" / job_id
    blobs = {name: os.urandom(50_000 + i) for i, name in enumerate(("step-000001", "step-000002"))}
    index = []
    for step, (name, blob) in enumerate(blobs.items(), start=1):
        (root / "checkpoints" / name).mkdir(parents=True)
        (root / "checkpoints" / name / "state.pt").write_bytes(blob)
        index.append(json.dumps({"name": name, "created": 1.0 + step, "extra": {"step": step}}))
    (root / "checkpoints" / "checkpoints.jsonl").write_text("\n".join(index) + "\n")
    (root / "adapter").mkdir()
    blobs["adapter_config.json"] = b'{"r": 4}'
    blobs["adapter_model.safetensors"] = os.urandom(4096)
    for name in ("adapter_config.json", "adapter_model.safetensors"):
        (root / "adapter" / name).write_bytes(blobs[name])
    blobs["summary.json"] = b'{"steps": 2}'
    (root / "summary.json").write_bytes(blobs["summary.json"])
    return blobs


def test_it_downloads_checkpoints_and_artifacts(
    api: Any, data_dir: Path, cli: Callable[..., Any], tmp_path: Path
) -> None:
    with Client(api.url, api.key) as client:
        job = client.jobs.submit({"method": "smoke", "smoke_steps": 1})
        blobs = write_run_files(data_dir, job.id)

        assert [(c.name, c.step) for c in job.checkpoints()] == [
            ("step-000001", 1),
            ("step-000002", 2),
        ]
        first = job.download("step-000001", tmp_path)
        assert first.name == f"{job.id}-step-000001-state.pt"
        assert first.read_bytes() == blobs["step-000001"]
        latest = job.download(path=tmp_path / "latest.pt")
        assert latest.read_bytes() == blobs["step-000002"]
        with pytest.raises(NotFound):
            job.download("step-000009", tmp_path)

        adapter = job.download_artifact("adapter", tmp_path / "out")
        assert adapter == tmp_path / "out" / "adapter"
        for name in ("adapter_config.json", "adapter_model.safetensors"):
            assert (adapter / name).read_bytes() == blobs[name]
        assert not (tmp_path / "out" / "adapter.zip").exists()
        summary = job.download_artifact("summary.json", tmp_path / "out")
        assert summary.read_bytes() == blobs["summary.json"]
        # No half-written or temporary files are left beside the downloads.
        assert sorted(p.name for p in tmp_path.iterdir() if p.is_file()) == [
            f"{job.id}-step-000001-state.pt",
            "latest.pt",
        ]

    default = cli("download", job.id, "-o", str(tmp_path / "cli"), "--json", env=api.env)
    assert default.exit_code == 0, default.stderr
    assert Path(default.json()["path"]) == tmp_path / "cli" / "adapter"
    ckpt = cli("download", job.id, "--checkpoint", "latest", "-o", str(tmp_path / "c"), env=api.env)
    assert ckpt.exit_code == 0, ckpt.stderr
    assert Path(ckpt.stdout.strip()).read_bytes() == blobs["step-000002"]
    both = cli("download", job.id, "--checkpoint", "x", "--artifact", "y", env=api.env)
    assert both.exit_code == 2
