"""The engines a worker keeps: one per base model and device, and a float32 one off the CPU
for full fine-tuning, whose bf16 updates would round away."""

from __future__ import annotations

import torch

import training.engine
from training.model import DEFAULT_BASE_MODEL
from workers.runners import engines


def test_full_fine_tuning_on_the_cpu_shares_the_float32_engine(monkeypatch):
    monkeypatch.setattr(engines, "_ENGINES", {})
    lora = engines.engine_for(DEFAULT_BASE_MODEL, "cpu")
    full = engines.engine_for(DEFAULT_BASE_MODEL, "cpu", full_finetune=True)
    assert full is lora
    assert next(full.model.parameters()).dtype == torch.float32


def test_full_fine_tuning_off_the_cpu_gets_a_float32_engine_of_its_own(monkeypatch):
    """A GPU engine is bf16 by default; what the runner asks of the engine is checked here
    without a GPU (the engine itself is recorded, not built)."""
    built = []

    class Recorded:
        def __init__(self, path, device=None, *, dtype=None):
            built.append((str(path), device, dtype))

    monkeypatch.setattr(engines, "_ENGINES", {})
    monkeypatch.setattr(training.engine, "Engine", Recorded)
    lora = engines.engine_for(DEFAULT_BASE_MODEL, "cuda:0")
    full = engines.engine_for(DEFAULT_BASE_MODEL, "cuda:0", full_finetune=True)
    again = engines.engine_for(DEFAULT_BASE_MODEL, "cuda:0", full_finetune=True)
    assert full is again and full is not lora
    assert built == [
        (str(DEFAULT_BASE_MODEL), "cuda:0", None),
        (str(DEFAULT_BASE_MODEL), "cuda:0", torch.float32),
    ]
