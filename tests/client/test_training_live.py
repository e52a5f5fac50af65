"""``fit()`` and ``opentinker download`` on a real RL job: the tiny model, the math env, a real
worker. Needs the project's tiny model (``make model``); OPENTINKER_TEST_TINY_MODEL may name
another copy of it."""

from __future__ import annotations

import json
import os
import zipfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from opentinker import Client, fit

pytestmark = [pytest.mark.timeout(180), pytest.mark.django_db(transaction=True)]


@pytest.fixture
def tiny_model(tiny_base_model: Any) -> Path:
    from training.model import DEFAULT_BASE_MODEL

    path = Path(os.environ.get("OPENTINKER_TEST_TINY_MODEL") or DEFAULT_BASE_MODEL)
    if not (path / "config.json").is_file():
        pytest.skip(f"no tiny model at {path}: run `make model`")
    tiny_base_model.path = str(path)
    tiny_base_model.save()
    return path


def addition_file(tmp_path: Path, n: int = 64) -> Path:
    from training import data

    train = data.addition_split()[0]
    path = tmp_path / "add2.jsonl"
    path.write_text(
        "".join(
            json.dumps({"question": p.question(i), "answer": str(p.answer)}) + "\n"
            for i, p in enumerate(train[:n])
        )
    )
    return path


def test_it_fits_an_rl_job_and_downloads_the_adapter_and_a_checkpoint(
    tiny_model: Path, server: Any, cli: Callable[..., Any], tmp_path: Path
) -> None:
    with Client(server.url, server.key) as client:
        dataset = client.datasets.upload(addition_file(tmp_path), env="math", name="add2")
        result = fit(
            client=client,
            name="fit-rl",
            method="rl",
            env="math",
            dataset="add2",
            steps=2,
            seed=1,
            checkpoint_every=1,
            rollout={"group_size": 2, "prompts_per_step": 2, "max_tokens": 8},
            lora={"rank": 4, "alpha": 8},
            progress=False,
            output_dir=tmp_path / "out",
            timeout=150,
        )
        job = result.job
        checkpoints = job.checkpoints()
    assert job.state == "SUCCEEDED", (job.error_message, server.worker.log()[-3000:])
    assert job.spec["dataset"] == dataset.ref
    assert {"reward/mean", "loss"} <= set(result.metrics)
    assert result.adapter_path is not None
    adapter_config = json.loads((result.adapter_path / "adapter_config.json").read_text())
    assert adapter_config["r"] == 4
    assert (result.adapter_path / "adapter_model.safetensors").stat().st_size > 0

    listed = cli(
        "download", job.id, "--checkpoint", "latest", "-o", str(tmp_path / "ck"), env=server.env
    )
    assert listed.exit_code == 0, listed.stderr
    state = Path(listed.stdout.strip())
    assert [c.step for c in checkpoints] == [1, 2]
    assert state.name == f"{job.id}-{checkpoints[-1].name}-state.pt"
    assert state.stat().st_size == checkpoints[-1].size_bytes
    # torch.save writes a zip archive: the file is whole, not an error page.
    assert zipfile.is_zipfile(state)

    adapter = cli("download", job.id, "-o", str(tmp_path / "dl"), "--json", env=server.env)
    assert adapter.exit_code == 0, adapter.stderr
    unpacked = Path(adapter.json()["path"])
    assert sorted(p.name for p in unpacked.iterdir()) == [
        "adapter_config.json",
        "adapter_model.safetensors",
    ]

    missing = cli("download", job.id, "--checkpoint", "step-999999", env=server.env)
    assert missing.exit_code == 4
