"""Exported weights read back into engine policies (``workers.runners.adapters``), as eval jobs
and frozen opponents load them: every tensor accounted for, or an error that says what."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from tests.e2e.conftest import tiny_model_dir  # noqa: F401  (fixture)
from workers.runners.adapters import AdapterMismatch, load_full_model, load_peft_adapter


@pytest.fixture(scope="module")
def engine(tiny_model_dir: Path) -> Any:  # noqa: F811
    from training.engine import Engine

    return Engine(str(tiny_model_dir), device="cpu")


def test_a_full_model_loads_back_into_a_full_policy_exactly(engine: Any, tmp_path: Path) -> None:
    trained = engine.create_policy(full_finetune=True)
    gen = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for param in trained.model.parameters():
            param.add_(torch.randn(param.shape, generator=gen) * 0.01)
    trained.export_full(trained.snapshot(), tmp_path / "model")

    fresh = engine.create_policy(full_finetune=True)
    load_full_model(fresh, tmp_path / "model")
    want = dict(trained.version_model(0).named_parameters())
    got = dict(fresh.model.named_parameters())
    assert set(got) == set(want) and all(got[k].equal(want[k]) for k in want)

    lora = engine.create_policy(rank=2)
    with pytest.raises(AdapterMismatch, match="full fine-tuning policy"):
        load_full_model(lora, tmp_path / "model")
    with pytest.raises(AdapterMismatch, match="LoRA policy"):
        load_peft_adapter(fresh, tmp_path / "model")
    # A model of other weights (one tensor left out) is refused, not half loaded.
    from safetensors.torch import load_file, save_file

    (file,) = (tmp_path / "model").glob("*.safetensors")
    tensors = load_file(str(file))
    dropped = sorted(tensors)[0]
    del tensors[dropped]
    save_file(tensors, str(file))
    with pytest.raises(AdapterMismatch, match="missing"):
        load_full_model(engine.create_policy(full_finetune=True), tmp_path / "model")
