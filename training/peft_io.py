"""LoRA adapters on disk in peft's format: one reader and writer for every part of the house.

An adapter directory holds ``adapter_config.json`` and ``adapter_model.safetensors``; tensor
keys are ``base_model.model.<module>.lora_A.weight`` and ``...lora_B.weight``, the names
``PeftModel.from_pretrained`` and vLLM's LoRA loader read. In memory an adapter is a mapping
from module name to its ``(A, B)`` pair, as ``LoRAHost`` and ``Policy.lora_weights`` hold it.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

if TYPE_CHECKING:
    import torch

WEIGHTS_FILE = "adapter_model.safetensors"
CONFIG_FILE = "adapter_config.json"
KEY_PREFIX = "base_model.model."

Part = Literal["A", "B"]
LoraPairs = Mapping[str, tuple["torch.Tensor", "torch.Tensor"]]


def peft_key(module: str, part: Part) -> str:
    """The safetensors key of one LoRA factor of ``module`` (e.g. ``model.layers.0.q_proj``)."""
    return f"{KEY_PREFIX}{module}.lora_{part}.weight"


def parse_peft_key(key: str) -> tuple[str, Part] | None:
    """(module, part) of a peft LoRA key; None for any other tensor (biases, embeddings)."""
    if not key.startswith(KEY_PREFIX):
        return None
    for part in ("A", "B"):
        suffix = f".lora_{part}.weight"
        if key.endswith(suffix):
            return key[len(KEY_PREFIX) : -len(suffix)], part
    return None


def peft_keys(modules: Mapping[str, Any]) -> set[str]:
    """Every key an adapter of these modules holds: exactly one A and one B per module."""
    return {peft_key(module, part) for module in modules for part in ("A", "B")}


def weights_path(adapter_dir: str | os.PathLike[str]) -> Path:
    return Path(adapter_dir) / WEIGHTS_FILE


def to_peft_tensors(weights: LoraPairs) -> dict[str, torch.Tensor]:
    """Module pairs as peft-named tensors, detached, on the CPU and contiguous (safetensors
    writes nothing else)."""
    tensors = {}
    for module, (a, b) in weights.items():
        tensors[peft_key(module, "A")] = a.detach().cpu().contiguous()
        tensors[peft_key(module, "B")] = b.detach().cpu().contiguous()
    return tensors


def from_peft_tensors(
    tensors: Mapping[str, torch.Tensor],
) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """Peft-named tensors as module pairs; a module with an A but no B is a ``KeyError``."""
    pairs = {}
    for key, a in tensors.items():
        parsed = parse_peft_key(key)
        if parsed is None or parsed[1] != "A":
            continue
        module = parsed[0]
        pairs[module] = (a, tensors[peft_key(module, "B")])
    return pairs


def read_adapter_tensors(
    adapter_dir: str | os.PathLike[str], device: str | torch.device = "cpu"
) -> dict[str, torch.Tensor]:
    """The raw peft-named tensors of an adapter directory, loaded onto ``device``."""
    # Loaded here, not at import: the key and file names serve processes without torch.
    from safetensors.torch import load_file

    return load_file(str(weights_path(adapter_dir)), device=str(device))


def read_adapter(
    adapter_dir: str | os.PathLike[str], device: str | torch.device = "cpu"
) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """The module pairs of an adapter directory, loaded onto ``device``."""
    return from_peft_tensors(read_adapter_tensors(adapter_dir, device))


def write_adapter_weights(
    out_dir: str | os.PathLike[str],
    weights: LoraPairs,
    *,
    metadata: Mapping[str, str] | None = None,
) -> Path:
    """Write ``adapter_model.safetensors`` into ``out_dir`` (created if missing); the config
    is peft's own (``LoraConfig.save_pretrained``), written by the caller."""
    from safetensors.torch import save_file

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    save_file(
        to_peft_tensors(weights),
        str(out / WEIGHTS_FILE),
        metadata=None if metadata is None else dict(metadata),
    )
    return out
