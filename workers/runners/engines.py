"""The engines a GPU worker keeps loaded, and the policy a JobSpec describes.

Loading a base model is the slowest part of a short job, so an engine stays loaded for the
life of the worker process and every job it runs on that base model reuses it.
"""

from __future__ import annotations

import threading
from pathlib import Path
from typing import TYPE_CHECKING

from jobs.spec import JobSpec

if TYPE_CHECKING:
    from training.engine import Engine
    from training.policy import Policy

__all__ = ["engine_for", "policy_from_spec"]

# Key: (model directory, device, float32 forced); device None lets the engine pick (CUDA when
# present).
_ENGINES: dict[tuple[str, str | None, bool], Engine] = {}
_LOCK = threading.Lock()


def engine_for(
    path: Path | str, device: str | None = None, *, full_finetune: bool = False
) -> Engine:
    """The process's engine for the base model at `path` on `device`, loaded on first use.

    A GPU engine loads the base model in bf16, which LoRA jobs train against (their adapters
    are fp32). A full fine-tuning job updates the base weights themselves, and an Adam update
    below a bf16 weight's spacing (most of them at the usual learning rates) would round away:
    off the CPU such a job gets an engine of its own in float32."""
    # Lazy: the worker imports its runners at start, before it knows it will run a job.
    import torch

    from training.engine import Engine

    float32 = full_finetune and not str(device or "").startswith("cpu")
    key = (str(path), device, float32)
    with _LOCK:
        engine = _ENGINES.get(key)
        if engine is None:
            engine = Engine(path, device=device, dtype=torch.float32 if float32 else None)
            _ENGINES[key] = engine
        return engine


def policy_from_spec(engine: Engine, spec: JobSpec, *, policy_id: str) -> Policy:
    """A fresh policy on `engine` shaped as `spec` trains it (LoRA rank and targets, or every
    weight), seeded by the spec; a saved state or adapter of that job loads into it."""
    return engine.create_policy(
        rank=spec.lora.rank,
        alpha=spec.lora.alpha,
        target_modules=spec.lora.target_modules,
        seed=spec.seed,
        full_finetune=spec.full_finetune,
        policy_id=policy_id,
    )
