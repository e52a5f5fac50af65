"""What a Tinker ``lora_config`` means for the engine: scaling and target modules."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from tinker_api.worker.requests import RequestError

# Tinker's LoRA scaling is alpha / rank with a fixed alpha.
LORA_ALPHA = 32.0
ATTN_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj")
MLP_MODULES = ("gate_proj", "up_proj", "down_proj")


def target_modules(config: Mapping[str, Any], unembed: str | None = "lm_head") -> tuple[str, ...]:
    """LoRA targets of a model's ``lora_config``; ``unembed`` names the base model's output
    head (``train_unembed``: LoRA on the unembedding, as the SDK documents it)."""
    modules: tuple[str, ...] = ()
    if config.get("train_attn", True):
        modules += ATTN_MODULES
    if config.get("train_mlp", True):
        modules += MLP_MODULES
    if config.get("train_unembed", True):
        if unembed is None:
            raise RequestError("lora_config.train_unembed: this base model has no output head")
        modules += (unembed,)
    if not modules:
        raise RequestError("lora_config must train the attention, the MLP or the unembedding")
    return modules
